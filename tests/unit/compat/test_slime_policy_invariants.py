"""Every registered policy, through ``compat.slime.build_dp_schedule``, meets slime's invariants.

slime's ``slime/utils/dp_schedule.py`` documents (and its ``tests/test_dp_schedule.py``
``assert_invariants`` checks) what its training actors rely on. Here, for every
registered (packing, distribution) pair on random slime inputs (rollouts of 1-3
samples, interleaved or not, random layouts with CP and virtual pipelining):

- the output is slime's 4-tuple: ``dp`` partitions and micro-batch lists, one
  micro-batch count and one global batch size (``global_batch_size`` rollouts) per step;
- every sample of the kept rollouts (the first ``steps * global_batch_size``) exactly once;
- steps by rollout: step s's micro-batches hold exactly step s's rollouts' samples;
- each rank's micro-batches tile its partition, and every rank has ``sum(num_microbatches)``;
- ``num_microbatches[s]`` a multiple of ``mb_group`` when ``vpp > 1``;
- where the packing promises the cap (``respects_cap``), a micro-batch over
  ``max_tokens_per_gpu * cp`` holds one sample.

slime's own checker ran on these outputs in a scratch folder
(``scripts/record_slime_invariants.py``); :func:`test_slime_checker_record` reads its record.
"""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
from _factories import SLIME_MODEL_ARGS as MODEL_ARGS
from _paths import GOLDEN
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from varbatch_kit.compat.slime import SlimeCompatError, build_dp_schedule
from varbatch_kit.policies.registry import DISTRIBUTIONS, PACKERS


def registered_policies() -> list[tuple[str, str]]:
    """Every (packing, distribution) pair a ScheduleConfig accepts."""
    return [(p, d) for p in sorted(PACKERS) for d in sorted(DISTRIBUTIONS)
            if PACKERS[p].requires_distribution in (None, d)]


@st.composite
def slime_inputs(draw, static: bool):
    dp = draw(st.integers(1, 4))
    cp = draw(st.integers(1, 2))
    vpp = draw(st.sampled_from([1, 1, 2]))
    mb_group = draw(st.integers(1, 3))
    align = dp * (mb_group if vpp > 1 else 1)
    mbs = draw(st.integers(1, 3))
    if static:  # one sample a rollout, steps of a whole number of aligned micro-batches
        gbs = align * mbs * draw(st.integers(1, 2))
        sizes = [1] * (gbs * draw(st.integers(1, 3)) + draw(st.integers(0, gbs - 1)))
    else:
        gbs = draw(st.integers(align, align + 4))
        n_roll = gbs * draw(st.integers(1, 3)) + draw(st.integers(0, 3))
        sizes = draw(st.lists(st.sampled_from([1, 1, 2, 3]), min_size=n_roll, max_size=n_roll))
    rollout_indices = [r for r, k in enumerate(sizes) for _ in range(k)]
    if draw(st.booleans()):  # samples of a rollout not next to each other (slime groups them)
        rollout_indices = draw(st.permutations(rollout_indices))
    ids = draw(st.lists(st.integers(0, 10_000), min_size=len(sizes), max_size=len(sizes),
                        unique=True))  # rollout ids need not be 0..n-1
    rollout_indices = [ids[r] for r in rollout_indices]
    lengths = draw(st.lists(st.integers(1, 300), min_size=len(rollout_indices),
                            max_size=len(rollout_indices)))
    args = SimpleNamespace(micro_batch_size=mbs, use_dynamic_batch_size=not static,
                           max_tokens_per_gpu=draw(st.integers(40, 400)), balance_data=False,
                           balance_by_flops=False, **MODEL_ARGS)
    tpc = dict(dp_size=dp, cp_size=cp, vpp_size=vpp, microbatch_group_size_per_vp_stage=mb_group)
    return args, tpc, lengths, gbs, rollout_indices


