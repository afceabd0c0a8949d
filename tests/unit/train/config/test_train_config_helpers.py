"""TrainConfig's validation and helpers; the schedule fields `with_` routes."""

from __future__ import annotations

import pytest

from varbatch_kit import ScheduleConfig
from varbatch_kit.train import TrainConfig


def test_train_config_validation_and_helpers():
    c = TrainConfig(schedule=ScheduleConfig(dp=2, cp=2, global_batch_size=4, micro_batch_size=1))
    assert c.world_size == 4 and c.name == "dp2 cp2 static/strided per_rollout_mean"
    assert c.lr_increment_unit() == "rollouts"
    assert TrainConfig(mode="per_token").lr_increment_unit() == "samples"
    c2 = c.with_(dp=1, packing="first_fit", max_tokens_per_gpu=64, mode="per_token")
    assert (c2.dp, c2.schedule.packing, c2.mode) == (1, "first_fit", "per_token")
    assert c2.model_shape().hidden_size == c.resolve_model().hidden_size == 64
    for bad, match in [({"mode": "nope"}, "report mode"), ({"hidden_size": 30}, "divisible"),
                       ({"lr_decay_style": "step"}, "lr_decay_style"),
                       ({"fail_rank": 3}, "fail_rank"), ({"save_params_at": (0,)}, "1-based"),
                       ({"device": "tpu"}, "device")]:
        with pytest.raises(ValueError, match=match):
            TrainConfig().with_(**bad)  # routed to its sub-config, which refuses it


def test_schedule_fields_routed_by_with_are_the_init_fields():
    from varbatch_kit.train.config.train_config import SCHEDULE_FIELDS

    assert "defaulted" not in SCHEDULE_FIELDS  # derived by ScheduleConfig, not settable
    assert {"dp", "cp", "packing", "distribution", "max_tokens_per_gpu"} <= set(SCHEDULE_FIELDS)
    c = TrainConfig().with_(dp=2, packing="balanced")
    assert (c.schedule.dp, c.schedule.distribution) == (2, "balanced")
