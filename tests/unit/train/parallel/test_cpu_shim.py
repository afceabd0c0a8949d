"""The CPU shim over megatron-core's CUDA calls (train/parallel/cpu_shim.py)."""

from __future__ import annotations

import pytest
import torch
from _megatron import single_process_megatron

from varbatch_kit.train.parallel import cpu_shim


@pytest.fixture
def clean_shim():
    cpu_shim.deactivate()
    yield
    cpu_shim.deactivate()


@pytest.mark.parametrize("host", ["this host", "a GPU host"])
def test_shim_patches_exactly_the_listed_names_and_not_global_torch(clean_shim, monkeypatch,
                                                                    host):
    import importlib

    from varbatch_kit.train.parallel.devices import PRETEND_CUDA_ENV

    if host == "a GPU host":  # the engine sees 8 GPUs; the run still chose the CPU
        monkeypatch.setenv(PRETEND_CUDA_ENV, "8")

    before_cuda = torch.cuda.current_device
    before_zeros = torch.zeros
    names = [(m, "torch") for m in cpu_shim.PATCHED_MODULES] + list(cpu_shim.PATCHED_FUNCTIONS)
    originals = {(m, a): getattr(importlib.import_module(m), a) for m, a in names}
    assert cpu_shim.activate() is True
    assert cpu_shim.activate() is True  # idempotent
    expected = sorted([(m, "torch") for m in cpu_shim.PATCHED_MODULES]
                      + list(cpu_shim.PATCHED_FUNCTIONS))
    assert cpu_shim.patched() == expected
    # the global torch is untouched; only the listed modules see the CPU view
    assert torch.cuda.current_device is before_cuda and torch.zeros is before_zeros
    for (m, a), orig in originals.items():
        assert getattr(importlib.import_module(m), a) is not orig
    view = importlib.import_module("megatron.core.utils").torch
    assert view.cuda.current_device() == torch.device("cpu")
    assert view.zeros(2, device="cuda").device.type == "cpu"
    assert view.empty(3, device=0).device.type == "cpu"
    assert view.tensor([1.0], device=torch.device("cuda")).device.type == "cpu"
    assert view.Tensor is torch.Tensor
    # torch.distributed as it is, but for the two list collectives gloo refuses uneven
    assert view.distributed.all_reduce is torch.distributed.all_reduce
    assert view.distributed.all_gather is not torch.distributed.all_gather
    # pipeline p2p: its buffers on current_device() and its torch.cuda.synchronize()
    p2p = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication").torch
    assert p2p.cuda.current_device() == torch.device("cpu")
    assert p2p.cuda.synchronize() is None and p2p.empty(3, device=p2p.cuda.current_device(),
                                                         dtype=torch.int64).numel() == 3
    # a module nobody listed keeps the real torch
    assert importlib.import_module("megatron.core.transformer.module").torch is torch
    cpu_shim.deactivate()
    assert cpu_shim.patched() == []
    for (m, a), orig in originals.items():
        assert getattr(importlib.import_module(m), a) is orig


def test_shim_applies_by_the_run_device_not_the_host(clean_shim, monkeypatch):
    import importlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a real GPU host
    assert cpu_shim.needed() is False  # the host's default run would use CUDA
    assert cpu_shim.needed("cpu") is True and cpu_shim.needed(torch.device("cpu")) is True
    assert cpu_shim.needed("cuda") is False and cpu_shim.needed("cuda:1") is False
    assert cpu_shim.activate("cuda") is False  # a CUDA run: the real code paths
    assert cpu_shim.patched() == []
    assert cpu_shim.activate("cpu") is True  # a CPU run on that host is shimmed
    assert len(cpu_shim.patched()) == len(cpu_shim.PATCHED_MODULES) + len(
        cpu_shim.PATCHED_FUNCTIONS)
    view = importlib.import_module("megatron.core.utils").torch
    # megatron's patched modules see no CUDA, as on a CPU-only host; the global torch does
    assert view.cuda.is_available() is False and torch.cuda.is_available() is True


