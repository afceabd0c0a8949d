"""Metric and loss reporting whose numbers do not move when the parallel layout does.

A training step holds a fixed set of samples (``global_batch_size`` rollouts, one
or more samples each). The scheduler packs them into micro-batches, spreads the
micro-batches over data-parallel (DP) ranks, and context parallelism (CP) cuts
every sequence into zigzag pieces (:mod:`varbatch_kit.report.cp`). A reported metric or
a loss is *layout-invariant* when its value, and the gradient of the loss, is the
same for every such layout. This module holds that math, pure: tensors and ints
in, tensors and floats out; no globals, no ``megatron.core.mpu``. The only
communication is the optional ``group`` argument of the step-reduction and
logging functions (``group=None``: single process, no communication).

How every mode works
--------------------
For sample ``i`` with response values ``x_i``, loss mask ``m_i`` (0/1 per response
token) let ``s_i = sum(x_i * m_i)`` and ``n_i = sum(m_i)``. Every mode is

    report = (1 / Z) * sum_i s_i / max(d_i, 1)

with per-sample denominators ``d_i`` and a step divisor ``Z``, both computed once
over the **whole step** (before packing), so no micro-batch, DP rank or CP rank
ever normalises by something only it can see. A rank's micro-batch contributes
the *loss sum* ``sum_{i in mb} s_i^local / max(d_i, 1)`` over its CP-local
pieces; the CP pieces of a sample tile its response exactly once and the DP ranks
hold disjoint samples, so the contributions of all (rank, micro-batch) pairs add
up to the unsplit numerator, whatever the layout.

=========================  ===========================  =================================
mode                       d_i (per sample)             Z (step-global divisor)
=========================  ===========================  =================================
per_rollout_mean           mask total of i's rollout    global_batch_size (rollouts)
per_sample_mean            n_i                          number of samples in the step
per_token                  1                            unmasked tokens of the step (*)
token-mean (verl)          1                            unmasked tokens of the step
seq-mean-token-mean        n_i                          number of samples in the step
seq-mean-token-sum         1                            number of samples in the step
seq-mean-token-sum-norm    1                            samples in the step * C
naive_microbatch_mean      (micro-batch token mean)     micro-batches * dp * cp  [naive]
naive_rank_mean            n_i * samples on i's rank    dp                       [naive]
=========================  ===========================  =================================

(*) ``per_token`` is slime's per-token path: Megatron runs with
``calculate_per_token_loss=True`` and the divisor is the all-reduced token count
(slot 0 of the reported values, counted in full by every CP rank, so divided by
``cp``). ``token-mean`` has the same value but precomputes the global token count
and runs Megatron's default path. ``C`` is a constant (verl's
``loss_scale_factor``; default: the step's longest response, i.e. the padded
response horizon). Token-count divisors are clamped to >= 1, so a step whose
every mask entry is 0 reports 0, never NaN; likewise a rollout whose masks are
all 0 contributes 0 (its ``d_i`` is clamped to 1 and ``s_i`` is 0).

The two naive modes reproduce normalisations real systems shipped; they are
**for comparison only** (``mode.naive is True``): the mean of per-micro-batch
token means (the 2024 gradient-accumulation bug of Hugging Face transformers,
issue 34191) and the per-rank mean of sample means averaged over DP ranks (slime
before PR #1930). Both move with micro-batch packing and DP; the first also with
CP.

API for a training loop (:mod:`varbatch_kit.train` uses it)
-----------------------------------------------------------
::

    mode = get_report_mode("per_rollout_mean")          # or any name in REPORT_MODES
    # once per step, on every rank, over ALL samples of the step (step-local order):
    norm = mode.step_normalizers(rollout_ids, loss_masks,
                                 global_batch_size=G, dp_size=dp, cp_size=cp,
                                 num_microbatches=M,          # per rank (naive_microbatch_mean)
                                 dp_rank_of_sample=ranks)     # only naive_rank_mean needs it
    prescale = mode.loss_prescale(norm, num_microbatches=M, dp_size=dp, cp_size=cp)
    # Megatron config: calculate_per_token_loss = mode.megatron_per_token_loss
    # per micro-batch on DP rank r / CP rank c, samples idx (step-local indices):
    loss_sum = mode.microbatch_loss_sum(
        x_local,                       # flat per-token values, CP-local pieces concatenated
        total_lengths=[...], response_lengths=[...], loss_masks=[full masks of idx],
        sample_denominators=norm.denominators_for(idx), cp_rank=c, cp_size=cp)
    loss_func returns (prescale * loss_sum,
                       torch.tensor(mode.megatron_num_tokens(masks)),
                       {"keys": keys, "values": torch.stack([count_slot, loss_sum.detach(), ...])})
    # with count_slot = mode.count_slot(masks); other metrics use the same loss-sum function.
    # after the step (per-micro-batch value vectors, all-reduced over the DP x CP group):
    report = reduce_train_step_metrics(values_per_microbatch, keys=keys,
                                       divisor=norm.report_divisor, group=dp_cp_group)

``divisor=None`` in :func:`reduce_train_step_metrics` selects slime's per-token
path (divide by slot 0 / cp). :func:`report_under_layout` runs this whole recipe
in one process for any layout (used by tests, benchmarks and notebooks).

Loss prescaling: why the gradient does not depend on dp, cp or packing
---------------------------------------------------------------------
Let ``R = dp * cp`` ranks each run ``M`` micro-batches, ``L_{r,m}`` the loss sum
of micro-batch ``m`` on rank ``r`` and ``S = sum_{r,m} L_{r,m} = sum_i s_i /
max(d_i, 1)`` (layout-free, see above). Megatron-core's schedule takes the
loss-function output ``(p * L_{r,m}, c_{r,m}, ...)`` and

* default path (``calculate_per_token_loss=False``): divides by
  ``max(c_{r,m}, 1)`` and by ``M``; DDP then averages gradients over the
  ``R`` DP x CP ranks. Our modes return ``c = 1``, so the net gradient is
  ``(1/R) * sum_{r,m} p * grad(L_{r,m}) / M = p / (R * M) * grad(S)``. With
  ``p = M * R / Z`` (:meth:`ReportMode.loss_prescale`) this is
  ``grad(S / Z) = grad(report)``: the gradient of the layout-free report.
  For per_rollout_mean, ``Z = G`` gives slime's factor ``M / G * dp * cp``.
* per-token path (``calculate_per_token_loss=True``, mode ``per_token``): no
  division in the schedule; DDP sums gradients; ``finalize_model_grads`` divides
  by the all-reduced ``sum c_{r,m}``. Each micro-batch returns the *full*
  unmasked token count of its samples, which all ``cp`` ranks of a sample
  report, so ``sum c = cp * N``. With ``p = cp`` the gradient is
  ``cp * grad(S) / (cp * N) = grad(S / N)``.

In both cases only step-global quantities (``Z``, ``N``, ``d_i``) and the
layout-free sum ``S`` remain, so the gradient is the same for every dp, cp and
packing. The naive modes use the same recipe; their ``S`` or ``Z`` depend on the
layout, which is exactly their bug.

Dynamic CP: a CP degree per sample
----------------------------------
Under dynamic CP (``ScheduleConfig(cp_mode="dynamic")``) the ``R = dp * cp``
ranks of a step are one pool; each micro-batch runs on its own group of ``c``
ranks and its samples are cut by the zigzag rule of degree ``c``. Every
function that takes ``cp_rank`` / ``cp_size`` per micro-batch also takes them
per sample (sequences); the int path is unchanged, bit for bit. What changes:

* ``S`` is still layout-free: a sample's ``c`` pieces tile its response, so the
  ranks' loss sums add up to ``S`` whatever degree cut each sample. No ``d_i``
  or ``Z`` of a sound mode depends on the degrees.
* The per-token count. Under fixed CP every CP rank counts its samples' tokens
  in full, so slot 0 (and Megatron's token count) sums to ``cp * N``. With
  degrees ``c_i`` each of sample ``i``'s ranks counts ``n_i * K / c_i``
  (:meth:`ReportMode.count_slot` / :meth:`ReportMode.megatron_num_tokens` with
  ``cp_size=c, reference_cp=K``), ``K`` the step's reference degree, the lcm of
  its degrees (:attr:`StepNormalizers.reference_cp`): the sum is ``K * N``, the
  step report divides by ``slot0 / K`` (``reduce_train_step_metrics(...,
  cp_size=K)``) and the per-token prescale is ``K`` (so the gradient is
  ``K * grad(S) / (K * N)``). Fixed CP is the case ``K = c_i = cp``.
* The default path's prescale ``p_r = M_r * dp * cp / Z`` uses the micro-batch
  count ``M_r`` of *each* rank (ranks may run different counts once idle
  rounds are skipped; Megatron divides by its own ``M_r``) and the pool's
  ``cp``: ``(1/R) * sum_r (1/M_r) * sum_m p_r * grad(L_{r,m}) = grad(S) / Z``.
* The rollout-side log keeps the pool's ``cp`` (``R`` ranks each emit
  ``(cp * S_r, G / dp)``: the quotient is ``S / G`` again).

:func:`report_under_plan` runs a dynamic plan (per rank, per round: samples,
degree, CP rank) in one process, as :func:`report_under_layout` does for a
fixed layout.
"""

from varbatch_kit.report.layouts import plan_sample_cp, report_under_layout, report_under_plan
from varbatch_kit.report.modes import (
    LAYOUT_INVARIANT_MODES,
    NAIVE_MODES,
    REPORT_MODES,
    ReportMode,
    StepNormalizers,
    get_report_mode,
)
from varbatch_kit.report.reducers import (
    make_reducer,
    masked_sums,
    rollout_denominators,
    sample_mask_sums,
    sum_of_sample_means,
)
from varbatch_kit.report.steps import (
    gather_and_reduce_log_dict,
    reduce_log_dicts,
    reduce_train_step_metrics,
    rollout_log_metric_contribution,
)

__all__ = [
    "LAYOUT_INVARIANT_MODES",
    "NAIVE_MODES",
    "REPORT_MODES",
    "ReportMode",
    "StepNormalizers",
    "gather_and_reduce_log_dict",
    "get_report_mode",
    "make_reducer",
    "masked_sums",
    "reduce_log_dicts",
    "plan_sample_cp",
    "reduce_train_step_metrics",
    "report_under_layout",
    "report_under_plan",
    "rollout_denominators",
    "rollout_log_metric_contribution",
    "sample_mask_sums",
    "sum_of_sample_means",
]