def check_invariants(out, *, args, tpc, lengths, gbs, rollout_indices, respects_cap) -> None:
    partitions, mbi, nmb, gbs_per_step = out
    dp = tpc["dp_size"]
    order = list(dict.fromkeys(rollout_indices))  # slime: first-occurrence order
    steps = len(order) // gbs
    step_of = {rid: i // gbs for i, rid in enumerate(order[:steps * gbs])}
    # shapes as slime's
    assert len(partitions) == dp and len(mbi) == dp
    assert gbs_per_step == [gbs] * steps and len(nmb) == steps
    assert all(isinstance(k, int) and k >= 1 for k in nmb)
    # every kept sample exactly once
    placed = [i for p in partitions for i in p]
    kept = [i for i, rid in enumerate(rollout_indices) if rid in step_of]
    assert sorted(placed) == kept
    group = tpc["microbatch_group_size_per_vp_stage"] if tpc["vpp_size"] > 1 else 1
    cap = args.max_tokens_per_gpu * tpc["cp_size"]
    for r in range(dp):
        # the rank's micro-batches tile its partition; the same count on every rank
        assert [i for mb in mbi[r] for i in mb] == list(range(len(partitions[r])))
        assert len(mbi[r]) == sum(nmb)
        k = 0
        for s, count in enumerate(nmb):
            assert count % group == 0
            for mb in mbi[r][k:k + count]:
                assert mb, "empty micro-batch"
                samples = [partitions[r][i] for i in mb]
                assert {step_of[rollout_indices[i]] for i in samples} == {s}  # steps by rollout
                if respects_cap and len(samples) > 1:
                    assert sum(lengths[i] for i in samples) <= cap
            k += count


@pytest.mark.parametrize(("packing", "distribution"), registered_policies())
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_policy_meets_slimes_invariants(packing, distribution, data):
    args, tpc, lengths, gbs, rids = data.draw(slime_inputs(static=not PACKERS[packing].dynamic))
    args.varbatch_packing, args.varbatch_distribution = packing, distribution
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "dropping N trailing rollouts"
            out = build_dp_schedule(args, tpc, lengths, global_batch_size=gbs,
                                    rollout_indices=rids)
    except SlimeCompatError as e:
        # the one refusal slime shares: a step with fewer samples than the aligned
        # micro-batch count it needs (slime asserts the same, dp_schedule.py step 2)
        assert str(e).startswith("dynamic path: could only produce"), str(e)
        return
    check_invariants(out, args=args, tpc=tpc, lengths=lengths, gbs=gbs, rollout_indices=rids,
                     respects_cap=PACKERS[packing].respects_cap)


def test_policy_list_covers_the_registry():
    pairs = registered_policies()
    assert {p for p, _ in pairs} == set(PACKERS)
    assert {d for _, d in pairs} == set(DISTRIBUTIONS)
    assert ("balanced", "balanced") in pairs and ("balanced", "strided") not in pairs


def test_slime_checker_record():
    """slime's own ``assert_invariants`` passed on every registered policy's outputs."""
    rec = json.loads((GOLDEN / "invariants" / "slime_invariants.json").read_text())
    assert rec["slime_commit"] == "624b824a898ab0ec1fcb4d373004c7f3852bf515"
    assert rec["checker"] == "tests/test_dp_schedule.py::assert_invariants"
    assert rec["generator"] == "scripts/record_slime_invariants.py"
    got = {(r["packing"], r["distribution"]): r for r in rec["policies"]}
    assert set(got) == set(registered_policies())
    for r in got.values():
        assert r["checked"] >= 200 and r["passed"] == r["checked"] and r["failed"] == 0
        assert r["cap_checked"] == PACKERS[r["packing"]].respects_cap
        assert r["checked"] + r["refused"] == r["cases"]
        if r["equals_slime"] is not None:  # slime's own five: its build_dp_schedule's output
            assert r["equals_slime"] == r["checked"]
    assert {k for k, r in got.items() if r["equals_slime"] is not None} == {
        ("static", "strided"), ("static", "flops_kk"), ("first_fit", "strided"),
        ("first_fit", "flops_kk"), ("flops_kk", "flops_kk")}
    assert sum(r["checked"] for r in got.values()) >= 3000
    # the real slime.ray.rollout, patched by install(): its schedule is varbatch_kit's
    check = rec["install_check"]
    assert (check["module"], check["attribute"]) == ("slime.ray.rollout", "build_dp_schedule")
    assert check["flag"].startswith("--custom-rollout-log-function-path ")
    assert check["installed_before"] is None
    assert check["installed_after_first_rollout"] == ["balanced", None]
    assert check["patched_equals_compat"] is True and check["patched_differs_from_slime"] is True
    assert check["restored_equals_slime"] is True
