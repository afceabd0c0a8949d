"""ScheduleConfig derived values and the mapping from slime's flags."""

from types import SimpleNamespace

import pytest

from varbatch_kit import ScheduleConfig


def test_derived_values():
    c = ScheduleConfig(dp=4, cp=2, vpp=2, mb_group=3, global_batch_size=8,
                       max_tokens_per_gpu=1000)
    assert (c.cap, c.align, c.world_size, c.dynamic, c.packing) == (2000, 12, 8, True, "first_fit")
    s = ScheduleConfig(dp=4, mb_group=3, micro_batch_size=2)
    assert (s.cap, s.align, s.dynamic, s.packing) == (None, 4, False, "static")


def test_with_switches_path_and_default_packing():
    c = ScheduleConfig(dp=2, micro_batch_size=2)
    d = c.with_(max_tokens_per_gpu=4096)
    assert (d.micro_batch_size, d.max_tokens_per_gpu, d.packing) == (None, 4096, "first_fit")
    assert d.with_(micro_batch_size=1).packing == "static"
    assert d.with_(dp=8).dp == 8
    with pytest.raises(ValueError, match="dp must be a positive integer"):
        c.with_(dp=0)


@pytest.mark.parametrize("cmd,expected", [
    ("--global-batch-size 64 --micro-batch-size 2 --actor-num-gpus-per-node 8",
     dict(dp=8, global_batch_size=64, micro_batch_size=2, packing="static",
          distribution="strided")),
    ("--global-batch-size 64 --balance-data --actor-num-nodes 2 --actor-num-gpus-per-node 8 "
     "--tensor-model-parallel-size 2",
     dict(dp=8, packing="static", distribution="flops_kk", micro_batch_size=1)),
    ("--global-batch-size 32 --use-dynamic-batch-size --max-tokens-per-gpu 16384 "
     "--context-parallel-size 2 --actor-num-gpus-per-node 8",
     dict(dp=4, cp=2, max_tokens_per_gpu=16384, packing="first_fit", distribution="strided")),
    ("--global-batch-size 32 --use-dynamic-batch-size --max-tokens-per-gpu 8192 "
     "--balance-by-flops --dp-size 16 --rollout-batch-size 9 --lr 1e-6",
     dict(dp=16, packing="flops_kk", distribution="flops_kk")),
    ("--global-batch-size 32 --micro-batch-size 1 --actor-num-gpus-per-node 8 "
     "--pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2",
     dict(dp=4, vpp=2, mb_group=2)),
])
def test_from_slime_cmdline(cmd, expected):
    c = ScheduleConfig.from_slime_args(cmd)
    for k, v in expected.items():
        assert getattr(c, k) == v, k


def test_from_slime_namespace_and_dp_override():
    ns = SimpleNamespace(global_batch_size=16, micro_batch_size=None, use_dynamic_batch_size=True,
                         max_tokens_per_gpu=2048, balance_data=True, balance_by_flops=False)
    c = ScheduleConfig.from_slime_args(ns, dp=4)
    assert (c.dp, c.packing, c.distribution, c.cap) == (4, "first_fit", "flops_kk", 2048)


@pytest.mark.parametrize("cmd,match", [
    ("--micro-batch-size 1", "lack --global-batch-size"),
    ("--global-batch-size 4 --use-dynamic-batch-size", "needs --max-tokens-per-gpu"),
    ("--global-batch-size 4 --balance-by-flops", "requires --use-dynamic-batch-size"),
    ("--global-batch-size 4 --actor-num-gpus-per-node 6 --tensor-model-parallel-size 4",
     "not divisible by tp\\*pp\\*cp = 4"),
])
def test_from_slime_errors(cmd, match):
    with pytest.raises(ValueError, match=match):
        ScheduleConfig.from_slime_args(cmd)