def test_shim_clip_replacement_scales_like_megatron():
    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    ps[0].grad = torch.tensor([3.0, 0.0, 0.0])
    ps[1].grad = torch.tensor([0.0, 4.0, 0.0])
    cpu_shim._clip_grad_by_total_norm_cpu(ps, max_norm=1.0, total_norm=5.0)
    assert torch.allclose(ps[0].grad, torch.tensor([0.6, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(ps[1].grad, torch.tensor([0.0, 0.8, 0.0]), atol=1e-6)
    cpu_shim._clip_grad_by_total_norm_cpu(ps, max_norm=10.0, total_norm=1.0)  # no clipping
    assert torch.allclose(ps[1].grad, torch.tensor([0.0, 0.8, 0.0]), atol=1e-6)


def test_shim_clip_replacement_takes_float64_gradients():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    cpu_shim._clip_grad_by_total_norm_cpu([p], max_norm=1.0, total_norm=5.0)
    assert p.grad.dtype == torch.float64
    want = torch.tensor([3.0, 4.0], dtype=torch.float64) * (1.0 / (5.0 + 1e-6))  # megatron's eps
    assert torch.allclose(p.grad, want, rtol=1e-15, atol=0)


def test_shim_grad_norm_keeps_float64_and_leaves_float32_to_megatron():
    import torch.distributed as dist
    from megatron.core.optimizer import clip_grads

    with single_process_megatron("cpu"):
        assert cpu_shim.active()
        # (1 + 2^-40) per entry: a float32 norm rounds the 2^-40 away, a float64 one keeps it
        x = 1.0 + 2.0 ** -40
        g64 = [torch.tensor([x, 0.0], dtype=torch.float64),
               torch.tensor([0.0, x], dtype=torch.float64)]
        norm = clip_grads.get_grad_norm_fp32(g64, grad_stats_parallel_group=dist.group.WORLD)
        assert norm == pytest.approx((2 * x * x) ** 0.5, rel=1e-15)
        assert norm != float(torch.tensor(norm, dtype=torch.float32))
        g32 = [t.float() for t in g64]  # megatron-core's own kernel: a float32 norm
        norm32 = clip_grads.get_grad_norm_fp32(g32, grad_stats_parallel_group=dist.group.WORLD)
        assert norm32 == pytest.approx(2 ** 0.5, rel=1e-7) and norm32 != norm


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is inactive under CUDA")
def test_shim_bf16_optimizer_keeps_fp32_main_copies_of_bf16_params(clean_shim):
    """megatron's mixed-precision optimizer sorts parameters by CUDA type names; the shim's
    version sorts them by dtype: bf16 ones get an fp32 main copy, fp32 ones are stepped as
    they are, anything else is refused."""
    import megatron.core.optimizer as mo
    from megatron.core.optimizer import OptimizerConfig

    low = torch.nn.Parameter(torch.tensor([1.5, -2.25], dtype=torch.bfloat16))
    full = torch.nn.Parameter(torch.tensor([0.5]))
    cpu_shim.activate()
    cls = mo.Float16OptimizerWithFloat16Params
    opt = cls(torch.optim.Adam([low, full], lr=0.1), OptimizerConfig(bf16=True), None,
              lambda o, config=None: None)
    assert opt.float16_groups == [[low]] and opt.fp32_from_fp32_groups == [[full]]
    (main,) = opt.fp32_from_float16_groups[0]
    assert main.dtype == torch.float32 and torch.equal(main, low.float())
    assert low.main_param is main and opt.optimizer.param_groups[0]["params"] == [main, full]
    bad = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype torch.float64"):
        cls(torch.optim.Adam([bad], lr=0.1), OptimizerConfig(bf16=True), None,
            lambda o, config=None: None)


def test_shim_router_softmax_keeps_float64_and_the_split_sizes_become_host_arrays(clean_shim):
    """megatron's router asks for a float32 softmax: a float64 input stays float64 (fp64 runs
    route in float64); float32 stays as asked. The all-to-all's split sizes: a host copy."""
    import numpy as np

    cpu_shim.activate("cpu")
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    x = torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float64)
    got = moe_utils.torch.softmax(x, dim=-1, dtype=torch.float32)
    assert got.dtype == torch.float64 and torch.equal(got, torch.softmax(x, dim=-1))
    assert moe_utils.torch.softmax(x.float(), dim=-1, dtype=torch.float32).dtype == torch.float32
    assert torch is not moe_utils.torch and torch.softmax is not moe_utils.torch.softmax
    sizes = torch.tensor([3, 4])
    host = token_dispatcher.maybe_move_tensor_to_cpu(sizes, as_numpy=True)
    assert isinstance(host, np.ndarray) and host.tolist() == [3, 4]
    sizes[0] = 9  # a copy, as the device-to-host copy is
    assert host.tolist() == [3, 4]


def _uneven_worker(rank, size, port, queue):
    import os
    import pickle

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        view = cpu_shim._DistributedOnCpu()
        sizes = [2, 3, 1]
        mine = torch.full((sizes[rank], 2), float(rank + 1))
        out = [torch.empty(n, 2) for n in sizes]
        view.all_gather(out, mine)  # gloo alone refuses pieces of different sizes
        pieces = [torch.full((n, 2), float(10 * rank + i)) for i, n in enumerate(sizes)]
        scattered = torch.empty(sizes[rank], 2)
        view.reduce_scatter(scattered, pieces)
        queue.put((rank, pickle.dumps(([t.tolist() for t in out], scattered.tolist()))))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_uneven_list_collectives_run_on_gloo():
    """megatron's dispatcher under tensor x expert parallelism all-gathers and reduce-scatters
    pieces of different sizes; the shim's view runs them on gloo (3 real ranks)."""
    import pickle

    from _gloo_group import run_forked_group

    got = {r: pickle.loads(b) for r, b in run_forked_group(_uneven_worker, 3).items()}
    for rank, (gathered, scattered) in got.items():
        assert gathered == [[[1.0, 1.0]] * 2, [[2.0, 2.0]] * 3, [[3.0, 3.0]] * 1], rank
        # piece `rank` of every rank summed: (0 + 10 + 20) + 3 * rank
        want = 30.0 + 3 * rank
        assert scattered == [[want, want]] * [2, 3, 1][rank], rank
