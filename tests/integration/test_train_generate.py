"""The rollout generator: the arithmetic task, the reward parser, and the structure of real
SmolLM2 generations (rollout ids shared by turns, group sizes, token lengths, rewards; no
advantages: the engine computes them, tests/unit/train/rl/test_generate.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _paths import REPO

from varbatch_kit.train.rl.generate import (
    FOLLOW_UP,
    GenerationStats,
    Problem,
    arithmetic_problems,
    exact_match_reward,
    first_integer,
    generate_rollouts,
)

ROOT = REPO


# --------------------------------------------------------------------------- task and reward
@pytest.mark.parametrize(("text", "value"), [
    ("42", 42), ("The answer is 12.", 12), ("12 + 3 = 15", 12), ("-4", -4),
    ("\u22127 degrees", -7), ("x1y22", 1), ("no digits here", None), ("", None),
    ("007", 7), ("3-2", 3),
])
def test_first_integer(text, value):
    assert first_integer(text) == value


def test_exact_match_reward():
    assert exact_match_reward("12", 12) == 1.0
    assert exact_match_reward(" 12 is the answer", 12) == 1.0
    assert exact_match_reward("9 + 3 = 12", 12) == 0.0  # the first integer counts
    assert exact_match_reward("I don't know", 12) == 0.0
    assert exact_match_reward("-4", 4) == 0.0


def test_arithmetic_problems_are_seeded_and_correct():
    ps = arithmetic_problems(50, seed=3, max_operand=20)
    assert ps == arithmetic_problems(50, seed=3, max_operand=20)
    assert ps != arithmetic_problems(50, seed=4, max_operand=20)
    for p in ps:
        _, a, op, b = p.question.rstrip("?").rsplit(" ", 3)
        assert p.question.startswith("What is ")
        assert 1 <= int(a) <= 20 and 1 <= int(b) <= 20
        assert p.answer == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    assert {p.question.split()[3] for p in ps} == {"+", "-"}
    assert all("+" in p.question for p in arithmetic_problems(5, ops=("+",)))
    for bad in ({"n": 0}, {"n": 2, "max_operand": 0}, {"n": 2, "ops": ("*",)}):
        with pytest.raises(ValueError):
            arithmetic_problems(**bad)


# --------------------------------------------------------------------------- real generations
@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("transformers")
    from varbatch_kit.train.model.smollm2 import SmolLM2Unavailable, smollm2_checkpoint
    from varbatch_kit.train.rl.generate import load_model

    try:
        path = smollm2_checkpoint(ROOT / "build" / "models")
    except SmolLM2Unavailable as e:
        pytest.skip(str(e))
    return load_model(path, device="cpu")


def _check_structure(r, tokenizer, n_prompts, n):
    df = r.to_frame()
    # every rollout id is prompt * n + k; a prompt group holds n rollouts
    assert sorted(set(df.rollout_id)) == list(range(n_prompts * n))
    assert (df.groupby("group_index").rollout_id.nunique() == n).all()
    assert (df.rollout_id // n == df.group_index).all()
    for _, g in df.groupby("rollout_id"):
        # turns of one rollout: samples in order, one prompt group, one reward
        assert g.turn.tolist() == list(range(len(g)))
        assert g.group_index.nunique() == 1 and g.question.nunique() == 1
        assert g.reward.nunique() == 1
        assert g.reward.iloc[0] == pytest.approx(g.turn_reward.mean())
        if len(g) == 2:  # the second turn's prompt is the whole conversation so far
            t0, t1 = g.tokens.iloc[0], g.tokens.iloc[1]
            p0, p1 = int(g.prompt_len.iloc[0]), int(g.prompt_len.iloc[1])
            assert t1[:p0] == t0[:p0] and p1 > len(t0)
            assert FOLLOW_UP in tokenizer.decode(t1[:p1])
    stop = tokenizer.eos_token_id
    for row in df.itertuples():
        assert len(row.tokens) == row.prompt_len + row.response_len
        response = row.tokens[row.prompt_len:]
        # a response ends at its first stop token, or is cut at max_new_tokens
        assert stop not in response[:-1]
        assert tokenizer.decode(response, skip_special_tokens=True).strip() == row.response
        assert row.turn_reward == exact_match_reward(row.response, row.answer)
    assert "advantage" not in df.columns  # rewards only: the engine's LossConfig decides


def test_two_turn_rollouts_structure_and_trace(smollm2, tmp_path):
    from varbatch_kit.core.traces import read_trace

    model, tokenizer = smollm2
    threads = torch.get_num_threads()
    stats = GenerationStats()
    r = generate_rollouts(model, tokenizer=tokenizer, n_prompts=2, n_samples_per_prompt=3,
                          turns=2, follow_up="always", max_new_tokens=6, seed=1,
                          trace_path=tmp_path / "gen.jsonl", progress=False, stats=stats)
    assert len(r) == 12 and r.num_rollouts == 6  # two samples (turns) per rollout
    assert (r.response_len <= 6).all() and (r.prompt_len > 20).all()
    assert set(r.extra.columns) >= {"tokens", "reward", "group_index"}
    _check_structure(r, tokenizer, 2, 3)
    assert stats.samples == 12 and stats.rollouts == 6 and stats.prompts == 2
    assert stats.generated_tokens == int(r.response_len.sum()) and stats.tokens_per_s > 0
    assert torch.get_num_threads() == threads  # restored after generating with 1 thread
    print(f"generation: {stats.generated_tokens} tokens in {stats.wall_s:.1f} s = "
          f"{stats.tokens_per_s:.1f} tokens/s on {stats.device}")
    # the trace holds everything the engine trains on
    back = read_trace(tmp_path / "gen.jsonl")
    assert back.rollout_id.tolist() == r.rollout_id.tolist()
    assert back.extra.tokens.tolist() == r.extra.tokens.tolist()
    assert back.extra.reward.tolist() == r.extra.reward.tolist()
    assert back.extra.group_index.tolist() == r.extra.group_index.tolist()


def test_follow_up_only_if_wrong_and_determinism(smollm2):
    model, tokenizer = smollm2
    kw = dict(tokenizer=tokenizer, n_samples_per_prompt=3, turns=2, follow_up="if_wrong",
              max_new_tokens=4, progress=False)
    # one question the model gets right sometimes, one it gets wrong
    problems = [Problem("What is 1 + 1?", 2), Problem("What is 3 + 4?", 7)]
    r = generate_rollouts(model, problems=problems, seed=5, **kw)
    df = r.to_frame()
    _check_structure(r, tokenizer, 2, 3)
    for _, g in df.groupby("rollout_id"):
        first = g.turn_reward.iloc[0]
        assert len(g) == (1 if first == 1.0 else 2)  # asked again only when wrong
    again = generate_rollouts(model, problems=problems, seed=5, **kw)
    assert again.extra.tokens.tolist() == r.extra.tokens.tolist()  # same seed, same tokens
    other = generate_rollouts(model, problems=problems, seed=6, **kw)
    assert other.extra.tokens.tolist() != r.extra.tokens.tolist()
    one = generate_rollouts(model, problems=problems[:1], seed=5, **{**kw, "turns": 1})
    assert one.num_rollouts == len(one) == 3 and (one.extra.turn == 0).all()
    # a prompt's rollouts do not depend on the other prompts of the batch
    first_turns = df[(df.turn == 0) & (df.group_index == 0)].tokens.tolist()
    assert one.extra.tokens.tolist() == first_turns


def test_generator_argument_errors(smollm2):
    model, tokenizer = smollm2
    for bad, match in [({"turns": 3}, "turns"), ({"follow_up": "never"}, "follow_up"),
                       ({"temperature": 0}, "temperature"),
                       ({"n_samples_per_prompt": 0}, "n_samples_per_prompt"),
                       ({"max_new_tokens": 0}, "max_new_tokens"), ({"threads": 0}, "threads"),
                       ({"problems": [("What is 1 + 1?", 2)]}, "Problem")]:
        with pytest.raises(ValueError, match=match):
            generate_rollouts(model, tokenizer=tokenizer, progress=False, **bad)
    with pytest.raises(ValueError, match="tokenizer"):
        generate_rollouts(model, progress=False)
    with pytest.raises(ValueError, match="config.json"):
        generate_rollouts(ROOT / "no-such-model", progress=False)
    assert np.isnan(GenerationStats().tokens_per_s)
