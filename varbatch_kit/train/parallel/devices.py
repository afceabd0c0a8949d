"""Which device a run trains on: the one place the engine asks whether there are GPUs.

:func:`cuda_visible` and :func:`local_gpu_count` are what the engine sees of the
host: the real ``torch.cuda`` answers, unless the environment switch
:data:`PRETEND_CUDA_ENV` is set. ``VARBATCH_KIT_PRETEND_CUDA=N`` (N >= 1) makes
the engine take the decisions a host with N GPUs per node would take (device
selection, the CPU shim's :func:`~varbatch_kit.train.parallel.cpu_shim.needed`), while
``torch`` itself is left alone: so a CPU run "on a GPU host" (``device="cpu"``,
or ``"auto"`` falling back because a node has fewer GPUs than local ranks) is
tested on a CPU-only machine. Unset, empty or ``0``: off.

:func:`choose_device` is the pure rule: the local ranks of a node
(``world_size // nnodes``, torchrun starts that many workers per node) against
the GPUs of a node. ``"cuda"`` that cannot serve the layout is a ValueError
(before any worker starts); ``"auto"`` falls back to the CPU and says why
(:attr:`DeviceChoice.reason`). :func:`select_device` applies it to a
:class:`~varbatch_kit.train.config.train_config.TrainConfig` on this host.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

__all__ = ["PRETEND_CUDA_ENV", "DeviceChoice", "choose_device", "cuda_visible",
           "local_gpu_count", "pretended_gpus", "select_device"]

#: the environment switch: ``N`` GPUs per node as seen by the engine's decisions
PRETEND_CUDA_ENV = "VARBATCH_KIT_PRETEND_CUDA"


def pretended_gpus() -> int | None:
    """``N`` when :data:`PRETEND_CUDA_ENV` is set to a GPU count >= 1; None when it is off."""
    raw = os.environ.get(PRETEND_CUDA_ENV, "").strip()
    if raw in ("", "0"):
        return None
    if not raw.isdigit():
        raise ValueError(f"{PRETEND_CUDA_ENV}={raw!r}: give the number of GPUs per node to "
                         "pretend (an integer >= 1), or 0 / unset for the real host")
    return int(raw)


def cuda_visible() -> bool:
    """Whether the engine sees CUDA on this host (or pretends to, see the module doc)."""
    if pretended_gpus() is not None:
        return True
    import torch

    return bool(torch.cuda.is_available())


def local_gpu_count() -> int:
    """GPUs of this node as the engine sees them (or pretends to)."""
    n = pretended_gpus()
    if n is not None:
        return n
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class DeviceChoice:
    """The device a run trains on, and why."""

    requested: str  # "auto", "cpu" or "cuda"
    device: str  # "cpu" or "cuda"
    local_ranks: int
    gpus_per_node: int
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def choose_device(requested: str, *, gpus_per_node: int, nnodes: int,
                  world_size: int) -> DeviceChoice:
    """The device for ``world_size`` ranks on ``nnodes`` nodes of ``gpus_per_node`` GPUs each.

    Each node runs ``world_size // nnodes`` local ranks, one GPU each. ``"cuda"`` needs
    that many GPUs per node (else ValueError); ``"auto"`` takes CUDA when they are there,
    else the CPU, with the reason; ``"cpu"`` is the CPU whatever the host has.
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"run.device={requested!r}; choose 'auto', 'cpu' or 'cuda'")
    for name, v, lo in (("gpus_per_node", gpus_per_node, 0), ("nnodes", nnodes, 1),
                        ("world_size", world_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r}: give an integer >= {lo}")
    if world_size % nnodes:
        raise ValueError(f"nnodes={nnodes} does not divide world_size={world_size}: every "
                         "node starts world_size / nnodes ranks")
    local = world_size // nnodes
    fits = gpus_per_node >= local
    have = f"{gpus_per_node} GPU{'s' if gpus_per_node != 1 else ''} per node"
    need = (f"{local} local rank{'s' if local != 1 else ''} per node (dp*cp*pp*tp={world_size} "
            f"over nnodes={nnodes})")

    def choice(device: str, reason: str) -> DeviceChoice:
        return DeviceChoice(requested, device, local, gpus_per_node, reason)

    if requested == "cpu":
        return choice("cpu", f"run.device='cpu' ({have})")
    if requested == "cuda":
        if not fits:
            raise ValueError(f"run.device='cuda' but {have} for {need}; use device='cpu' or "
                             "'auto', or fewer ranks per node (more nodes, a smaller world)")
        return choice("cuda", f"run.device='cuda': {have} for {need}")
    if fits and gpus_per_node > 0:
        return choice("cuda", f"run.device='auto': {have} for {need}")
    return choice("cpu", f"run.device='auto' fell back to the CPU: {have} for {need}")


def select_device(cfg) -> DeviceChoice:
    """:func:`choose_device` for ``cfg`` (a TrainConfig) on this host (:func:`local_gpu_count`).

    With :data:`PRETEND_CUDA_ENV` set and no real GPU, a choice of CUDA cannot run: a
    ValueError says so (the switch is for testing the CPU path of a GPU host).
    """
    if cfg.precision == "fp64":  # the invariance reference: float64 end to end, on the CPU
        if cfg.run.device == "cuda":
            raise ValueError("run.device='cuda' with precision='fp64': float64 training is the "
                             "CPU reference of the invariance tests; use device='cpu' or "
                             "'auto', or precision='fp32' / 'bf16' on the GPU")
        got = choose_device("cpu", gpus_per_node=local_gpu_count(), nnodes=cfg.nodes.nnodes,
                            world_size=cfg.world_size)
        return DeviceChoice(cfg.run.device, got.device, got.local_ranks, got.gpus_per_node,
                            f"precision='fp64' runs on the CPU ({got.reason})")
    got = choose_device(cfg.run.device, gpus_per_node=local_gpu_count(),
                        nnodes=cfg.nodes.nnodes, world_size=cfg.world_size)
    if got.device == "cuda" and pretended_gpus() is not None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                f"{PRETEND_CUDA_ENV}={pretended_gpus()} pretends GPUs for the engine's "
                f"decisions, and {got.reason}, but this host has no CUDA to train on; use "
                "run.device='cpu', more local ranks than pretended GPUs, or unset "
                f"{PRETEND_CUDA_ENV}")
    return got
