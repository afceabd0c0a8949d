"""Your own task in generation: slime's custom-RM signature (async or not, per sample or per
group, a callable or a dotted path), the chat before the question, prompt files, the group
filters (DAPO's), and the errors that say what is wrong. The tiny random Llama and character
tokenizer of test_generate.py stand in for a real model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_generate import PROBLEMS, _generate, tiny  # noqa: F401  (tiny: a fixture)

from varbatch_kit.train.rl.task import (
    FilterOutput,
    Problem,
    Sample,
    filter_group,
    load_function,
    nonzero_reward_std,
    nonzero_reward_std_with_fallback,
    read_prompts,
    score,
    slime_args,
)


def _sample(reward=None, group=0, response="7"):
    return Sample(index=0, group_index=group, prompt="q", response=response, reward=reward)


def test_a_slime_custom_rm_by_dotted_path_scores_every_turn(tiny):  # noqa: F811
    """``async def rm(args, sample)`` imported from "_rewards.no_and": every sample's
    ``turn_reward`` is the function of its own response, the rollout's reward their mean."""
    r = _generate(tiny, reward="_rewards.no_and")
    df = r.to_frame()
    want = [float("and" not in text.split()) for text in r.extra["response"]]
    assert df["turn_reward"].tolist() == want
    for _, g in df.groupby("rollout_id"):
        assert g.reward.iloc[0] == pytest.approx(g.turn_reward.mean())


def test_a_group_reward_sees_the_whole_group_and_sync_functions_work(tiny):  # noqa: F811
    seen = []

    def by_group(args, samples):
        seen.append((args.n_samples_per_prompt, [s.group_index for s in samples]))
        return [float(s.response_length) for s in samples]

    r = _generate(tiny, reward=by_group, group_reward=True, turns=1)
    assert r.extra["turn_reward"].tolist() == [float(n) for n in r.response_len]
    assert seen == [(4, [g] * 4) for g in range(3)]  # one call per prompt group, args given


def test_the_follow_up_goes_to_answers_whose_reward_is_not_positive(tiny):  # noqa: F811
    def first_turn_pays_odd_rollouts(args, sample):
        return float(sample.index % 2)

    r = _generate(tiny, reward=first_turn_pays_odd_rollouts, follow_up="if_wrong")
    df = r.to_frame()
    turns = df.groupby("rollout_id")["turn"].max()
    assert (turns[turns.index % 2 == 0] == 1).all() and (turns[turns.index % 2 == 1] == 0).all()


def test_the_chat_before_the_question_can_be_left_out(tiny):  # noqa: F811
    prompts = {}

    def record(args, sample):
        prompts[sample.group_index] = sample.prompt
        return 0.0

    _generate(tiny, reward=record, turns=1, system_prompt=None, example=None)
    assert prompts[0].strip() == PROBLEMS[0].question  # CharTokenizer: the messages joined
    _generate(tiny, reward=record, turns=1)
    assert prompts[0].startswith("Reply with only the number.")


def test_labels_and_metadata_reach_the_reward(tiny):  # noqa: F811
    got = []

    def record(args, sample):
        got.append((sample.label, sample.metadata))
        return 1.0

    problems = [Problem("What is 1 + 1?", {"any": "label"}, {"source": "mine"})]
    _generate(tiny, problems=problems, reward=record, turns=1)
    assert got == [({"any": "label"}, {"source": "mine"})] * 4


@pytest.mark.parametrize("reward,match", [
    (lambda args, s: "1", r"returned '1': a reward must be a finite number"),
    (lambda args, s: float("nan"), r"returned nan"),
    ("no_module_here.rm", r"cannot import module 'no_module_here'"),
    ("_rewards.missing", r"module '_rewards' has no function 'missing'"),
    ("plain", r"give a function as 'module.function'"),
    (42, r"reward=42: give a callable or a 'module.function' path"),
])
def test_a_bad_reward_is_named(tiny, reward, match):  # noqa: F811
    with pytest.raises(ValueError, match=match):
        _generate(tiny, reward=reward, turns=1)


