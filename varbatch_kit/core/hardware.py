"""The accelerators schedules are timed on, and the CP cost of a model shape on one.

:data:`HARDWARE` is the one table of hardware figures in the package
(:class:`HardwareProfile`: dense BF16 peak, memory, the context-parallel
ring's bandwidth, latency and overlap). The step-time model
(:func:`varbatch_kit.analysis.simulate.simulate`) and the dynamic-CP planner
(:func:`varbatch_kit.core.schedule.build_schedule`) both read it, with the
same default settings (:data:`DEFAULT_HARDWARE`, :data:`DEFAULT_EFFICIENCY`,
:data:`DEFAULT_MICROBATCH_OVERHEAD_S`, :data:`DEFAULT_BACKWARD_FACTOR`).

:func:`cp_cost_model` is the one builder of a
:class:`~varbatch_kit.policies.dynamic_cp.CPCostModel` from a model shape and
a profile: the simulator times fixed and dynamic CP with it, the planner
plans under it, so a plan is judged by the model it was planned with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from varbatch_kit.checks import positive_int
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.policies.dynamic_cp import CPCostModel

__all__ = [
    "DEFAULT_BACKWARD_FACTOR",
    "DEFAULT_EFFICIENCY",
    "DEFAULT_HARDWARE",
    "DEFAULT_MICROBATCH_OVERHEAD_S",
    "HARDWARE",
    "HardwareProfile",
    "cp_cost_model",
    "hardware_profile",
    "kv_bytes_per_token",
]


@dataclass(frozen=True)
class HardwareProfile:
    """One accelerator: dense BF16 peak (FLOP/s per GPU) and memory.

    Context parallelism: ``cp_bandwidth_Bps`` is the bandwidth a rank's
    ring sends and receives KV chunks at (within a node), ``cp_latency_s``
    the fixed cost of one ring step in one layer (launch and synchronisation),
    ``cp_overlap`` the share of the attention time that hides the ring.
    """

    name: str
    peak_flops: float
    memory_gib: float
    description: str = ""
    cp_bandwidth_Bps: float = 200e9
    cp_latency_s: float = 20e-6
    cp_overlap: float = 1.0

    def __post_init__(self) -> None:
        for field_name in ("peak_flops", "memory_gib"):
            v = getattr(self, field_name)
            if not (_is_number(v) and 0 < v < math.inf):
                raise ValueError(f"HardwareProfile.{field_name} must be a finite number > 0, "
                                 f"got {v!r}")
        if not (_is_number(self.cp_bandwidth_Bps) and self.cp_bandwidth_Bps > 0):
            raise ValueError(f"HardwareProfile.cp_bandwidth_Bps must be > 0 (math.inf: a free "
                             f"ring), got {self.cp_bandwidth_Bps!r}")
        if not (_is_number(self.cp_latency_s) and 0 <= self.cp_latency_s < math.inf):
            raise ValueError(f"HardwareProfile.cp_latency_s must be a finite number of seconds "
                             f">= 0, got {self.cp_latency_s!r}")
        if not (_is_number(self.cp_overlap) and 0 <= self.cp_overlap <= 1):
            raise ValueError(f"HardwareProfile.cp_overlap must be in [0, 1], "
                             f"got {self.cp_overlap!r}")


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


#: Built-in profiles (dense BF16 tensor-core peaks from the vendors' data sheets).
HARDWARE: dict[str, HardwareProfile] = {
    "H100": HardwareProfile("H100", 989e12, 80,
                            "NVIDIA H100 SXM: ~989 TFLOP/s dense BF16, 80 GB HBM3"),
    "H200": HardwareProfile("H200", 989e12, 141,
                            "NVIDIA H200 SXM: same compute as H100 (~989 TFLOP/s dense BF16), "
                            "141 GB HBM3e"),
    "A100": HardwareProfile("A100", 312e12, 80,
                            "NVIDIA A100 SXM: 312 TFLOP/s dense BF16, 80 GB HBM2e",
                            cp_bandwidth_Bps=120e9),
}
# H100/H200: NVLink 4 (450 GB/s per direction), of which a P2P ring reaches ~200 GB/s;
# A100: NVLink 3 (300 GB/s per direction), ~120 GB/s.

#: the profile the simulator and the planner default to
DEFAULT_HARDWARE = "H100"
#: share of the peak the training kernels reach (model FLOPs utilisation) by default
DEFAULT_EFFICIENCY = 0.45
#: fixed seconds per micro-batch (and pipeline stage) by default
DEFAULT_MICROBATCH_OVERHEAD_S = 0.004
#: backward FLOPs / forward FLOPs by default (full backward)
DEFAULT_BACKWARD_FACTOR = 2.0


def hardware_profile(hardware: str | HardwareProfile) -> HardwareProfile:
    """``hardware`` itself if it is a profile, else the profile of that name in :data:`HARDWARE`."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if not isinstance(hardware, str) or hardware not in HARDWARE:
        raise ValueError(f"unknown hardware {hardware!r}; choose one of {sorted(HARDWARE)} "
                         "or pass a HardwareProfile")
    return HARDWARE[hardware]


