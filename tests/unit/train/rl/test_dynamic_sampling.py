"""Dynamic sampling (slime's --dynamic-sampling-filter-path with --over-sampling-batch-size):
rounds of generation until the batch of kept groups is full, the kept groups renumbered,
keep_when_insufficient, and a filter that never keeps named. A generator of hand-chosen
rewards makes every decision derivable by hand; the last test runs the tiny model."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_generate import _generate, tiny  # noqa: F401  (tiny: a fixture)

from varbatch_kit import Rollouts
from varbatch_kit.train.rl.dynamic_sampling import collect_groups, group_samples
from varbatch_kit.train.rl.task import FilterOutput, nonzero_reward_std, slime_args

N = 2  # rollouts per prompt group


def rounds_of(rewards_by_round):
    """``generate(count, round)`` giving, in round ``r``, groups with the rewards listed (one
    sample per rollout, two rollouts per group)."""
    def generate(count, round_):
        groups = rewards_by_round[round_]
        assert len(groups) == count
        rid = np.repeat(np.arange(count), N) * N + np.tile(np.arange(N), count)
        extra = pd.DataFrame({
            "tokens": [[1, 2, 3]] * (count * N), "reward": np.concatenate(groups),
            "group_index": np.repeat(np.arange(count), N), "question": f"round {round_}",
            "answer": 0, "response": [f"r{round_} g{g} #{j}" for g in range(count)
                                      for j in range(N)]})
        return Rollouts(prompt_len=[2] * (count * N), response_len=[1] * (count * N),
                        rollout_id=rid, extra=extra)
    return generate


def test_rounds_until_the_batch_is_full_and_the_kept_groups_renumbered():
    # round 0: rewards (1, 1) dropped, (0, 1) kept, (0, 0) dropped; round 1: (1, 0) kept and
    # the batch of 2 is full, so (0, 0) after it is never judged
    gen = rounds_of([[[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 0.0], [1, 1]]])
    batch, log = collect_groups(gen, batch_size=2, n_samples_per_prompt=N,
                                over_sampling_batch_size=3, group_filter=nonzero_reward_std,
                                args=slime_args())
    assert log.as_dict() == {"sampling_rounds": 2, "groups_generated": 6, "groups_kept": 2,
                             "groups_dropped": 2,
                             "drop_reasons": {"zero_std_1.0": 1, "zero_std_0.0": 1}}
    assert batch.extra["response"].tolist() == ["r0 g1 #0", "r0 g1 #1", "r1 g0 #0", "r1 g0 #1"]
    assert batch.extra["group_index"].tolist() == [0, 0, 1, 1]
    assert batch.rollout_id.tolist() == [0, 1, 2, 3]
    assert [s.reward for s in group_samples(batch, 1)] == [1.0, 0.0]


def test_keep_when_insufficient_keeps_a_rejected_group_the_batch_cannot_spare():
    def reject(args, samples):
        return FilterOutput(keep=False, reason="no", keep_when_insufficient=True)

    rewards = [[0.0, 0.0]] * 3
    # 2 prompts for 2 groups: dropping either would leave too few, both are kept
    _, log = collect_groups(rounds_of([rewards[:2]]), batch_size=2, n_samples_per_prompt=N,
                            group_filter=reject, args=slime_args())
    assert (log.rounds, log.kept, log.dropped) == (1, 2, 0)
    # 3 prompts: the first can be spared (3 candidates for 2 places), the other two cannot
    _, log = collect_groups(rounds_of([rewards]), batch_size=2, n_samples_per_prompt=N,
                            over_sampling_batch_size=3, group_filter=reject, args=slime_args())
    assert (log.rounds, log.kept, log.dropped, log.reasons) == (1, 2, 1, {"no": 1})


def test_without_a_filter_one_round_returns_the_generated_batch():
    gen = rounds_of([[[1.0, 1.0], [0.0, 1.0]]])
    batch, log = collect_groups(gen, batch_size=2, n_samples_per_prompt=N)
    want = gen(2, 0)
    assert batch.rollout_id.tolist() == want.rollout_id.tolist()
    pd.testing.assert_frame_equal(batch.extra, want.extra)
    assert (log.rounds, log.kept, log.dropped) == (1, 2, 0)


def test_a_filter_that_keeps_nothing_stops_with_its_reasons():
    gen = rounds_of([[[1.0, 1.0]]] * 3)
    with pytest.raises(RuntimeError, match=r"kept 0 of the 1 prompt groups .* after 3 rounds "
                                           r".*'zero_std_1.0': 3"):
        collect_groups(gen, batch_size=1, n_samples_per_prompt=N,
                       group_filter=nonzero_reward_std, args=slime_args(), max_rounds=3)


def test_dapo_on_generated_groups_keeps_only_groups_whose_rewards_differ(tiny):  # noqa: F811
    from varbatch_kit.train.rl.task import Problem

    def even_digit_first_in_even_groups(args, sample):  # odd groups all 0: always dropped
        return 0.0 if sample.group_index % 2 else float(sample.response[:1] in "02468")

    def generate(count, round_):
        problems = [Problem(f"What is {round_} + {i}?", round_ + i) for i in range(count)]
        return _generate(tiny, problems=problems, reward=even_digit_first_in_even_groups,
                         seed=round_, turns=1)

    batch, log = collect_groups(generate, batch_size=2, n_samples_per_prompt=4,
                                over_sampling_batch_size=2, group_filter=nonzero_reward_std,
                                args=slime_args())
    assert log.kept == 2 and log.dropped >= 1 and log.reasons.get("zero_std_0.0", 0) >= 1
    for g in (0, 1):
        assert np.ptp([s.reward for s in group_samples(batch, g)]) > 0
