"""What a pipeline layout cannot run, said before any worker starts (pure: no torch).
"""

from __future__ import annotations

__all__ = ["interleaved_count_problem", "pipeline_depth_problem"]


def pipeline_depth_problem(*, num_layers: int, pp: int, vpp: int = 1) -> str | None:
    """Why ``num_layers`` layers cannot split into ``pp`` stages of ``vpp`` equal chunks (None:
    they can). The layout's other pipeline rules (``vpp`` needs ``pp``, ``mb_group >= pp``)
    are :meth:`~varbatch_kit.train.config.parallel_layout.ParallelLayout.check`'s; this one
    needs the model's depth, known once the model is resolved (``plan_runs``)."""
    if pp > 1 and num_layers % (pp * vpp):
        return (f"num_layers={num_layers} does not split into pp*vpp={pp * vpp} equal "
                f"pipeline chunks: use a num_layers divisible by {pp * vpp}")
    return None


def interleaved_count_problem(num_microbatches: int, group: int, pp: int, *, vpp: int = 2,
                              forward_only: bool = False) -> str | None:
    """Why megatron-core 0.16.1's interleaved schedule refuses ``num_microbatches`` on a rank
    with ``group`` micro-batches per virtual stage and ``vpp`` chunks (None: it runs them):
    ``pp <= group <= M`` and ``M % group`` is 0 or at least ``pp``; and, when training (not
    ``forward_only``), not a count that puts every one of stage 0's ``M * vpp`` virtual
    micro-batches in its warm-up (``2 (pp - 1) + (vpp - 1) group`` of them) but not the last
    stage's (``(vpp - 1) group``): stage 0 then still sends activations where the last stage,
    in its steady state, waits for gradients from it, and with pp = 2 both go between one
    pair of ranks, so the exchange hangs (seen with M = 2, pp = 2, vpp = 2, group = 2)."""
    m = int(num_microbatches)
    if not pp <= group <= m:
        return (f"{m} micro-batches on a rank with mb_group={group}, pp={pp}: megatron's "
                f"interleaved schedule needs pp <= mb_group <= micro-batches per rank; lower "
                f"mb_group (>= pp) or give each step more micro-batches")
    if 0 < m % group < pp:
        return (f"{m} micro-batches on a rank with mb_group={group}, pp={pp}: megatron's "
                f"interleaved schedule needs the count modulo mb_group to be 0 or >= pp; the "
                f"schedule aligns each step to dp * mb_group micro-batches")
    total = m * int(vpp)
    first, last = 2 * (pp - 1) + (vpp - 1) * group, (vpp - 1) * group
    if not forward_only and first >= total > last:
        return (f"{m} micro-batches on a rank with mb_group={group}, pp={pp}, vpp={vpp}: "
                f"megatron's interleaved schedule keeps all {total} of stage 0's virtual "
                f"micro-batches in its warm-up ({first}) but not the last stage's ({last}), "
                f"and the stages' exchanges then do not pair up (a hang); give every rank more "
                f"than {first // vpp} micro-batches per step (a lower max_tokens_per_gpu or a "
                f"larger global_batch_size)")
    return None
