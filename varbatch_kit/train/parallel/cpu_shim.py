"""Run megatron-core on a CPU-only machine: the one place that redirects its CUDA calls.

megatron-core assumes CUDA in a few hard-coded spots that the training path
of :mod:`varbatch_kit.train` goes through:

- ``torch.cuda.current_device()`` as an allocation device (global memory
  buffer, DDP grad buffers, optimizer scalars),
- ``device="cuda"`` literals (token counters in the pipeline schedule,
  scalars in the optimizer and the grad-norm code),
- the ``param.grad.type() == 'torch.cuda.FloatTensor'`` assertion in
  gradient clipping, and the CUDA type names by which the bf16 optimizer
  (``Float16OptimizerWithFloat16Params``) and the distributed optimizer
  (``DistributedOptimizer``, also its checkpoint load) sort parameters,
- ``torch.cuda.synchronize()`` after the pipeline's p2p exchanges (a no-op here),
- mixture-of-experts layers: the all-to-all token dispatcher's side stream for its
  device-to-host copies (``torch.cuda.Stream``, ``current_stream``, ``stream``: one
  in-order stand-in here) and the copies themselves (``maybe_move_tensor_to_cpu``, which
  leaves a CPU tensor a tensor: expert parallelism's split sizes must be host arrays), the
  router's and the experts' tensors on ``current_device()``, the auxiliary-loss tracker's
  on ``device="cuda"``,
- the router's float32 softmax (``torch.softmax(..., dtype=torch.float32)``): a float64
  input stays float64 (``precision="fp64"``), else unchanged,
- ``torch.distributed.all_gather`` / ``reduce_scatter`` with pieces of different sizes
  (megatron's dispatcher under tensor x expert parallelism), which gloo refuses: padded to
  one size, or each piece all-reduced,
- the grad norm of its local (no apex) L2-norm kernel, returned as a float32
  CUDA tensor whatever the gradients' dtype: on the CPU float64 gradients
  (``precision="fp64"``) keep a float64 norm; float32 ones go through
  megatron-core's own function unchanged.

The shim does **not** touch the global ``torch`` module. Instead it gives each
listed megatron-core module its own view of ``torch`` (:class:`_TorchOnCpu`)
in which ``torch.cuda.current_device()`` is the CPU device and tensor
factories map a CUDA device argument to the CPU; every other attribute is the
real ``torch``. Gradient clipping is redirected to an equivalent CPU function
in the one namespace that calls it. The CUDA RNG tracker is avoided by
seeding with ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)``
(a no-op tracker: the tiny model uses no dropout), done by the training loop,
not here.

:func:`activate` applies by the device the run uses: a CPU run is shimmed
whatever the host has (a GPU host too: ``device="cpu"``, or ``"auto"`` falling
back), a CUDA run uses the real code paths; :func:`patched` lists what it
changed; :func:`deactivate` restores it. Tests check that exactly
:data:`PATCHED_MODULES` and :data:`PATCHED_FUNCTIONS` are touched and that the
global ``torch`` is not.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "PATCHED_FUNCTIONS",
    "PATCHED_MODULES",
    "activate",
    "active",
    "deactivate",
    "needed",
    "patched",
]

# megatron-core modules whose module-level name ``torch`` is replaced by the CPU view.
PATCHED_MODULES: tuple[str, ...] = (
    "megatron.core.utils",  # GlobalMemoryBuffer: torch.cuda.current_device()
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens on device="cuda"
    "megatron.core.distributed.param_and_grad_buffer",  # grad buffers on current_device()
    "megatron.core.optimizer.optimizer",  # found_inf / scale scalars on device="cuda"
    "megatron.core.optimizer.clip_grads",  # grad-norm scratch tensors on device="cuda"
    # pipeline p2p: shape / receive buffers on current_device(), torch.cuda.synchronize()
    "megatron.core.pipeline_parallel.p2p_communication",
    # sequence parallelism: gather / reduce-scatter outputs on current_device()
    "megatron.core.tensor_parallel.mappings",
    # sequence parallelism: the linear layers' backward reduce-scatter buffer on current_device()
    "megatron.core.tensor_parallel.layers",
    # the distributed optimizer: shard buffers on current_device()
    "megatron.core.optimizer.distrib_optimizer",
    # mixture of experts: the all-to-all dispatcher's device-to-host side stream
    # (torch.cuda.Stream, current_stream, stream), the router's and the experts' tensors on
    # current_device(), the auxiliary-loss tracker's on device="cuda"
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_utils",
)

# (module, function name) -> replacement factory; the function is replaced in that module only.
PATCHED_FUNCTIONS: tuple[tuple[str, str], ...] = (
    # asserts param.grad.type() == 'torch.cuda.FloatTensor'
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
    # bf16: the mixed-precision optimizer sorts parameters by CUDA type names
    ("megatron.core.optimizer", "Float16OptimizerWithFloat16Params"),
    # fp64: the local L2 norm rounds every grad norm to a float32 CUDA tensor
    ("megatron.core.optimizer.clip_grads", "l2_norm_impl"),
    # the distributed optimizer sorts parameters by CUDA type names, as the bf16 one does
    ("megatron.core.optimizer", "DistributedOptimizer"),
    # expert parallelism: the all-to-all's split sizes reach torch.distributed as host
    # arrays only through this device-to-host copy, which skips CPU tensors
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"),
)

_FACTORIES = frozenset({
    "empty", "zeros", "ones", "full", "tensor", "arange", "as_tensor", "randn", "rand",
})

_saved: dict[tuple[str, str], Any] = {}


def _to_cpu_device(device: Any) -> Any:
    """A CUDA device spec (``"cuda"``, ``"cuda:0"``, ``0``, ``torch.device("cuda")``) → CPU."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _factory_on_cpu(fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


