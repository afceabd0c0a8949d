"""Trace files: round trips, bundled traces, clear errors, safe .pt loading."""

import json

import numpy as np
import pytest
import torch

from varbatch_kit import Rollouts
from varbatch_kit.core.trace_errors import TraceError
from varbatch_kit.core.traces import bundled_traces, read_trace, write_trace


def sample():
    return Rollouts(prompt_len=[3, 4, 5], response_len=[2, 1, 3], rollout_id=[7, 7, 9],
                    loss_masks=[[1, 0], [1], [0, 1, 1]])


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_round_trip(tmp_path, suffix):
    r = sample()
    back = read_trace(write_trace(r, tmp_path / f"t{suffix}"))
    assert back.prompt_len.tolist() == [3, 4, 5]
    assert back.rollout_id.tolist() == [7, 7, 9]
    assert [m.tolist() for m in back.loss_masks] == [[1, 0], [1], [0, 1, 1]]
    assert back.mask_sums().tolist() == [1, 1, 2]


def test_jsonl_dict_rewards_and_rollout_log_probs_train_with_reward_key(tmp_path):
    """A JSONL trace's dict rewards stay dicts and its rollout_log_probs lists; the training
    data picks LossConfig.reward_key and keeps the log-probs."""
    from varbatch_kit.train import DataConfig, LossConfig
    from varbatch_kit.train.data.rollout_data import make_training_data

    rows = [{"prompt_len": 2, "response_len": 2, "rollout_id": 0, "tokens": [1, 2, 3, 4],
             "reward": {"acc": 1.0, "fmt": 0.5}, "rollout_log_probs": [-0.5, -1.0]},
            {"prompt_len": 1, "response_len": 1, "rollout_id": 1, "tokens": [5, 6],
             "reward": {"acc": 0.0, "fmt": 1.0}, "rollout_log_probs": [-2.0]}]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = read_trace(p)
    assert r.extra["reward"].tolist() == [rows[0]["reward"], rows[1]["reward"]]
    assert r.extra["rollout_log_probs"].tolist() == [[-0.5, -1.0], [-2.0]]
    data = DataConfig(n_samples_per_prompt=2)
    d = make_training_data(r, vocab_size=8, seed=0, data=data,
                           loss=LossConfig(reward_key="fmt", use_tis=True))
    assert d.sample_reward.tolist() == [0.5, 1.0]
    assert [x.tolist() for x in d.rollout_log_probs] == [[-0.5, -1.0], [-2.0]]
    with pytest.raises(ValueError, match=r"reward_key='nope' is not a key of the reward of "
                                         r"sample 0; its keys are \['acc', 'fmt'\]"):
        make_training_data(r, vocab_size=8, seed=0, data=data,
                           loss=LossConfig(reward_key="nope"))
    # and a Parquet trace of them too
    back = read_trace(write_trace(r, tmp_path / "t.parquet"))
    assert back.extra["reward"].tolist() == r.extra["reward"].tolist()


def test_rollout_id_optional(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"prompt_len": 1, "response_len": 2}\n{"prompt_len": 3, "response_len": 4}\n')
    r = read_trace(p)
    assert r.rollout_id.tolist() == [0, 1] and r.num_rollouts == 2


