"""Device selection (train/parallel/devices.py): local ranks against the GPUs of a node, the
VARBATCH_KIT_PRETEND_CUDA switch, and the process setup that follows the run's device."""

from __future__ import annotations

import pytest
import torch

from varbatch_kit import Rollouts, ScheduleConfig
from varbatch_kit.train import NodesConfig, TrainConfig, run
from varbatch_kit.train.parallel import cpu_shim
from varbatch_kit.train.parallel.devices import (
    PRETEND_CUDA_ENV,
    choose_device,
    cuda_visible,
    local_gpu_count,
    pretended_gpus,
    select_device,
)

REAL_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


# --------------------------------------------------------------------- the pure rule
@pytest.mark.parametrize(("gpus", "nnodes", "world", "requested", "device", "local"), [
    (8, 2, 16, "auto", "cuda", 8),  # 2 nodes x 8 GPUs, 16 ranks: CUDA (the global count: never)
    (8, 2, 16, "cuda", "cuda", 8),
    (4, 4, 16, "auto", "cuda", 4),
    (8, 1, 8, "auto", "cuda", 8),
    (8, 1, 16, "auto", "cpu", 16),  # one node cannot hold 16 ranks on 8 GPUs
    (4, 2, 16, "auto", "cpu", 8),  # 8 local ranks on 4 GPUs per node
    (0, 1, 1, "auto", "cpu", 1),  # a CPU-only host
    (8, 2, 16, "cpu", "cpu", 8),  # asked for the CPU: the CPU, whatever the host has
    (1, 1, 1, "cpu", "cpu", 1),
])
def test_choose_device_compares_local_ranks_with_the_gpus_of_a_node(gpus, nnodes, world,
                                                                    requested, device, local):
    got = choose_device(requested, gpus_per_node=gpus, nnodes=nnodes, world_size=world)
    assert (got.device, got.local_ranks, got.gpus_per_node, got.requested) == (
        device, local, gpus, requested)


def test_auto_falls_back_to_the_cpu_and_says_why():
    got = choose_device("auto", gpus_per_node=4, nnodes=2, world_size=16)
    assert got.device == "cpu"
    assert got.reason == ("run.device='auto' fell back to the CPU: 4 GPUs per node for 8 local "
                          "ranks per node (dp*cp*pp*tp=16 over nnodes=2)")
    assert got.to_dict() == {"requested": "auto", "device": "cpu", "local_ranks": 8,
                             "gpus_per_node": 4, "reason": got.reason}


def test_cuda_that_cannot_serve_the_layout_is_a_clear_error():
    with pytest.raises(ValueError, match=r"run.device='cuda' but 4 GPUs per node for 8 local "
                                         r"ranks per node \(dp\*cp\*pp\*tp=16 over nnodes=2\)"):
        choose_device("cuda", gpus_per_node=4, nnodes=2, world_size=16)
    with pytest.raises(ValueError, match="0 GPUs per node for 1 local rank per node"):
        choose_device("cuda", gpus_per_node=0, nnodes=1, world_size=1)


@pytest.mark.parametrize(("kw", "match"), [
    ({"requested": "gpu"}, "run.device='gpu'; choose 'auto', 'cpu' or 'cuda'"),
    ({"nnodes": 3}, "nnodes=3 does not divide world_size=16"),
    ({"gpus_per_node": -1}, "gpus_per_node=-1: give an integer >= 0"),
    ({"nnodes": 0}, "nnodes=0: give an integer >= 1"),
    ({"world_size": 2.0}, "world_size=2.0: give an integer >= 1"),
])
def test_choose_device_refuses_bad_inputs(kw, match):
    args = {"requested": "auto", "gpus_per_node": 8, "nnodes": 2, "world_size": 16, **kw}
    requested = args.pop("requested")
    with pytest.raises(ValueError, match=match):
        choose_device(requested, **args)


# --------------------------------------------------------------------- the switch
@pytest.mark.parametrize("value", ["", "0"])
def test_the_switch_off_is_the_real_host(monkeypatch, value):
    monkeypatch.setenv(PRETEND_CUDA_ENV, value)
    assert pretended_gpus() is None
    assert cuda_visible() is REAL_CUDA
    assert local_gpu_count() == (torch.cuda.device_count() if REAL_CUDA else 0)