class _StreamOnCpu:
    """A CUDA stream as seen by a patched module: CPU work runs in order, nothing to wait
    for or to record."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def record_event(self, event: Any = None) -> _StreamOnCpu:
        """An event that has happened: its ``synchronize()`` returns at once (this object)."""
        return self


_CPU_STREAM = _StreamOnCpu()


class _CudaOnCpu:
    """``torch.cuda`` as seen by a patched module: the current device is the CPU, streams
    are :class:`_StreamOnCpu`."""

    Stream = _StreamOnCpu

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def current_stream(self, device: Any = None) -> _StreamOnCpu:
        return _CPU_STREAM

    def stream(self, stream: Any):
        """``with torch.cuda.stream(s):`` runs the block as it is."""
        import contextlib

        return contextlib.nullcontext()

    def is_available(self) -> bool:  # a CPU run on a GPU host: as on a CPU-only host
        return False

    def synchronize(self, device: Any = None) -> None:
        """Nothing to wait for: CPU ops (and gloo's p2p, once waited on) are synchronous."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _softmax_keeping_float64(input, dim=None, dtype=None, **kwargs):  # noqa: A002 - torch's name
    """``torch.softmax`` in which a float64 input stays float64: megatron-core's router takes
    its softmax in float32 (``dtype=torch.float32``, then back to the logits' dtype), so under
    ``precision="fp64"`` the routing probabilities and their gradients would carry float32
    rounding, which moves with the layout where a token's gradient is summed from several
    ranks (emulated CP: ~1e-9). Any other input: torch's softmax as asked."""
    if dtype == torch.float32 and input.dtype == torch.float64:
        dtype = None
    return torch.softmax(input, dim, dtype=dtype, **kwargs)


class _DistributedOnCpu:
    """``torch.distributed`` as seen by a patched module: its list collectives with pieces of
    different sizes, which gloo refuses (megatron's token dispatcher all-gathers and
    reduce-scatters uneven token counts over the tensor x expert parallel ranks), run as
    equal-size gloo collectives; everything else is the real module."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch.distributed, name)
        self.__dict__[name] = value
        return value

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        dist = torch.distributed
        sizes = [t.shape[0] for t in tensor_list]
        if len(set(sizes)) == 1 and sizes[0] == tensor.shape[0]:
            return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        if async_op:
            raise NotImplementedError("an asynchronous uneven all-gather (not used on CPU)")
        width = max(sizes)
        padded = tensor.new_zeros((width, *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
        received = [tensor.new_empty((width, *tensor.shape[1:])) for _ in sizes]
        dist.all_gather(received, padded.contiguous(), group=group)
        for out, got, n in zip(tensor_list, received, sizes):
            out.copy_(got[:n])
        return None

    @staticmethod
    def reduce_scatter(output, input_list, op=None, group=None, async_op=False):
        dist = torch.distributed
        if async_op:
            raise NotImplementedError("an asynchronous list reduce-scatter (not used on CPU)")
        op = dist.ReduceOp.SUM if op is None else op
        rank = dist.get_rank(group) if group is not None else dist.get_rank()
        for i, piece in enumerate(input_list):  # each piece summed, this rank's kept
            summed = piece.detach().clone().contiguous()
            dist.all_reduce(summed, op=op, group=group)
            if i == rank:
                output.copy_(summed)
        return None


class _TorchOnCpu:
    """``torch`` as seen by a patched module; everything else is the real module.

    Each name is looked up on ``torch`` once and then kept as this object's own attribute,
    so the patched modules' hot paths (megatron's linear layers call ``torch.matmul`` and
    friends in every forward and backward) pay a plain attribute read, not a
    ``__getattr__`` call."""

    def __init__(self) -> None:
        self.cuda = _CudaOnCpu()
        for name in _FACTORIES:
            setattr(self, name, _factory_on_cpu(getattr(torch, name)))
        self.softmax = _softmax_keeping_float64
        self.distributed = _DistributedOnCpu()

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        self.__dict__[name] = value
        return value

    def __repr__(self) -> str:
        return "<torch as seen by megatron-core on CPU (varbatch_kit.train.parallel.cpu_shim)>"


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's ``clip_grad_by_total_norm_fp32`` without its CUDA-type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    for g in grads:
        if g.dtype not in (torch.float32, torch.float64):
            raise AssertionError(f"gradient clipping expects float32 (or, precision='fp64', "
                                 f"float64) gradients, got {g.dtype}")
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _float16_optimizer_on_cpu():
    """megatron-core's ``Float16OptimizerWithFloat16Params`` that sorts parameters by dtype.

    Its constructor tells bf16/fp16 parameters (which get an fp32 main copy that the
    optimizer steps) from fp32 ones by ``param.type()`` against CUDA type names, so it
    refuses every CPU tensor. This subclass makes the same three groups by dtype; every
    other method is megatron's.
    """
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.optimizer import (
        Float16OptimizerWithFloat16Params,
        MixedPrecisionOptimizer,
    )

    class Float16OptimizerOnCpu(Float16OptimizerWithFloat16Params):
        def __init__(self, optimizer, config, grad_scaler, init_state_fn):
            MixedPrecisionOptimizer.__init__(self, optimizer, config, grad_scaler,
                                             init_state_fn)
            self.float16_groups, self.fp32_from_float16_groups = [], []
            self.fp32_from_fp32_groups = []
            self.is_stub_optimizer = not optimizer
            for group in (self.optimizer.param_groups if optimizer else []):
                low, mains, full = [], [], []
                for i, param in enumerate(group["params"]):
                    if not param.requires_grad:
                        continue
                    if param.dtype in (torch.float16, torch.bfloat16):
                        main = param.detach().clone().float()  # the fp32 copy that is stepped
                        tensor_parallel.copy_tensor_model_parallel_attributes(main, param)
                        if hasattr(param, "shared"):
                            main.shared = param.shared
                        group["params"][i] = main
                        param.main_param = main
                        if param in self.optimizer.state:
                            self.optimizer.state[main] = self.optimizer.state.pop(param)
                        low.append(param)
                        mains.append(main)
                    elif param.dtype == torch.float32:
                        full.append(param)
                    else:
                        raise TypeError(f"mixed-precision optimizer: parameter of dtype "
                                        f"{param.dtype}; expected float16, bfloat16 or float32")
                self.float16_groups.append(low)
                self.fp32_from_float16_groups.append(mains)
                self.fp32_from_fp32_groups.append(full)

    Float16OptimizerOnCpu.__name__ = "Float16OptimizerWithFloat16Params"
    return Float16OptimizerOnCpu


def _distributed_optimizer_on_cpu():
    """megatron-core's ``DistributedOptimizer`` that sorts parameters by dtype.

    Its main-parameter groups (the shards of the parameters this DP rank steps) are built by
    a class method that tells 16-bit parameters (an fp32 main copy of the shard) from fp32
    ones (the shard itself) by ``param.type()`` against CUDA type names, refusing every CPU
    tensor. This subclass builds the same five groups by dtype (float32 and, under
    ``precision="fp64"``, float64 parameters step their own shard) and copies the reduced
    gradients into the shards without megatron's cast to float32 (float64 stays float64).
    Loading a checkpoint, it gives each parameter's Adam state its own ``step`` tensor
    (megatron's torch-Adam path shares one, which Adam then advances once per parameter) and
    keeps the moments in the main parameters' dtype. Every other method is megatron's.
    """
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def shard_of(param, start: int, end: int, *, main: bool = False, detach: bool = True):
        """The flat ``[start, end)`` slice of ``param`` (a view; ``main``: an fp32 copy),
        carrying its tensor-parallel attributes."""
        piece = (param.detach() if detach else param).view(-1)[start:end]
        if main:
            piece = piece.clone().float()
        tensor_parallel.copy_tensor_model_parallel_attributes(piece, param)
        if hasattr(param, "shared"):
            piece.shared = param.shared
        return piece

    class DistributedOptimizerOnCpu(DistributedOptimizer):
        @classmethod
        def _build_model_and_main_param_groups(cls, gbuf_ranges, param_gbuf_map,
                                               opt_group_ranges, config):
            if config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                raise ValueError("the precision-aware optimizer is not supported on the CPU")
            groups = tuple([] for _ in range(5))  # megatron's five, in its order
            low_model, full_model, low_shards, full_shards, mains = groups
            for group_range in opt_group_ranges:
                lists = tuple([] for _ in range(5))
                for g, part in zip(groups, lists):
                    g.append(part)
                for param in group_range["params"]:
                    buffer, dtype, bucket = param_gbuf_map[param]
                    rng = gbuf_ranges[buffer][dtype][bucket]["param_map"][param]["param"]
                    if param.dtype in (torch.float16, torch.bfloat16):
                        main = shard_of(param, rng.start, rng.end, main=True)
                        param.main_param, param.main_param_sharded = main, True
                        lists[0].append(param)
                        lists[2].append(shard_of(param, rng.start, rng.end))
                        lists[4].append(main)
                    elif param.dtype in (torch.float32, torch.float64):
                        lists[1].append(param)  # the optimizer steps the view itself
                        lists[3].append(shard_of(param, rng.start, rng.end, detach=False))
                    else:
                        raise TypeError(f"distributed optimizer: parameter of dtype "
                                        f"{param.dtype}; expected float16, bfloat16, float32 "
                                        "or float64")
                group_range["orig_group"]["params"] = [*lists[3], *lists[4]]
            return groups

        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            # megatron gives every parameter's state one shared "step" tensor, which torch's
            # Adam then advances in place once per parameter: each its own
            for state in self.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()

        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            # a checkpoint's shard loaded back: megatron's copies into every state key,
            # torch Adam's "step" too (which its saved shard does not hold), and into
            # float32 placeholders; here the moments take the main parameter's dtype
            # (float64 stays float64) and "step" stays what load_state_dict set
            group, order = self.model_param_group_index_map[model_param]
            main = self.optimizer.param_groups[group]["params"][order]
            state = self.optimizer.state[main]
            with torch.no_grad():
                main.copy_(tensors["param"])
            for key, value in tensors.items():
                if key != "param":
                    state[key] = value.detach().to(device=main.device, dtype=main.dtype).clone()

        def _copy_model_grads_to_main_grads(self):
            # megatron's casts every shard's gradient to float32; float64 keeps float64
            if self.is_stub_optimizer:
                return
            pairs = [*zip(self.model_float16_groups, self.shard_fp32_from_float16_groups),
                     *zip(self.model_fp32_groups, self.shard_fp32_groups)]
            for params, shards in pairs:
                for param, shard in zip(params, shards):
                    rng = self._get_model_param_range_map(param)["param"]
                    grad = param.main_grad.view(-1)[rng.start:rng.end]
                    shard.grad = grad.to(torch.promote_types(grad.dtype, torch.float32))

    DistributedOptimizerOnCpu.__name__ = "DistributedOptimizer"
    return DistributedOptimizerOnCpu


def _l2_norm_keeping_float64():
    """megatron-core's L2-norm kernel (``multi_tensor_applier``'s signature) in which float64
    gradients give a float64 norm; float32 ones the kernel megatron-core chose, unchanged.

    megatron-core's local kernel rounds the norm to float32, so under ``precision="fp64"`` the
    grad norm, the clip factor and the reported ``grad_norm`` would carry float32 noise that
    moves with the layout (the norm is summed per stage and per shard).
    """
    original = importlib.import_module("megatron.core.optimizer.clip_grads").l2_norm_impl

    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        tensors = [t for group in tensor_lists for t in group]
        if not any(t.dtype == torch.float64 for t in tensors):
            return original(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
        if per_tensor:
            raise NotImplementedError("per-tensor grad norms are not used by varbatch_kit")
        norms = torch.stack([torch.linalg.vector_norm(t.double()) for t in tensors])
        return torch.linalg.vector_norm(norms).reshape(1), None

    return l2_norm


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron-core's ``maybe_move_tensor_to_cpu`` for a CPU run: a copy on the host, as the
    device-to-host copy gives on CUDA (the original returns a CPU tensor itself, and the
    all-to-all dispatcher's split sizes then reach ``all_to_all_single`` as a tensor, which it
    refuses)."""
    if not torch.is_tensor(tensor):
        return tensor
    copy = tensor.detach().to("cpu").clone()
    return copy.numpy() if as_numpy else copy


