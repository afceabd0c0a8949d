"""`run` refuses bad inputs before any worker starts (train/runs/launch.py)."""

from __future__ import annotations

import pytest

from varbatch_kit import Rollouts, ScheduleConfig
from varbatch_kit.train import ModelConfig, TrainConfig
from varbatch_kit.train.config.sub_configs import DataConfig


def test_run_rejects_bad_inputs_before_launching():
    from varbatch_kit.train import run

    r = Rollouts(prompt_len=[0, 3], response_len=[4, 4])
    with pytest.raises(ValueError, match="prompt_len"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=1, micro_batch_size=1)), r)
    r = Rollouts(prompt_len=[2, 3], response_len=[4, 4])
    with pytest.raises(ValueError, match="max_seq_len"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=1, micro_batch_size=1),
                        model=ModelConfig(max_seq_len=5)), r)
    # two one-sample rollouts with slime's default n_samples_per_prompt=1: groups of one
    # sample, whose std is undefined (slime would train on NaN advantages)
    with pytest.raises(ValueError, match="sample 0 is alone in its reward group"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=1, micro_batch_size=1)), r)
    with pytest.raises(ValueError, match="global_batch_size"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=3, micro_batch_size=1),
                        data=DataConfig(n_samples_per_prompt=2)), r)