def test_bundled_traces_match_their_recorded_generator():
    import importlib.util

    from _paths import REPO

    traces = bundled_traces()
    assert set(traces) == {"math", "agentic", "long_context"}
    params = json.loads((next(iter(traces.values())).parent / "traces.json").read_text())
    for name, path in traces.items():
        kw = dict(params[name])
        kw["samples_per_rollout"] = tuple(kw["samples_per_rollout"])
        kw["prompt_len"] = tuple(kw["prompt_len"])
        regenerated = Rollouts.synthetic(**kw)
        on_disk = read_trace(path)
        assert np.array_equal(on_disk.total_len, regenerated.total_len), name
        assert np.array_equal(on_disk.rollout_id, regenerated.rollout_id), name
    # the recorded parameters are the generator script's, so the script rewrites the same files
    script_path = REPO / "scripts" / "make_traces.py"
    spec = importlib.util.spec_from_file_location("make_traces", script_path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert json.loads(json.dumps(script.TRACES)) == params
    assert script.HERE.resolve() == next(iter(traces.values())).parent.resolve()


@pytest.mark.parametrize("content,match", [
    ('{"prompt_len": 1}\n', r"lacks column\(s\) \['response_len'\]"),
    ('{"prompt_len": 1, "response_len": 0}\n', r"line 1: response_len = 0 is not positive"),
    ("not json\n", "line 1 is not JSON"),
    ("", "holds no samples"),
    ('[1, 2]\n', "line 1 is not a JSON object"),
])
def test_malformed_jsonl(tmp_path, content, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(TraceError, match=match) as e:
        read_trace(p)
    assert "bad.jsonl" in str(e.value)


def test_bad_value_names_the_file_line(tmp_path):
    """A str length on line 4 (after a blank line) is reported at line 5, its file line."""
    rows = ['{"prompt_len": 3, "response_len": 5}'] * 3 + [""] + [
        '{"prompt_len": 3, "response_len": "20"}', '{"prompt_len": 3, "response_len": 7}']
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(rows) + "\n")
    with pytest.raises(TraceError, match=r"line 5: response_len = '20' is a str") as e:
        read_trace(p)
    assert "[" not in str(e.value).split("line 5")[1]  # no sample index left
    p.write_text("\n".join(rows[:3] + ['{"prompt_len": 3, "response_len": "20"}']) + "\n")
    with pytest.raises(TraceError, match=r"line 4: response_len = '20'"):
        read_trace(p)


def test_bad_value_names_the_parquet_row(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt_len": [3, 3, -1], "response_len": [5, 5, 5]}), p)
    with pytest.raises(TraceError, match=r"row 3: prompt_len = -1 is negative"):
        read_trace(p)


def test_typo_in_a_bundled_name_lists_the_names():
    from varbatch_kit.core.traces import bundled_traces

    names = sorted(bundled_traces())
    assert "agentic" in names
    with pytest.raises(TraceError) as e:
        read_trace("agentc")
    msg = str(e.value)
    assert "did you mean 'agentic'" in msg
    assert f"bundled traces: {', '.join(names)}" in msg


def test_missing_and_unknown(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_trace(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError, match="unknown format '.csv'"):
        read_trace(tmp_path / "x.csv")
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        read_trace(tmp_path / "x.parquet")


def test_slime_dump_plain_containers(tmp_path):
    samples = [
        {"tokens": list(range(10)), "response_length": 4, "loss_mask": [1, 1, 0, 1],
         "group_index": 0},
        {"tokens": torch.arange(6), "response_length": 2, "loss_mask": torch.tensor([1, 1]),
         "group_index": 0},
        {"tokens": list(range(5)), "response_length": 5, "group_index": 3},
    ]
    p = tmp_path / "rollout_0.pt"
    torch.save({"rollout_id": 0, "samples": samples}, p)
    r = read_trace(p)
    assert r.prompt_len.tolist() == [6, 4, 0]
    assert r.response_len.tolist() == [4, 2, 5]
    # no rollout_id: one rollout per sample, as slime numbers them; group_index is the
    # prompt group (GRPO), never a rollout id
    assert r.rollout_id.tolist() == [0, 1, 2]
    assert r.extra["group_index"].tolist() == [0, 0, 3]
    assert [m.tolist() for m in r.loss_masks] == [[1, 1, 0, 1], [1, 1], [1] * 5]
    # a compact rollout: siblings share an explicit rollout_id; the plain sample gets
    # the smallest id no sample uses
    for s in samples[:2]:
        s["rollout_id"] = 0
    torch.save({"rollout_id": 0, "samples": samples}, p)
    assert read_trace(p).rollout_id.tolist() == [0, 0, 1]
    assert read_trace(p).mask_sums().tolist() == [3, 2, 5]
    assert read_trace(p).rollout_mask_sums().tolist() == [5, 5, 5]


class Sample:  # an arbitrary class: loading it would need unpickling code
    def __init__(self):
        self.tokens = [1, 2]


def test_slime_dump_with_objects_is_refused(tmp_path):
    p = tmp_path / "rollout_1.pt"
    torch.save({"samples": [Sample()]}, p)
    with pytest.raises(TraceError, match="need unpickling arbitrary code"):
        read_trace(p)


def test_synthetic_properties():
    r = Rollouts.synthetic(500, samples_per_rollout=(1, 6), response_len=800,
                           max_response_len=2000, seed=5)
    assert r.num_rollouts == 500 and len(r) > 500
    assert r.response_len.max() == 2000  # truncation spike
    assert (r.response_len == 2000).sum() > 5
    same = Rollouts.synthetic(500, samples_per_rollout=(1, 6), response_len=800,
                              max_response_len=2000, seed=5)
    assert np.array_equal(r.total_len, same.total_len)
    with pytest.raises(ValueError, match="samples_per_rollout"):
        Rollouts.synthetic(5, samples_per_rollout=(3, 1))
