"""`run` refuses bad inputs before any worker starts (train/runs/launch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from varbatch_kit import Rollouts, ScheduleConfig
from varbatch_kit.train import ModelConfig, TrainConfig
from varbatch_kit.train.config.sub_configs import DataConfig


def test_run_rejects_bad_inputs_before_launching():
    from varbatch_kit.train import run

    r = Rollouts(prompt_len=[0, 3], response_len=[4, 4])
    with pytest.raises(ValueError, match="prompt_len"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=1, micro_batch_size=1)), r)
    r = Rollouts(prompt_len=[2, 3], response_len=[4, 4])
    with pytest.raises(ValueError, match="max_seq_len"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=1, micro_batch_size=1),
                        model=ModelConfig(max_seq_len=5)), r)
    # two one-sample rollouts with slime's default n_samples_per_prompt=1: groups of one
    # sample, whose std is undefined (slime would train on NaN advantages)
    with pytest.raises(ValueError, match="sample 0 is alone in its reward group"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=1, micro_batch_size=1)), r)
    with pytest.raises(ValueError, match="global_batch_size"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=3, micro_batch_size=1),
                        data=DataConfig(n_samples_per_prompt=2)), r)


def test_cpu_workers_keep_large_allocations_in_the_heap_unless_the_user_says_otherwise(
        tmp_path, monkeypatch):
    """glibc's mmap for every allocation above 32 MiB (zero-filled by the kernel each
    micro-batch) is replaced for CPU workers; GPU workers and a user's own setting keep
    theirs (benchmarks/worker_malloc.py measures the gain)."""
    from varbatch_kit.train import TrainConfig
    from varbatch_kit.train.runs.launch import CPU_MALLOC_ENV, _torchrun_command

    for key in CPU_MALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    cfg = TrainConfig()
    _, env = _torchrun_command(cfg, tmp_path, None, "cpu")
    assert {k: env[k] for k in CPU_MALLOC_ENV} == CPU_MALLOC_ENV
    assert env["MALLOC_MMAP_MAX_"] == "0"
    _, env = _torchrun_command(cfg, tmp_path, None, "cuda")
    assert not set(CPU_MALLOC_ENV) & set(env)
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    _, env = _torchrun_command(cfg, tmp_path, None, "cpu")
    assert env["MALLOC_MMAP_MAX_"] == "65536"


def test_cpu_ranks_are_forked_from_a_preloaded_agent_and_cuda_ranks_start_fresh(tmp_path):
    """CPU: torchrun forks the ranks (``--start-method=fork``, the worker file run as a script)
    from its agent, which first imports what a worker imports; CUDA: ``python -m`` per rank,
    nothing preloaded (the launches themselves: tests/integration)."""
    import subprocess
    import sys

    from varbatch_kit.train import TrainConfig
    from varbatch_kit.train.runs import worker
    from varbatch_kit.train.runs.launch import _torchrun_command

    cfg = TrainConfig()
    cpu, _ = _torchrun_command(cfg, tmp_path, None, "cpu")
    assert cpu[4] == "--preload-worker"
    assert cpu[-4:] == ["--start-method=fork", "--run-path",
                        str(Path(worker.__file__).resolve()), str(tmp_path)]
    cuda, _ = _torchrun_command(cfg, tmp_path, None, "cuda")
    assert "--preload-worker" not in cuda and "--start-method=fork" not in cuda
    assert cuda[-3:] == ["-m", "varbatch_kit.train.runs.worker", str(tmp_path)]
    # preload imports every module it names, and starts no thread
    code = ("import sys, threading\n"
            "from varbatch_kit.train.runs.worker import PRELOAD_MODULES, preload\n"
            "preload()\n"
            "assert all(m in sys.modules for m in PRELOAD_MODULES)\n"
            "assert threading.active_count() == 1, threading.enumerate()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_cpu_workers_run_adam_with_torchs_fused_kernel():
    """The same update as the per-tensor loop (up to rounding), switched on inside megatron's
    chained optimizer; an optimizer that is not Adam is left alone."""
    from types import SimpleNamespace

    import torch

    from varbatch_kit.train.runs.worker import fuse_cpu_adam

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(50, dtype=torch.float64)) for _ in range(2)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fused, plain = torch.optim.Adam(params, lr=1e-2), torch.optim.Adam(twins, lr=1e-2)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=fused),
                                                  SimpleNamespace(optimizer=sgd)])
    assert fuse_cpu_adam(chained) == 1
    assert fused.param_groups[0]["fused"] and not sgd.param_groups[0].get("fused")
    for _ in range(3):
        for p, q in zip(params, twins):
            g = torch.randn_like(p)
            p.grad, q.grad = g, g.clone()
        fused.step()
        plain.step()
    for p, q in zip(params, twins):
        assert torch.allclose(p, q, rtol=1e-13, atol=1e-15)


def test_the_master_port_is_free_and_outside_the_ephemeral_range():
    """A port the kernel could hand to an outgoing connection (its ephemeral range) may be
    taken before torchrun binds it; the launcher picks one below that range, free now."""
    import socket

    from varbatch_kit.train.runs.launch import _free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [_free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), ports
    assert len(set(ports)) > 1  # drawn at random: two launches at once rarely meet
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[0]))
