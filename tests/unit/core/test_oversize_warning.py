"""Samples longer than the token cap: build_schedule warns with their count and share."""

import warnings

import numpy as np
import pytest
from _factories import TINY, rollouts

from varbatch_kit import ScheduleConfig, build_schedule
from varbatch_kit.analysis.quality import summary
from varbatch_kit.core.build import OversizeSampleWarning, oversize_samples

#: 8 samples, 3 longer than a cap of 10 (12, 11, 30)
R = rollouts([5, 12, 8, 2, 11, 1, 30, 6])


def test_warns_with_count_share_and_the_cap_that_fits():
    cfg = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=10)
    with pytest.warns(OversizeSampleWarning) as rec:
        s = build_schedule(R, cfg, TINY)
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert "3 of 8 samples (37.5 %) are longer than the token cap 10" in msg
    assert "longest 30 tokens" in msg and "max_tokens_per_gpu to 30" in msg
    assert rec[0].filename == __file__  # points at the caller of build_schedule
    assert oversize_samples(s).tolist() == [1, 4, 6]
    assert summary(s)["oversize_alone"] == 3 and summary(s)["cap_violations"] == 0


def test_cap_is_max_tokens_per_gpu_times_cp():
    cfg = ScheduleConfig(dp=1, cp=2, global_batch_size=4, max_tokens_per_gpu=10)
    with pytest.warns(OversizeSampleWarning, match="1 of 8 samples .* token cap 20"):
        s = build_schedule(R, cfg, TINY)
    assert oversize_samples(s).tolist() == [6]


def test_no_warning_when_every_sample_fits_or_on_the_static_path():
    with warnings.catch_warnings():
        warnings.simplefilter("error", OversizeSampleWarning)
        build_schedule(R, ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=30), TINY)
        s = build_schedule(R, ScheduleConfig(dp=2, global_batch_size=4, micro_batch_size=1))
    assert oversize_samples(s).size == 0
    assert np.issubdtype(oversize_samples(s).dtype, np.integer)
