"""Property tests: every schedule passes check(), matches the slow reference and compat;
every rejected input raises ValueError (never AssertionError, IndexError or a hang).

The slow reference (``benchmarks/baseline.py``) and the compat layer are checked,
case by case, against schedules recorded from slime's own ``build_dp_schedule``
(``tests/test_golden_slime.py``), so the agreement asserted here extends slime's
behaviour to the random layouts hypothesis draws.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.baseline import build_dp_schedule as reference_schedule
from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.compat.slime import build_dp_schedule

MODEL_ARGS = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_query_groups=2,
                  kv_channels=8, ffn_hidden_size=64, vocab_size=32)
MODEL = ModelShape(**MODEL_ARGS)


@st.composite
def batches(draw):
    n_roll = draw(st.integers(1, 24))
    counts = draw(st.lists(st.integers(1, 4), min_size=n_roll, max_size=n_roll))
    rid = np.repeat(np.arange(n_roll), counts)
    perm = draw(st.permutations(list(range(n_roll))))
    rid = np.asarray(perm)[rid]  # rollout ids are arbitrary labels
    lengths = draw(st.lists(st.integers(1, 3000), min_size=len(rid), max_size=len(rid)))
    return np.asarray(lengths), rid


@st.composite
def layouts(draw):
    dynamic = draw(st.booleans())
    policy = draw(st.sampled_from(["plain", "balance", "by_flops"] if dynamic
                                  else ["plain", "balance"]))
    return dict(
        dp=draw(st.integers(1, 4)),
        gbs=draw(st.integers(1, 8)),
        vpp=draw(st.sampled_from([1, 2])),
        mb_group=draw(st.integers(1, 3)),
        cp=draw(st.integers(1, 2)),
        mbs=None if dynamic else draw(st.integers(1, 4)),
        max_tokens=draw(st.sampled_from([500, 1500, 4000])) if dynamic else None,
        policy=policy,
    )


def config_of(lay):
    dynamic = lay["max_tokens"] is not None
    return ScheduleConfig(
        dp=lay["dp"], cp=lay["cp"], vpp=lay["vpp"], mb_group=lay["mb_group"],
        global_batch_size=lay["gbs"], micro_batch_size=lay["mbs"],
        max_tokens_per_gpu=lay["max_tokens"],
        packing="flops_kk" if lay["policy"] == "by_flops" else (
            "first_fit" if dynamic else "static"),
        distribution="strided" if lay["policy"] == "plain" else "flops_kk",
    )


@given(batches(), layouts())
def test_schedule_valid_or_value_error(batch, lay):
    lengths, rid = batch
    r = Rollouts(prompt_len=np.zeros_like(lengths), response_len=lengths, rollout_id=rid)
    cfg = config_of(lay)
    try:
        sched = build_schedule(r, cfg, MODEL)
    except ValueError:
        return
    sched.check()
    got = sched.rank_layout()
    ref = reference_schedule(  # plain-Python slime, independent of the fast core
        lengths.tolist(), rid.tolist(), MODEL.forward_flops(lengths).tolist(), dp=cfg.dp,
        gbs=cfg.global_batch_size, mbs=cfg.micro_batch_size, cap=cfg.cap, align=cfg.align,
        by_flops=lay["policy"] == "by_flops", balance=lay["policy"] != "plain")
    assert got == ref
    args = SimpleNamespace(
        **MODEL_ARGS, micro_batch_size=cfg.micro_batch_size,
        use_dynamic_batch_size=cfg.dynamic, max_tokens_per_gpu=cfg.max_tokens_per_gpu,
        balance_data=lay["policy"] == "balance", balance_by_flops=lay["policy"] == "by_flops")
    tpc = dict(dp_size=cfg.dp, cp_size=cfg.cp, vpp_size=cfg.vpp,
               microbatch_group_size_per_vp_stage=cfg.mb_group)
    compat = build_dp_schedule(args, tpc, lengths.tolist(), global_batch_size=cfg.global_batch_size,
                               rollout_indices=rid.tolist())
    assert compat == got


@given(batches(), layouts())
def test_rejections_are_value_errors_with_a_reason(batch, lay):
    lengths, rid = batch
    r = Rollouts(prompt_len=np.zeros_like(lengths), response_len=lengths, rollout_id=rid)
    try:
        build_schedule(r, config_of(lay), MODEL)
    except ValueError as e:
        msg = str(e)
        assert any(w in msg for w in ("global_batch_size", "dp", "micro_batch")), msg


def test_compat_raises_value_error_not_assert():
    args = SimpleNamespace(**MODEL_ARGS, micro_batch_size=1, use_dynamic_batch_size=True,
                           max_tokens_per_gpu=10, balance_data=False, balance_by_flops=False)
    tpc = dict(dp_size=2, cp_size=1, vpp_size=2, microbatch_group_size_per_vp_stage=2)
    with pytest.raises(ValueError, match="step 0 holds 3 samples but the layout needs 4"):
        build_dp_schedule(args, tpc, [5, 5, 5], global_batch_size=3, rollout_indices=[0, 1, 2])
    with pytest.raises(ValueError, match="total_lengths must hold positive integers"):
        build_dp_schedule(args, tpc, [5, 0], global_batch_size=1, rollout_indices=[0, 1])
    with pytest.raises(ValueError, match="train_parallel_config lacks 'dp_size'"):
        build_dp_schedule(args, {}, [5], global_batch_size=1, rollout_indices=[0])
    args.balance_by_flops, args.use_dynamic_batch_size = True, False
    with pytest.raises(ValueError, match="balance_by_flops requires use_dynamic_batch_size"):
        build_dp_schedule(args, tpc, [5], global_batch_size=1, rollout_indices=[0])


@given(st.lists(st.integers(0, 9), min_size=1, max_size=40))
def test_rollout_order_flat_is_first_appearance_order_the_slow_way(rid):
    """``Rollouts.rollout_order_flat`` (and ``rollout_order`` built on it) against a dict of
    first appearances: the ids in that order, each one's positions in their own order."""
    r = Rollouts(prompt_len=[1] * len(rid), response_len=[1] * len(rid), rollout_id=rid)
    slow: dict[int, list[int]] = {}
    for i, g in enumerate(rid):
        slow.setdefault(g, []).append(i)
    ids, positions, offsets = r.rollout_order_flat()
    assert ids.tolist() == list(slow) and offsets[0] == 0 and offsets[-1] == len(rid)
    assert [positions[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == list(
        slow.values())
    ids2, groups = r.rollout_order()
    assert ids2.tolist() == list(slow) and [g.tolist() for g in groups] == list(slow.values())
