"""The RL loop's pure parts: the weights hash and the bitwise sync check."""

from __future__ import annotations

import pytest
import torch

from varbatch_kit.train.rl.rl_loop import _sync_exact, weights_hash


def test_the_hash_sees_every_bit_name_and_dtype_but_not_dict_order():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    assert weights_hash(a) == weights_hash(dict(reversed(list(a.items()))))
    flipped = {**a, "w": torch.tensor([1.0, torch.nextafter(torch.tensor(2.0),
                                                            torch.tensor(3.0)).item()])}
    assert weights_hash(flipped) != weights_hash(a)
    assert weights_hash({**a, "w": a["w"].double()}) != weights_hash(a)
    assert weights_hash({"v": a["w"], "b": a["b"]}) != weights_hash(a)


def test_the_sync_check_is_bitwise_and_dtype_strict():
    trained = {"w": torch.tensor([1.0, 2.0]), "extra": torch.zeros(1)}
    assert _sync_exact(trained, {"w": torch.tensor([1.0, 2.0])})
    assert not _sync_exact(trained, {"w": torch.tensor([1.0, 2.0 + 2 ** -20])})
    assert not _sync_exact(trained, {"w": torch.tensor([1.0, 2.0]).double()})
    assert not _sync_exact(trained, {"missing": torch.zeros(1)})


def test_idle_iterations_are_warned_once_each_with_their_count():
    """Nothing silently: iterations whose advantages were all zero, and iterations whose
    training left the weights as they were, one warning each, with a count."""
    import warnings

    from varbatch_kit.train.rl.rl_loop import _warn_idle

    records = [dict(iteration=0, zero_advantages=True, generator_hash="a", trained_hash="b"),
               dict(iteration=1, zero_advantages=True, generator_hash="b", trained_hash="b"),
               dict(iteration=2, zero_advantages=False, generator_hash="b", trained_hash="c")]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _warn_idle(records)
    assert [str(w.message)[:60] for w in got] == [
        "rl_loop: 2 of 3 iterations had every advantage zero (iterati",
        "rl_loop: 1 of 3 iterations left the weights unchanged (itera"]
    assert "iterations [0, 1]" in str(got[0].message)
    assert "iterations [1]" in str(got[1].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_idle(records[2:])  # a learning iteration: no warning


def test_prompts_are_drawn_in_order_cyclically_and_seeded_questions_stay_as_they_were(tmp_path):
    """A list (or JSONL file) of prompts is drawn from where the last draw stopped, wrapping
    around; the rollout batch defaults to its length. Seeded arithmetic questions: round 0 of
    iteration k is what the loop always drew (``arithmetic_problems(n, seed + 1000 k)``),
    over-sampling rounds draw other questions."""
    import json

    from varbatch_kit.train.rl.generate import arithmetic_problems
    from varbatch_kit.train.rl.rl_loop import _PromptSource
    from varbatch_kit.train.rl.task import Problem

    rows = [Problem(f"q{i}", i) for i in range(3)]
    src = _PromptSource(rows, seed=0, input_key="input", label_key="label")
    assert src.batch == 3
    assert [p.question for p in src.draw(2, 0, 0)] == ["q0", "q1"]
    assert [p.question for p in src.draw(2, 0, 1)] == ["q2", "q0"] and src.cursor == 1
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"input": f"f{i}", "label": i}) + "\n" for i in range(2)))
    from_file = _PromptSource(path, seed=0, input_key="input", label_key="label")
    assert [p.question for p in from_file.draw(3, 0, 0)] == ["f0", "f1", "f0"]
    seeded = _PromptSource(4, seed=5, input_key="input", label_key="label")
    assert seeded.batch == 4
    assert seeded.draw(4, 2, 0) == arithmetic_problems(4, seed=5 + 2000)
    assert seeded.draw(4, 2, 1) != seeded.draw(4, 2, 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dynamic_sampling_filter="dapo"),
     r"dynamic_sampling_filter='dapo': give one of \['nonzero_std', "
     r"'nonzero_std_with_fallback'\]"),
    (dict(dynamic_sampling_filter=3), r"dynamic_sampling_filter=3: give a callable"),
    (dict(reward="nope.rm"), r"cannot import module 'nope'"),
    (dict(over_sampling_batch_size=0), r"over_sampling_batch_size"),
    (dict(rollout_batch_size=-1), r"rollout_batch_size"),
])
def test_the_task_arguments_are_checked_before_anything_runs(tmp_path, kwargs, match):
    from varbatch_kit.train import TrainConfig, rl_loop

    with pytest.raises(ValueError, match=match):
        rl_loop(TrainConfig().with_(path=str(tmp_path / "no-checkpoint")), 2,
                out_dir=tmp_path / "loop", **kwargs)
    assert not (tmp_path / "loop").exists()