def kv_bytes_per_token(model: ModelShape, dtype_bytes: int = 2) -> float:
    """Bytes of one token's K and V in one layer, what the CP ring passes (bf16 by default).

    Grouped-query attention: ``2 * num_query_groups * kv_channels``; multi-latent
    attention: the up-projected keys and values of every head,
    ``heads * (qk_head_dim + qk_pos_emb_head_dim + v_head_dim)``.
    """
    if model.multi_latent_attention:
        per = model.num_attention_heads * (model.qk_head_dim + model.qk_pos_emb_head_dim
                                           + model.v_head_dim)
    else:
        per = 2 * model.num_query_groups * model.kv_channels
    return float(per * dtype_bytes)


def cp_cost_model(model: ModelShape, hardware: str | HardwareProfile = DEFAULT_HARDWARE,
                  efficiency: float = DEFAULT_EFFICIENCY,
                  microbatch_overhead_s: float = DEFAULT_MICROBATCH_OVERHEAD_S, *,
                  tp: int = 1, backward_factor: float = DEFAULT_BACKWARD_FACTOR) -> CPCostModel:
    """The :class:`~varbatch_kit.policies.dynamic_cp.CPCostModel` of a model shape on a GPU.

    A sample of ``L`` tokens has the forward FLOPs ``c1 * L + c2 * L**2``
    (:meth:`ModelShape.flops_coefficients`); forward and backward take
    ``1 + backward_factor`` times that, on ``tp`` GPUs at
    ``peak_flops * efficiency`` each. The ring passes :func:`kv_bytes_per_token`
    per layer (split over ``tp``) once forward and twice backward (K, V and
    their gradients) at the profile's ``cp_bandwidth_Bps``, and pays its
    ``cp_latency_s`` per ring step and layer, forward and backward; the
    attention hides a share ``cp_overlap`` of it. Every micro-batch costs
    ``microbatch_overhead_s`` on each rank.

    The arguments are those of :func:`varbatch_kit.analysis.simulate.simulate`
    with the same defaults: pass the model built with a simulation's settings
    as ``build_schedule(..., cp_cost=...)`` to plan a dynamic-CP schedule for
    them (the planner's default is this function's default).
    """
    if not isinstance(model, ModelShape):
        raise ValueError(f"model must be a ModelShape, got {type(model).__name__}")
    prof = hardware_profile(hardware)
    if not (_is_number(efficiency) and 0 < efficiency <= 1):
        raise ValueError(f"efficiency must be in (0, 1] (share of peak reached), "
                         f"got {efficiency!r}")
    if not (_is_number(microbatch_overhead_s) and 0 <= microbatch_overhead_s < math.inf):
        raise ValueError(f"microbatch_overhead_s must be a finite number of seconds >= 0, "
                         f"got {microbatch_overhead_s!r}")
    positive_int("tp", tp)
    if not (_is_number(backward_factor) and 0 <= backward_factor < math.inf):
        raise ValueError(f"backward_factor must be a finite number >= 0, got {backward_factor!r}")
    c1, c2 = model.flops_coefficients()
    rate = prof.peak_flops * efficiency
    passes = 1.0 + backward_factor
    layers = model.num_layers
    return CPCostModel(
        linear_s=c1 * passes / (tp * rate),
        attention_s=c2 * passes / (tp * rate),
        comm_s=3.0 * layers * kv_bytes_per_token(model) / (tp * prof.cp_bandwidth_Bps),
        latency_s=2.0 * layers * prof.cp_latency_s,
        microbatch_overhead_s=microbatch_overhead_s,
        overlap=prof.cp_overlap,
    )
