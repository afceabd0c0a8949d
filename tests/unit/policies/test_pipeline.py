"""The 1F1B pipeline simulator: traced by hand, the textbook formula, an independent oracle."""

import numpy as np
import pytest
from _pipeline_oracle import reference_1f1b
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from varbatch_kit.policies.pipeline import one_f_one_b, pipeline_makespan


def test_two_stages_three_micro_batches_by_hand():
    # fwd 1, 2, 3 and bwd 2, 4, 6 on pp = 2 stages. Stage 0 warms up with one forward,
    # stage 1 with none:
    #   s0 F0 [0,1]  F1 [1,3]                  (F1 needs only s0 free)
    #   s1 F0 [1,2]  B0 [2,4]                  (after s0 F0; B0 after its own F0)
    #   s0 B0 [4,6]                            (after s1 B0; s0 idles 3..4)
    #   s1 F1 [4,6]  B1 [6,10]                 (after s0 F1 at 3 and s1 B0 at 4)
    #   s0 F2 [6,9]  B1 [10,14]                (B1 after s1 B1; idles 9..10)
    #   s1 F2 [10,13] B2 [13,19]
    #   s0 B2 [19,25]                          (idles 14..19)
    # makespan 25; work per stage 1+2+3 + 2+4+6 = 18, so the bubble is 25 - 18 = 7
    fwd, bwd = np.array([[1.0, 2.0, 3.0]]), np.array([[2.0, 4.0, 6.0]])
    start, end, finish = one_f_one_b(fwd, bwd, 2)
    assert start.tolist() == [[0.0, 1.0, 6.0]]
    assert end.tolist() == [[6.0, 14.0, 25.0]]
    assert finish.tolist() == [25.0]
    assert finish[0] - (fwd + bwd).sum() == 7.0  # the bubble
    assert pipeline_makespan(fwd[0], bwd[0], 2) == 25.0
    # the reverse order: 3 first fills the pipeline slowly
    #   s0 F0 [0,3] F1 [3,5]; s1 F0 [3,6] B0 [6,12]; s0 B0 [12,18]; s1 F1 [12,14] B1 [14,18];
    #   s0 F2 [18,19] B1 [19,23]; s1 F2 [19,20] B2 [20,22]; s0 B2 [23,25] -> 25 as well
    assert pipeline_makespan(fwd[0, ::-1], bwd[0, ::-1], 2) == 25.0


def test_uniform_micro_batches_match_the_formula():
    # uniform micro-batches: (m + p - 1) * (t_fwd + t_bwd); traced by hand for m=4, p=2
    start, end, finish = one_f_one_b(np.ones((1, 4)), 2 * np.ones((1, 4)), 2)
    assert finish.tolist() == [15.0]
    assert start.tolist() == [[0.0, 1.0, 6.0, 9.0]] and end.tolist() == [[6.0, 9.0, 12.0, 15.0]]
    for m, p in ((1, 4), (3, 3), (8, 4)):
        assert one_f_one_b(np.ones((2, m)), 2 * np.ones((2, m)), p)[2].tolist() == \
            [3.0 * (m + p - 1)] * 2


def test_single_stage_is_sequential():
    tf = np.array([[1.0, 2.0, 3.0]])
    start, end, finish = one_f_one_b(tf, 2 * tf, 1)
    assert end.tolist() == [[3.0, 9.0, 18.0]] and start.tolist() == [[0.0, 3.0, 9.0]]
    assert finish.tolist() == [18.0]


def test_no_micro_batches_and_many_leading_axes():
    start, end, finish = one_f_one_b(np.zeros((3, 0)), np.zeros((3, 0)), 4)
    assert start.shape == end.shape == (3, 0) and finish.tolist() == [0.0] * 3
    f = np.arange(24, dtype=float).reshape(2, 3, 4)
    start, end, finish = one_f_one_b(f, 2 * f, 3)
    assert start.shape == end.shape == (2, 3, 4) and finish.shape == (2, 3)
    assert finish[1, 2] == one_f_one_b(f[1, 2], 2 * f[1, 2], 3)[2]


@pytest.mark.parametrize("args, match", [
    ((np.ones(2), np.ones(3), 2), "same shape"),
    ((np.float64(1.0), np.float64(1.0), 2), "same shape"),
    ((np.ones(2), np.ones(2), 0), "pp must be a positive integer"),
    ((np.ones(2), np.ones(2), True), "pp must be a positive integer"),
])
def test_bad_input_is_a_value_error(args, match):
    with pytest.raises(ValueError, match=match):
        one_f_one_b(*args)


@st.composite
def pipelines(draw):
    """``(fwd, bwd, pp)``: ``(ranks, m)`` non-negative stage times and a stage count."""
    ranks = draw(st.integers(1, 4))
    m = draw(st.integers(0, 12))
    times = hnp.arrays(np.float64, (ranks, m), elements=st.floats(0.0, 1e3, allow_nan=False))
    return draw(times), draw(times), draw(st.integers(1, 9))


@settings(max_examples=200, deadline=None)
@given(pipelines())
def test_equals_the_independent_recurrence(case):
    fwd, bwd, pp = case
    start, end, finish = one_f_one_b(fwd, bwd, pp)
    for r in range(fwd.shape[0]):
        ref_start, ref_end, ref_finish = reference_1f1b(fwd[r], bwd[r], pp)
        # the same sums in the same order for pp > 1; a running sum for pp = 1
        np.testing.assert_allclose(start[r], ref_start, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(end[r], ref_end, rtol=1e-12, atol=1e-9)
        assert finish[r] == pytest.approx(ref_finish, rel=1e-12, abs=1e-9)
    assert pipeline_makespan(fwd, bwd, pp).tolist() == finish.tolist()
    # every stage does all the work: the makespan is at least the work, and the
    # rank's last backward on stage 0 ends it
    assert (finish >= (fwd + bwd).sum(axis=1) * (1 - 1e-12)).all()
    if fwd.shape[1]:
        assert end[:, -1].tolist() == finish.tolist()