_REPLACEMENTS: dict[str, Callable] = {
    "clip_grad_by_total_norm_fp32": _clip_grad_by_total_norm_cpu,
    "maybe_move_tensor_to_cpu": _host_copy,
}
#: replacements built when the shim activates (they subclass megatron-core's classes)
_LAZY_REPLACEMENTS: dict[str, Callable[[], Any]] = {
    "Float16OptimizerWithFloat16Params": _float16_optimizer_on_cpu,
    "l2_norm_impl": _l2_norm_keeping_float64,
    "DistributedOptimizer": _distributed_optimizer_on_cpu,
}


def needed(device: Any = None) -> bool:
    """True when the shim is required: the run's ``device`` is the CPU.

    ``device``: the run's device (``"cpu"``, ``"cuda"``, a ``torch.device``); the
    shim applies to a CPU run whatever the host has. ``None``: the host's default
    (no CUDA seen by the engine, :func:`varbatch_kit.train.parallel.devices.cuda_visible`).
    """
    if device is None:
        from varbatch_kit.train.parallel.devices import cuda_visible

        return not cuda_visible()
    return torch.device(device).type == "cpu"


def active() -> bool:
    return bool(_saved)


def activate(device: Any = "cpu") -> bool:
    """Redirect megatron-core's CUDA calls to the CPU for a run on ``device``.

    A CPU run (the default) is shimmed whatever the host has (also on a GPU host);
    a CUDA run is not (no-op, returns False). Idempotent. Returns True when the
    shim is (now) active.
    """
    if not needed(device):
        return False
    if _saved:
        return True
    view = _TorchOnCpu()
    for name in PATCHED_MODULES:
        mod = importlib.import_module(name)
        _saved[(name, "torch")] = mod.torch
        mod.torch = view
    for name, fn in PATCHED_FUNCTIONS:
        mod = importlib.import_module(name)
        _saved[(name, fn)] = getattr(mod, fn)
        setattr(mod, fn, _REPLACEMENTS[fn] if fn in _REPLACEMENTS else _LAZY_REPLACEMENTS[fn]())
    return True


def deactivate() -> None:
    """Undo :func:`activate` (restores every saved attribute)."""
    for (name, attr), value in list(_saved.items()):
        setattr(importlib.import_module(name), attr, value)
    _saved.clear()


def patched() -> list[tuple[str, str]]:
    """``(module, attribute)`` pairs currently replaced by the shim."""
    return sorted(_saved)
