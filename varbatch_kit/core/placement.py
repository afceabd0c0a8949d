"""Where the micro-batches of a step run, and what each rank does per round.

A step's ``dp * cp`` ranks form one *pool* (world ranks ``0 .. dp*cp - 1``).
The step runs in *rounds*: in each round the pool is split into disjoint CP
groups, each running one micro-batch over its ``c`` ranks (ranks in no group
are idle that round). Every rank runs the same number of rounds, so gradient
synchronisation and pipeline schedules still line up. Under fixed CP every
micro-batch has degree ``cp`` and the CP replica of its DP rank as its group;
under ``ScheduleConfig(cp_mode="dynamic")`` each has its own.

:class:`Placement` says where one micro-batch runs; :class:`RankWork` is one
entry of a rank's program (:meth:`varbatch_kit.core.step.Step.rank_program`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from varbatch_kit.core.flops import ModelShape
from varbatch_kit.policies.dynamic_cp import CPCostModel

__all__ = ["CP_DEFAULTS", "Placement", "RankWork", "cp_cost_model", "kv_bytes_per_token"]

#: the hardware figures :func:`cp_cost_model` defaults to (an H100 SXM, as in
#: ``analysis.simulate.HARDWARE["H100"]``, at the simulator's default efficiency,
#: micro-batch overhead and backward factor)
CP_DEFAULTS = {"peak_flops": 989e12, "efficiency": 0.45, "microbatch_overhead_s": 0.004,
               "backward_factor": 2.0, "cp_bandwidth_Bps": 200e9, "cp_latency_s": 20e-6,
               "cp_overlap": 1.0}


@dataclass(frozen=True)
class Placement:
    """Where one micro-batch of a step runs (its round and CP group).

    Attributes
    ----------
    bin:
        Position of the micro-batch in ``step.micro_batches``.
    round:
        0-based round of the step in which it runs.
    ranks:
        Pool ranks (world ranks ``0 .. dp*cp - 1``) of its CP group, in CP-rank
        order: ``ranks[i]`` holds the ``i``-th zigzag share of every sample;
        ``len(ranks)`` is its CP degree.
    """

    bin: int
    round: int
    ranks: tuple[int, ...]

    @property
    def degree(self) -> int:
        """The micro-batch's CP degree ``c`` (size of its group)."""
        return len(self.ranks)


@dataclass(frozen=True, eq=False)
class RankWork:
    """What one world rank does in one round.

    Attributes
    ----------
    samples:
        Global sample indices of the micro-batch it takes part in (empty:
        the rank is idle this round).
    cp_size:
        The micro-batch's CP degree ``c`` (1 when idle).
    cp_rank:
        This rank's position in the CP group (``0 .. c-1``); it holds the
        ``cp_rank``-th zigzag share of each sample.
    """

    samples: np.ndarray
    cp_size: int
    cp_rank: int

    @property
    def idle(self) -> bool:
        """True when the rank has nothing to train this round."""
        return self.samples.size == 0


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


def cp_cost_model(model: ModelShape, *, peak_flops: float = CP_DEFAULTS["peak_flops"],
                  efficiency: float = CP_DEFAULTS["efficiency"],
                  microbatch_overhead_s: float = CP_DEFAULTS["microbatch_overhead_s"],
                  backward_factor: float = CP_DEFAULTS["backward_factor"],
                  cp_bandwidth_Bps: float = CP_DEFAULTS["cp_bandwidth_Bps"],
                  cp_latency_s: float = CP_DEFAULTS["cp_latency_s"],
                  cp_overlap: float = CP_DEFAULTS["cp_overlap"], tp: int = 1) -> CPCostModel:
    """The :class:`~varbatch_kit.policies.dynamic_cp.CPCostModel` of a model shape on a GPU.

    Linear and attention FLOPs are the two coefficients of
    :meth:`ModelShape.flops_coefficients` (``c1 * L + c2 * L**2``) at
    ``peak_flops * efficiency``; the ring passes :func:`kv_bytes_per_token`
    per layer at ``cp_bandwidth_Bps`` with ``cp_latency_s`` per ring step and
    layer. The defaults (:data:`CP_DEFAULTS`) match the simulator's defaults
    (``analysis.simulate``), so a plan made with them is judged there by the
    model it was planned with.
    """
    if not isinstance(model, ModelShape):
        raise ValueError(f"model must be a ModelShape, got {type(model).__name__}")
    if not (isinstance(efficiency, (int, float)) and 0 < efficiency <= 1):
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    c1, c2 = model.flops_coefficients()
    return CPCostModel.from_flops(
        c1, c2, rate=peak_flops * efficiency, backward_factor=backward_factor,
        kv_bytes_per_token=kv_bytes_per_token(model), num_layers=model.num_layers,
        bandwidth_Bps=cp_bandwidth_Bps, ring_latency_s=cp_latency_s,
        microbatch_overhead_s=microbatch_overhead_s, overlap=cp_overlap, tp=tp)
