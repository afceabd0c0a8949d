"""The 1F1B pipeline simulator: the two implementations agree on random inputs."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from varbatch_kit.analysis.simulate import one_f_one_b
from varbatch_kit.policies.order import pipeline_makespan


@st.composite
def pipelines(draw):
    """``(fwd, bwd, pp)``: ``(ranks, m)`` non-negative stage times and a stage count."""
    ranks = draw(st.integers(1, 4))
    m = draw(st.integers(0, 12))
    times = hnp.arrays(np.float64, (ranks, m), elements=st.floats(0.0, 1e3, allow_nan=False))
    return draw(times), draw(times), draw(st.integers(1, 9))


@settings(max_examples=200, deadline=None)
@given(pipelines())
def test_the_analysis_simulator_and_the_order_evaluator_agree(case):
    fwd, bwd, pp = case
    finish = one_f_one_b(fwd, bwd, pp)[2]
    if pp == 1:  # a running sum against a sum
        np.testing.assert_allclose(pipeline_makespan(fwd, bwd, pp), finish, rtol=1e-12)
    else:  # the same operations in the same order: bit for bit
        assert pipeline_makespan(fwd, bwd, pp).tolist() == finish.tolist()
