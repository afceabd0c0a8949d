"""ParallelLayout: world-rank coordinates in megatron-core's order, and the refusals."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from varbatch_kit.train.config.parallel_layout import ParallelLayout


def test_coordinates_by_hand():
    # dp2 pp2 tp2: tensor fastest, then the pool, then the stage (megatron's tp-cp-ep-dp-pp)
    lay = ParallelLayout(dp=2, pp=2, tp=2, cp_impl="emulated")
    got = [(c.pool_rank, c.tp_rank, c.pp_rank) for c in map(lay.coords, range(8))]
    assert got == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0),
                   (0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)]
    assert [lay.world_rank(r, tp_rank=1, pp_rank=1) for r in range(2)] == [5, 7]
    assert lay.last_stage_world_rank == 4
    with pytest.raises(ValueError, match=r"world_rank=8: give a rank in \[0, 8\)"):
        lay.coords(8)


@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3))
def test_coords_and_world_rank_are_inverse(dp, cp, pp, tp):
    lay = ParallelLayout(dp=dp, cp=cp, pp=pp, tp=tp, cp_impl="emulated")
    seen = set()
    for w in range(lay.world_size):
        c = lay.coords(w)
        assert lay.world_rank(c.pool_rank, c.tp_rank, c.pp_rank) == w
        seen.add((c.pool_rank, c.tp_rank, c.pp_rank))
    assert seen == set(itertools.product(range(dp * cp), range(tp), range(pp)))


def test_bad_sizes_name_the_field():
    with pytest.raises(ValueError, match="tp"):
        ParallelLayout(tp=0)
    with pytest.raises(ValueError, match=r"cp_impl='ring': use one of allgather, emulated"):
        ParallelLayout(cp_impl="ring")


def test_each_reason_is_listed():
    lay = ParallelLayout(dp=1, cp=2, pp=1, vpp=2, tp=3, mb_group=1)
    reasons = lay.unsupported()
    assert len(reasons) == 1 and "vpp=2 needs pipeline parallelism" in reasons[0]
    lay = ParallelLayout(dp=1, cp=2, pp=2, vpp=2, cp_mode="dynamic", cp_impl="emulated")
    assert ["mb_group=1 with pp=2, vpp=2" in r for r in lay.unsupported()] == [True]
    # context parallelism, fixed or dynamic, with tensor and pipeline parallelism runs: 4D
    assert ParallelLayout(dp=2, cp=2, pp=2, tp=2).unsupported() == []
    assert ParallelLayout(cp=2, tp=2, pp=2, cp_mode="dynamic").unsupported() == []


def test_expert_parallelism_is_carved_out_of_dp():
    """ep takes no ranks of its own: world = dp*cp*pp*tp; groups of ep consecutive pool ranks
    (megatron's tp-cp-ep-dp-pp order at tp 1)."""
    lay = ParallelLayout(dp=4, ep=2)
    assert lay.world_size == 4 and [lay.ep_rank(w) for w in range(4)] == [0, 1, 0, 1]
    assert lay.describe() == "dp4 cp1 pp1 tp1 ep2" and lay.as_dict()["ep"] == 2
    assert ParallelLayout(dp=4, ep=4).unsupported() == []
    assert ["ep=3 does not divide dp*cp=4" in r
            for r in ParallelLayout(dp=4, ep=3).unsupported()] == [True]
    assert ParallelLayout(dp=2, cp=2, ep=4).unsupported() == []  # out of the dp * cp pool
    assert ParallelLayout(dp=2, pp=3, ep=2).unsupported() == []  # each stage's experts
    assert ParallelLayout(dp=2, tp=2, ep=2).unsupported() == []
    assert ["fixed CP only" in r for r in ParallelLayout(
        dp=2, cp=2, ep=2, cp_mode="dynamic").unsupported()] == [True]
    with pytest.raises(ValueError, match="ep"):
        ParallelLayout(ep=0)
