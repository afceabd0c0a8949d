"""``compat.slime.build_dp_schedule`` runs a varbatch_kit policy named on slime's args.

``args.varbatch_packing`` / ``args.varbatch_distribution`` absent or None: slime's own
schedule (the golden vectors of ``test_golden_slime.py`` check it byte for byte).
Set: the registered policy, equal to ``to_slime(build_schedule(...))`` of the core.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from _factories import SLIME_MODEL_ARGS as MODEL_ARGS

from varbatch_kit import ModelShape
from varbatch_kit.compat.slime import (
    POLICY_ATTRS,
    SlimeCompatError,
    build_dp_schedule,
    policy_from_args,
    to_slime,
)
from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.policies.registry import PACKERS

TPC1 = dict(dp_size=1, cp_size=1, vpp_size=1, microbatch_group_size_per_vp_stage=1)


def slime_args(**kw):
    base = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=100, micro_batch_size=1,
                balance_data=False, balance_by_flops=False, **MODEL_ARGS)
    return SimpleNamespace(**{**base, **kw})


def run(args, tpc, lengths, gbs, rids=None):
    rids = list(range(len(lengths))) if rids is None else rids
    return build_dp_schedule(args, tpc, lengths, global_batch_size=gbs, rollout_indices=rids)


def test_attributes_named():
    assert POLICY_ATTRS == ("varbatch_packing", "varbatch_distribution")
    assert policy_from_args(slime_args()) == (None, None)
    assert policy_from_args(slime_args(varbatch_packing="ffd")) == ("ffd", None)


def test_unset_and_none_are_slimes_first_fit():
    lengths = [60, 50, 30, 40, 20]
    # slime's first-fit in arrival order under 100: [60,30] [50,40] [20]
    want = ([[0, 2, 1, 3, 4]], [[[0, 1], [2, 3], [4]]], [3], [5])
    assert run(slime_args(), TPC1, lengths, 5) == want
    assert run(slime_args(varbatch_packing=None, varbatch_distribution=None), TPC1,
               lengths, 5) == want


def test_ffd_packing_by_name():
    # first-fit decreasing under 100: 60+40 and 50+30+20 -> two micro-batches, not three
    out = run(slime_args(varbatch_packing="ffd"), TPC1, [60, 50, 30, 40, 20], 5)
    assert out == ([[0, 3, 1, 2, 4]], [[[0, 1], [2, 3, 4]]], [2], [5])


def test_balanced_places_the_long_samples_apart():
    tpc = dict(TPC1, dp_size=2)
    out = run(slime_args(varbatch_packing="balanced"), tpc, [90, 90, 10, 10, 50, 50], 6)
    partitions, mbi, nmb, gbs = out
    assert nmb == [2] and gbs == [6]
    assert sorted(partitions[0] + partitions[1]) == list(range(6))
    lengths = [90, 90, 10, 10, 50, 50]
    assert [sum(lengths[i] for i in p) for p in partitions] == [150, 150]
    for r in range(2):  # every micro-batch under the cap
        assert all(sum(lengths[partitions[r][i]] for i in mb) <= 100 for mb in mbi[r])


@pytest.mark.parametrize("packing", sorted(PACKERS))
def test_every_packing_equals_the_core(packing):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 90, size=48).tolist()
    rids = [i // 2 for i in range(48)]
    tpc = dict(dp_size=2, cp_size=1, vpp_size=1, microbatch_group_size_per_vp_stage=1)
    args = slime_args(varbatch_packing=packing, micro_batch_size=2)
    got = run(args, tpc, lengths, 8, rids)
    spec = PACKERS[packing]
    sizes = dict(max_tokens_per_gpu=100) if spec.dynamic else dict(micro_batch_size=2)
    config = ScheduleConfig(dp=2, global_batch_size=8, packing=packing, **sizes)
    rollouts = Rollouts(prompt_len=np.zeros(48, dtype=np.int64),
                        response_len=np.asarray(lengths), rollout_id=np.asarray(rids))
    model = ModelShape.from_args(args) if (spec.needs_flops or config.distribution != "strided") \
        else None
    assert got == to_slime(build_schedule(rollouts, config, model))


def test_distribution_alone_keeps_slimes_packing():
    tpc = dict(TPC1, dp_size=2)
    lengths = [90, 90, 10, 10, 50, 50]
    plain = run(slime_args(), tpc, lengths, 6)
    kk = run(slime_args(varbatch_distribution="flops_kk"), tpc, lengths, 6)
    assert kk == run(slime_args(balance_data=True), tpc, lengths, 6)
    # same micro-batches (first-fit, then split to 4), possibly on other ranks
    def bins(out):
        return sorted(tuple(sorted(out[0][r][i] for i in mb)) for r in range(2) for mb in out[1][r])
    assert bins(kk) == bins(plain)


def test_bad_names_list_the_choices():
    with pytest.raises(SlimeCompatError, match=r"varbatch_packing='balancd'.*'balanced'"):
        run(slime_args(varbatch_packing="balancd"), TPC1, [5, 5], 2)
    with pytest.raises(SlimeCompatError, match=r"varbatch_distribution='rr'.*'strided'"):
        run(slime_args(varbatch_distribution="rr"), TPC1, [5, 5], 2)
    # a dynamic packing without the cap names the flag
    with pytest.raises(SlimeCompatError, match="--max-tokens-per-gpu"):
        run(slime_args(varbatch_packing="balanced", max_tokens_per_gpu=None), TPC1, [5, 5], 2)
    # balanced decides the ranks itself: another distribution is refused
    with pytest.raises(SlimeCompatError, match="distribution='balanced'"):
        run(slime_args(varbatch_packing="balanced", varbatch_distribution="strided"), TPC1,
            [5, 5], 2)