def test_a_group_reward_must_give_one_reward_per_sample(tiny):  # noqa: F811
    with pytest.raises(ValueError, match=r"returned \[1.0\] for 4 samples"):
        _generate(tiny, reward=lambda args, samples: [1.0], group_reward=True, turns=1)


def test_the_default_exact_match_needs_integer_answers(tiny):  # noqa: F811
    with pytest.raises(ValueError, match=r"needs integer answers.*give reward="):
        _generate(tiny, problems=[Problem("Name a colour.", "red")])


def test_score_awaits_async_rewards_and_sets_each_samples_reward():
    async def double(args, sample):
        return 2.0 * float(sample.response)

    samples = [_sample(response="1"), _sample(response="3")]
    assert score(double, slime_args(), samples) == [2.0, 6.0]
    assert [s.reward for s in samples] == [2.0, 6.0]
    assert load_function("_rewards.no_and").__name__ == "no_and"


def test_dapos_filter_keeps_a_group_whose_rewards_differ():
    """slime's check_reward_nonzero_std: std > 1e-6 keeps; a dropped group's reason names
    its common reward; with --reward-key the reward is a dict."""
    args = slime_args()
    out = nonzero_reward_std(args, [_sample(1.0) for _ in range(4)])
    assert (out.keep, out.reason) == (False, "zero_std_1.0")
    assert nonzero_reward_std(args, [_sample(r) for r in (0.0, 1.0, 0.0, 0.0)]).keep
    keyed = slime_args(reward_key="acc")
    assert not nonzero_reward_std(keyed, [_sample({"acc": 0.0}) for _ in range(3)]).keep
    assert nonzero_reward_std(keyed, [_sample({"acc": float(i)}) for i in range(3)]).keep


def test_dapos_filter_gives_slimes_verdicts_on_recorded_groups():
    """Golden vectors from slime's own check_reward_nonzero_std (and its _with_fallback), at
    the commit the file names (scripts/record_slime_filter.py): the same keep, the same
    reason, the same keep_when_insufficient."""
    from _paths import REPO

    golden = json.loads((REPO / "tests" / "golden" / "rl" / "dynamic_filter.json").read_text())
    assert len(golden["cases"]) >= 50 and golden["slime_commit"]
    for case in golden["cases"]:
        args = slime_args(reward_key=case["reward_key"])
        samples = [_sample(r) for r in case["rewards"]]
        out = nonzero_reward_std(args, samples)
        assert (out.keep, out.reason) == (case["keep"], case["reason"]), case
        assert nonzero_reward_std_with_fallback(args, samples).keep_when_insufficient == \
            case["fallback_keep_when_insufficient"]


def test_a_filter_may_return_a_bool_or_slimes_output_object():
    args = slime_args()
    assert filter_group(None, args, []) == FilterOutput(keep=True)
    assert filter_group(lambda a, s: False, args, [_sample()]) == FilterOutput(keep=False)
    assert filter_group(lambda a, s: np.bool_(True), args, [_sample()]).keep

    class DynamicFilterOutput:  # slime's own class, by duck type
        keep, reason, keep_when_insufficient = False, "why", True

    assert filter_group(lambda a, s: DynamicFilterOutput(), args, [_sample()]) == \
        FilterOutput(False, "why", True)
    with pytest.raises(ValueError, match=r"returned 'yes': give a bool or an object with keep"):
        filter_group(lambda a, s: "yes", args, [_sample()])


def test_prompts_from_a_jsonl_file_with_slimes_keys(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"input": "What is 2 + 2?", "label": 4, "metadata": {"level": 1}},
            {"input": "Say hi.", "label": None}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = read_prompts(path)
    assert got == [Problem("What is 2 + 2?", 4), Problem("Say hi.", None)]
    assert got[0].metadata == {"level": 1}
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"question": "q", "answer": 1}) + "\n")
    assert read_prompts(other, input_key="question", label_key="answer") == [Problem("q", 1)]
    with pytest.raises(ValueError, match=r"other.jsonl:1: needs a string under input_key="):
        read_prompts(other)
    with pytest.raises(ValueError, match=r"does not exist"):
        read_prompts(tmp_path / "missing.jsonl")
