"""Generation records rewards and prompt groups, never advantages: the engine's estimator
(``TrainConfig.loss``) is the one place rewards become advantages.

A tiny random Llama and a character tokenizer stand in for SmolLM2 (the real model:
tests/integration/test_train_generate.py), so this runs in a second on a CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from varbatch_kit.train import DataConfig, LossConfig
from varbatch_kit.train.data.rollout_advantages import token_advantages
from varbatch_kit.train.data.rollout_data import make_training_data
from varbatch_kit.train.rl import generate
from varbatch_kit.train.rl.generate import generate_rollouts
from varbatch_kit.train.rl.task import Problem

EOT, PAD, VOCAB = 11, 12, 13


class CharTokenizer:
    """ids 0-9: the digits, 10: any other character, 11: end of turn, 12: padding."""

    eos_token_id, pad_token_id = EOT, PAD

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return " ".join(m["content"] for m in messages) + " "

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(c) if c.isdigit() else 10 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) if i < 10 else " " for i in ids if i < EOT)


@pytest.fixture(scope="module")
def tiny():
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=EOT, pad_token_id=PAD)
    return transformers.LlamaForCausalLM(config).eval(), CharTokenizer()


PROBLEMS = [Problem("What is 1 + 1?", 2), Problem("What is 2 + 1?", 3),
            Problem("What is 4 - 3?", 1)]


def _generate(tiny, **kw):
    model, tokenizer = tiny
    args = dict(problems=PROBLEMS, n_samples_per_prompt=4, turns=2, follow_up="if_wrong",
                max_new_tokens=2, temperature=2.0, seed=2, progress=False)
    return generate_rollouts(model, tokenizer=tokenizer, **{**args, **kw})


def test_generation_writes_rewards_and_groups_but_no_advantages(tiny):
    r = _generate(tiny)
    assert "advantage" not in r.extra.columns
    assert {"tokens", "reward", "group_index", "turn", "turn_reward"} <= set(r.extra.columns)
    assert not hasattr(generate, "group_advantages")  # the third GRPO normalisation is gone
    df = r.to_frame()
    assert sorted(df.group_index.unique()) == [0, 1, 2]
    assert (df.rollout_id // 4 == df.group_index).all()
    for _, g in df.groupby("rollout_id"):  # a rollout's samples share its mean turn reward
        assert g.reward.nunique() == 1
        assert g.reward.iloc[0] == pytest.approx(g.turn_reward.mean())


def test_the_engine_turns_the_generated_rewards_into_grpo_advantages(tiny):
    r = _generate(tiny)
    reward = r.extra["reward"].to_numpy(dtype=float)
    groups = r.extra["group_index"].to_numpy()
    varied = [g for g in np.unique(groups) if np.ptp(reward[groups == g]) > 0]
    assert varied and len(varied) < 3, "change the seed: the test needs groups of both kinds"
    data_cfg, loss = DataConfig(n_samples_per_prompt=4), LossConfig(advantage_grouping="prompt")
    assert loss.advantage_estimator == "grpo"
    data = make_training_data(r, vocab_size=VOCAB, seed=0, data=data_cfg, loss=loss)
    assert data.given_advantages is None  # computed from the rewards, not read from a column
    adv = token_advantages(data, r, loss=loss, data_cfg=data_cfg)
    # GRPO per prompt group over the samples, by hand: (r - mean) / (unbiased std + 1e-6)
    want = np.zeros(len(r))
    for g in np.unique(groups):
        x = reward[groups == g]
        want[groups == g] = (x - x.mean()) / (x.std(ddof=1) + 1e-6)
    for i, a in enumerate(adv):
        assert a.shape == (int(r.response_len[i]),)
        assert a == pytest.approx(np.full(a.shape, want[i]), rel=1e-5, abs=1e-6)
    # a group whose rollouts all earned the same reward teaches nothing
    same = ~np.isin(groups, varied)
    assert np.all([np.all(adv[i] == 0) for i in np.flatnonzero(same)])


def test_the_format_reward_adds_a_quarter_for_the_number_alone():
    """Hand-derived: 0.75 for the right answer, 0.25 for a response that is one integer
    (a minus sign, a final period and spaces allowed), both for "5"."""
    from varbatch_kit.train.rl.generate import answer_and_format_reward
    from varbatch_kit.train.rl.task import Sample, load_function, score

    cases = {"5": 1.0, " 5. ": 1.0, "It is 5.": 0.75, "5 apples": 0.75, "4": 0.25,
             "-4": 0.25, "\u22124": 0.25, "4.5": 0.0, "It is 4.": 0.0, "": 0.0}
    samples = [Sample(index=i, group_index=0, prompt="", response=r, label=5)
               for i, r in enumerate(cases)]
    assert score(answer_and_format_reward, None, samples) == list(cases.values())
    # by slime's dotted path, as --custom-rm-path names it
    fn = load_function("varbatch_kit.train.rl.generate.answer_and_format_reward")
    assert fn is answer_and_format_reward