def test_the_switch_makes_the_engine_see_n_gpus_and_leaves_torch_alone(monkeypatch):
    monkeypatch.setenv(PRETEND_CUDA_ENV, "4")
    assert pretended_gpus() == 4
    assert cuda_visible() is True and local_gpu_count() == 4
    assert cpu_shim.needed() is False  # the shim's host default: CUDA present
    assert torch.cuda.is_available() is REAL_CUDA  # the global torch is not patched


@pytest.mark.parametrize("value", ["yes", "-1", "1.5"])
def test_a_bad_switch_value_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(PRETEND_CUDA_ENV, value)
    with pytest.raises(ValueError, match=f"{PRETEND_CUDA_ENV}={value!r}: give the number of GPUs"):
        pretended_gpus()


def _cfg(dp: int, device: str, nnodes: int = 1) -> TrainConfig:
    nodes = NodesConfig(nnodes=nnodes, rdzv_endpoint="node0:29500" if nnodes > 1 else None)
    return TrainConfig(schedule=ScheduleConfig(dp=dp, global_batch_size=4, max_tokens_per_gpu=64),
                       nodes=nodes).with_(device=device)


def test_select_device_takes_the_decisions_of_a_gpu_host(monkeypatch):
    monkeypatch.setenv(PRETEND_CUDA_ENV, "1")
    got = select_device(_cfg(2, "auto"))
    assert got.device == "cpu" and "fell back to the CPU: 1 GPU per node for 2 local" in got.reason
    assert select_device(_cfg(1, "cpu")).device == "cpu"  # a CPU run on a GPU host
    with pytest.raises(ValueError, match="1 GPU per node for 2 local ranks per node "
                                         r"\(dp\*cp\*pp\*tp=4 over nnodes=2\)"):
        select_device(_cfg(4, "cuda", nnodes=2))
    monkeypatch.setenv(PRETEND_CUDA_ENV, "2")
    if REAL_CUDA:
        assert select_device(_cfg(4, "auto", nnodes=2)).device == "cuda"
    else:  # the switch only pretends: a run that would pick CUDA here has none to train on
        with pytest.raises(ValueError, match="pretends GPUs.*has no CUDA to train on"):
            select_device(_cfg(4, "auto", nnodes=2))


def test_run_refuses_an_impossible_cuda_layout_before_any_worker(monkeypatch, tmp_path):
    monkeypatch.setenv(PRETEND_CUDA_ENV, "1")
    rollouts = Rollouts.synthetic(8, prompt_len=4, response_len=4, seed=0)
    with pytest.raises(ValueError, match="run.device='cuda' but 1 GPU per node for 2 local"):
        run(_cfg(2, "cuda").with_(n_samples_per_prompt=4), rollouts, out_dir=tmp_path / "out",
            progress=False)
    assert not (tmp_path / "out").exists()  # nothing written, nothing started


# --------------------------------------------------------------------- the process setup
def test_process_setup_follows_the_run_device_not_the_host(monkeypatch):
    from varbatch_kit.train.parallel.process_setup import single_process

    monkeypatch.setenv(PRETEND_CUDA_ENV, "8")  # the engine sees a GPU host
    cpu_shim.deactivate()
    with single_process("cpu") as dev:
        assert dev == torch.device("cpu")
        assert cpu_shim.active()  # a CPU run is shimmed although CUDA is "present"
    assert not cpu_shim.active()
    with pytest.raises(ValueError, match="device='auto': give 'cpu' or 'cuda'"), \
            single_process("auto"):
        pass


def test_fp64_is_the_cpu_reference_auto_picks_the_cpu_and_cuda_is_refused(monkeypatch):
    monkeypatch.setenv(PRETEND_CUDA_ENV, "2")  # a GPU host: auto would otherwise take CUDA
    got = select_device(_cfg(1, "auto").with_(precision="fp64"))
    assert got.device == "cpu" and got.requested == "auto"
    assert got.reason.startswith("precision='fp64' runs on the CPU")
    with pytest.raises(ValueError, match=r"run.device='cuda' with precision='fp64'.*use "
                                         r"device='cpu' or 'auto'"):
        select_device(_cfg(1, "cuda").with_(precision="fp64"))
