"""slime debug rollout dumps (:mod:`varbatch_kit.core.slime_dumps`), read as slime's trainer does.

The dumps in ``tests/golden/dumps/`` were written by slime's own
``save_debug_rollout_data`` from slime's real ``Sample`` objects, and each
``.json`` beside a dump records what slime's own code made of it
(``_convert_samples_to_train_data``, ``build_dp_schedule``): see
``scripts/record_slime_dumps.py``.
"""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from _paths import GOLDEN as GOLDEN_ROOT
from _paths import REPO

from varbatch_kit import Rollouts
from varbatch_kit.compat.slime import (
    SlimeCompatError,
    build_dp_schedule,
    convert_samples_to_train_data,
)
from varbatch_kit.core import traces
from varbatch_kit.core.slime_dumps import (
    SlimeSampleError,
    flatten_slime_samples,
    read_slime_dump,
    slime_train_data,
)
from varbatch_kit.core.trace_errors import TraceError
from varbatch_kit.core.traces import read_trace, write_trace
from varbatch_kit.report import rollout_denominators

GOLDEN = GOLDEN_ROOT / "dumps"
PINNED = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
RECORDS = {p.stem: json.loads(p.read_text()) for p in sorted(GOLDEN.glob("*.json"))}
READABLE = {k: v for k, v in RECORDS.items() if v["kind"] != "unsafe"}
UNSAFE = {k: v for k, v in RECORDS.items() if v["kind"] == "unsafe"}


def partition(ids) -> set[frozenset[int]]:
    groups: dict = {}
    for pos, rid in enumerate(ids):
        groups.setdefault(rid, set()).add(pos)
    return {frozenset(g) for g in groups.values()}


def raw_samples(rec) -> list:
    return torch.load(GOLDEN / rec["dump"], weights_only=True)["samples"]


def flat(node) -> list[dict]:
    return [s for x in node for s in flat(x)] if isinstance(node, list) else [node]


def test_recorded_set_is_complete():
    kinds = [r["kind"] for r in RECORDS.values()]
    assert kinds.count("flat") >= 10 and kinds.count("old") == 1
    assert kinds.count("nested") >= 1 and kinds.count("unsafe") >= 1
    for rec in RECORDS.values():
        assert rec["slime_commit"] == PINNED
        assert rec["generator"] == "scripts/record_slime_dumps.py"
        assert (GOLDEN / rec["dump"]).is_file()
        assert (GOLDEN / rec["dump"]).stat().st_size < 20_000
    # the recorded batches exercise what the reader must get right
    td = [r["train_data"] for r in READABLE.values()]
    samples = [s for r in READABLE.values() for s in r["samples"]]
    assert {s["status"] for s in samples} == {"completed", "truncated", "aborted", "failed"}
    assert any(s["remove_sample"] for s in samples)
    assert any(s["rollout_id"] is None for s in samples)
    assert any(isinstance(s["reward"], dict) for s in samples)
    assert any(s["reward"] is None for s in samples)
    dumped = [d for r in READABLE.values() for d in flat(raw_samples(r))]
    assert any(d.get("loss_mask") is None for d in dumped)
    assert any(d.get("loss_mask") is not None and 0 in d["loss_mask"] for d in dumped)
    # an explicit compact id that a position-based reader would collide with
    assert any(
        any(s["rollout_id"] is not None and s["rollout_id"] < len(r["samples"])
            and s["rollout_id"] != i for i, s in enumerate(r["samples"]))
        for r in READABLE.values())
    assert any(len(set(t["rollout_ids"])) < len(t["rollout_ids"]) for t in td)  # multi-sample
    assert sum("output" in s for r in READABLE.values() for s in r["schedules"]) >= 50


@pytest.mark.parametrize("name", sorted(READABLE))
def test_read_trace_matches_slime(name):
    rec = READABLE[name]
    td = rec["train_data"]
    r = read_trace(GOLDEN / rec["dump"])
    assert r.total_len.tolist() == td["total_lengths"]
    assert r.response_len.tolist() == td["response_lengths"]
    assert r.prompt_len.tolist() == [t - p for t, p in zip(td["total_lengths"],
                                                            td["response_lengths"])]
    # the same rollouts, and the very ids slime assigns (explicit ones and fresh ones)
    assert partition(r.rollout_id.tolist()) == partition(td["rollout_ids"])
    assert r.rollout_id.tolist() == td["rollout_ids"]
    assert r.num_rollouts == len(set(td["rollout_ids"]))
    assert [m.tolist() for m in r.masks()] == td["loss_masks"]
    assert r.mask_sums().tolist() == [sum(m) for m in td["loss_masks"]]
    assert r.rollout_mask_sums().tolist() == td["rollout_mask_sums"]
    denoms = rollout_denominators(r.rollout_id.tolist(),
                                  [torch.as_tensor(m) for m in r.masks()])
    assert denoms.tolist() == [float(v) for v in td["rollout_mask_sums"]]


@pytest.mark.parametrize("name", sorted(READABLE))
def test_read_trace_hands_dumps_to_read_slime_dump(name):
    path = GOLDEN / READABLE[name]["dump"]
    direct, via = read_slime_dump(path), read_trace(path)
    assert direct.total_len.tolist() == via.total_len.tolist()
    assert direct.rollout_id.tolist() == via.rollout_id.tolist()
    assert [m.tolist() for m in direct.masks()] == [m.tolist() for m in via.masks()]
    pd.testing.assert_frame_equal(direct.extra, via.extra)


def test_dump_names_have_one_import_path(tmp_path):
    for name in ("slime_train_data", "SlimeSampleError", "flatten_slime_samples", "TraceError"):
        assert name not in traces.__all__, name
    assert issubclass(SlimeSampleError, TraceError)
    with pytest.raises(TraceError, match="does not exist"):
        read_slime_dump(tmp_path / "missing.pt")


def test_flatten_keeps_the_nested_positions():
    a, b, c = {"k": 0}, {"k": 1}, {"k": 2}
    assert flatten_slime_samples([[a, b], [c]]) == ([a, b, c], [(0, 0), (0, 1), (1, 0)])
    assert flatten_slime_samples([a, b]) == ([a, b], [(0,), (1,)])
    with pytest.raises(SlimeSampleError, match="must be a list of sample dicts"):
        flatten_slime_samples({"samples": []})


@pytest.mark.parametrize("name", sorted(READABLE))
def test_extra_keeps_the_per_sample_fields(name):
    rec = READABLE[name]
    td = rec["train_data"]
    r = read_trace(GOLDEN / rec["dump"])
    extra = r.extra
    assert isinstance(extra, pd.DataFrame) and len(extra) == len(r)
    assert extra["truncated"].dtype == bool
    assert extra["truncated"].astype(int).tolist() == td["truncated"]
    dumped = flat(raw_samples(rec))
    for i, (s, d) in enumerate(zip(rec["samples"], dumped)):
        row = extra.iloc[i]
        assert row["status"] == s["status"]
        assert row["remove_sample"] == s["remove_sample"]
        assert row["index"] == s["index"] and row["group_index"] == s["group_index"]
        if s["rollout_id"] is None:
            assert pd.isna(row["rollout_id"])
        else:
            assert row["rollout_id"] == s["rollout_id"]
        reward = s["reward"]
        if reward is None:
            assert pd.isna(row["reward"])
        else:  # a number, or the dict as slime's Sample.reward holds it
            assert row["reward"] == reward
            assert isinstance(row["reward"], dict) == isinstance(reward, dict)
        if isinstance(reward, dict):
            for k, v in reward.items():
                assert row[f"reward/{k}"] == v
        if d.get("rollout_log_probs") is None:
            assert "rollout_log_probs" not in extra or row["rollout_log_probs"] is None
        else:
            assert row["rollout_log_probs"] == [float(x) for x in d["rollout_log_probs"]]
            assert len(row["rollout_log_probs"]) == d["response_length"]
        assert row["tokens"] == list(d["tokens"])
        assert row["metadata"] == d["metadata"]
        assert row["label"] == d["label"] and row["response"] == d["response"]
    assert extra["status"].eq("truncated").tolist() == [bool(t) for t in td["truncated"]]
    if "raw_reward" in extra:  # metadata["raw_reward"] replaced some rewards, as in slime
        assert extra["raw_reward"].tolist() == td["raw_reward"]
    else:
        assert all(s["reward"] == v for s, v in zip(rec["samples"], td["raw_reward"]))


@pytest.mark.parametrize("name", sorted(READABLE))
def test_convert_samples_to_train_data_matches_slime(name):
    rec = READABLE[name]
    assert convert_samples_to_train_data(raw_samples(rec)) == rec["train_data"]


@pytest.mark.parametrize("name", sorted(READABLE))
def test_compat_schedule_on_read_dump_matches_slime(name):
    rec = READABLE[name]
    r = read_trace(GOLDEN / rec["dump"])
    for sched in rec["schedules"]:
        call = dict(global_batch_size=sched["global_batch_size"],
                    rollout_indices=r.rollout_id.tolist())
        args = SimpleNamespace(**sched["args"])
        if "error" in sched:
            with pytest.raises(SlimeCompatError) as e:
                build_dp_schedule(args, sched["train_parallel_config"], r.total_len.tolist(),
                                  **call)
            assert str(e.value).split(";")[0] == sched["error"].split(";")[0]
            continue
        out = build_dp_schedule(args, sched["train_parallel_config"], r.total_len.tolist(),
                                **call)
        assert [list(x) for x in out] == sched["output"], sched["args"]


def test_old_dump_is_one_rollout_per_sample():
    rec = READABLE["old_rollout_20"]
    dumped = raw_samples(rec)
    assert all("rollout_id" not in d for d in dumped)
    assert len({d["group_index"] for d in dumped}) < len(dumped)  # prompt groups, not rollouts
    r = read_trace(GOLDEN / rec["dump"])
    assert r.rollout_id.tolist() == list(range(len(dumped))) == rec["train_data"]["rollout_ids"]
    assert r.extra["rollout_id"].isna().all()
    assert r.extra["group_index"].tolist() == [d["group_index"] for d in dumped]


def test_nested_dumps_are_flattened_like_slime():
    nested = {k: v for k, v in READABLE.items() if v["kind"] == "nested"}
    assert {v["depth"] for v in nested.values()} == {2, 3}
    for rec in nested.values():
        dumped = raw_samples(rec)
        assert all(isinstance(x, list) for x in dumped)
        r = read_trace(GOLDEN / rec["dump"])
        assert len(r) == len(flat(dumped)) == len(rec["train_data"]["rollout_ids"])
        # every compact rollout's siblings share one rollout
        for sib in (dumped if rec["depth"] == 2 else [s for p in dumped for s in p]):
            ids = {rec["train_data"]["rollout_ids"][flat(dumped).index(s)] for s in sib}
            assert len(ids) == 1


# --------------------------------------------------------------------------- unsafe dumps
CLEAN_HINT = "to_dict()"


def assert_clean_refusal(message: str):
    assert "need unpickling arbitrary code" in message
    assert "\x1b[" not in message
    assert "weights_only=False" not in message
    assert "weights_only` set to `False" not in message
    assert CLEAN_HINT in message


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_unsafe_recorded_dumps_are_refused(name):
    with pytest.raises(TraceError) as e:
        read_trace(GOLDEN / UNSAFE[name]["dump"])
    assert_clean_refusal(str(e.value))
    assert e.value.__cause__ is None and e.value.__suppress_context__


class _Payload:
    """Unpickling this creates a marker file: the proof that code in a dump ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_unsafe_payload_never_runs(tmp_path):
    marker = tmp_path / "ran"
    p = tmp_path / "rollout_0.pt"
    torch.save({"rollout_id": 0, "samples": [{"tokens": [1, 2], "response_length": 1,
                                              "evil": _Payload(marker)}]}, p)
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert_clean_refusal(str(e.value))
    assert not marker.exists()
    # the payload is live: an unrestricted load would have run it
    live = tmp_path / "ran_live"
    pickle.loads(pickle.dumps(_Payload(live))).close()
    assert live.exists() and not marker.exists()


def test_corrupt_dump_has_a_clean_message(tmp_path):
    for i, content in enumerate([b"not a torch file\n", b"garbage\x80\x04"]):
        p = tmp_path / f"bad{i}.pt"
        p.write_bytes(content)
        with pytest.raises(TraceError, match="is not a readable torch.save file") as e:
            read_trace(p)
        assert "\x1b[" not in str(e.value) and "weights_only=False" not in str(e.value)


# --------------------------------------------------------------------------- semantics
def sample(resp=3, total=5, **kw):
    return {"tokens": list(range(total)), "response_length": resp, **kw}


def test_fresh_ids_skip_explicit_ones_in_sample_order():
    samples = [sample(), sample(rollout_id=0), sample(), sample(rollout_id=1), sample(),
               sample(rollout_id=0), sample(rollout_id=7)]
    td = slime_train_data(samples)
    assert td["rollout_ids"] == [2, 0, 3, 1, 4, 0, 7]
    assert td["rollout_mask_sums"] == [3, 6, 3, 3, 3, 6, 3]


def test_masks_none_removed_and_status():
    samples = [sample(loss_mask=None, status="completed"),
               sample(loss_mask=[1, 0, 1], remove_sample=True, status="truncated"),
               sample(loss_mask=[0, 1, 1], status="aborted", rollout_id=5),
               sample(loss_mask=torch.tensor([1, 1, 0]), rollout_id=5)]
    td = slime_train_data(samples)
    assert td["loss_masks"] == [[1, 1, 1], [0, 0, 0], [0, 1, 1], [1, 1, 0]]
    assert td["truncated"] == [0, 1, 0, 0]
    assert td["rollout_mask_sums"] == [3, 0, 4, 4]


def test_raw_reward_and_reward_key():
    samples = [sample(reward={"acc": 1.0, "len": 3}), sample(reward={"acc": 0.0, "len": 4})]
    assert slime_train_data(samples)["raw_reward"] == [{"acc": 1.0, "len": 3},
                                                       {"acc": 0.0, "len": 4}]
    assert slime_train_data(samples, reward_key="acc")["raw_reward"] == [1.0, 0.0]
    with pytest.raises(SlimeCompatError, match="sample 0: reward_key 'nope'"):
        convert_samples_to_train_data(samples, reward_key="nope")
    # a metadata raw_reward replaces the reward (only where given), as slime does
    samples = [sample(reward=0.5, metadata={"raw_reward": 2.0}), sample(reward=0.25, metadata={})]
    assert slime_train_data(samples)["raw_reward"] == [2.0, 0.25]


def write(tmp_path, samples, name="x.pt"):
    p = tmp_path / name
    torch.save({"rollout_id": 0, "samples": samples}, p)
    return p


def test_mask_length_error_names_sample_and_field(tmp_path):
    samples = [sample(), sample(), sample(), sample(resp=7, total=9, loss_mask=[1] * 5)]
    with pytest.raises(TraceError) as e:
        read_trace(write(tmp_path, samples))
    assert str(e.value).startswith(
        f"slime dump {str(tmp_path / 'x.pt')!r}: sample 3: loss_mask has 5 entries but "
        "response_length is 7")
    with pytest.raises(SlimeCompatError) as e:
        convert_samples_to_train_data(samples)
    assert str(e.value).startswith("loss mask length 5 != response length 7")
    assert "sample 3" in str(e.value)
    assert isinstance(e.value, ValueError) and isinstance(e.value, AssertionError)
    # slime checks the length before zeroing a removed sample's mask
    with pytest.raises(SlimeCompatError, match="loss mask length 2 != response length 3"):
        convert_samples_to_train_data([sample(loss_mask=[1, 1], remove_sample=True)])


@pytest.mark.parametrize("bad,match", [
    (sample(resp=0, total=4, loss_mask=[]), r"sample 1: response_length is 0; varbatch_kit"),
    ({"tokens": [1, 2]}, "sample 1: lacks response_length"),
    (sample(resp=-1), r"sample 1: response_length = -1 is not a token count"),
    (sample(resp=4, total=2), "sample 1: tokens has 2 entries but response_length is 4"),
    ({"response_length": 2}, "sample 1: lacks tokens"),
    (sample(rollout_id="a"), r"sample 1: rollout_id = 'a' is not an integer"),
    (sample(rollout_id=1.0), r"sample 1: rollout_id = 1.0 is not an integer"),
    (sample(loss_mask=[1, 2, 0]), "sample 1: loss_mask holds values other than 0 and 1"),
    (sample(loss_mask="111"), "sample 1: loss_mask must be a list"),
    ([1, 2], "sample 1: not a sample dict"),
])
def test_malformed_samples_are_named(tmp_path, bad, match):
    with pytest.raises(TraceError, match=match) as e:
        read_trace(write(tmp_path, [sample(), bad]))
    assert "x.pt" in str(e.value)


def test_batch_level_errors(tmp_path):
    with pytest.raises(TraceError, match="holds no samples"):
        read_trace(write(tmp_path, []))
    p = tmp_path / "y.pt"
    torch.save({"rollout_id": 0, "data": []}, p)
    with pytest.raises(TraceError, match="expected a dict with a 'samples' list"):
        read_trace(p)
    with pytest.raises(TraceError, match=r"sample 1: not a sample dict \(Sample.to_dict\(\)\) but"):
        read_trace(write(tmp_path, [sample(), 3]))
    with pytest.raises(TraceError, match=r"samples\[1\]: this entry is a dict but samples\[0\]"):
        read_trace(write(tmp_path, [[sample()], sample()]))


def test_nested_compact_siblings_must_share_an_id(tmp_path):
    # prompt -> rollout -> samples: a multi-sample leaf is one compact rollout
    ok = [[[sample(rollout_id=3), sample(rollout_id=3)], [sample()]], [[sample()]]]
    r = read_trace(write(tmp_path, ok))
    assert r.rollout_id.tolist() == [3, 3, 0, 1]
    for bad, match in [
        ([[[sample(rollout_id=3), sample()]]], r"samples\[0\]\[0\]: compact rollout of 2 samples "
                                               r"has rollout_id unset at positions \[1\]"),
        ([[[sample(rollout_id=3), sample(rollout_id=4)]]], "must share rollout_id; got"),
    ]:
        with pytest.raises(TraceError, match=match):
            read_trace(write(tmp_path, bad))
        with pytest.raises(SlimeCompatError):
            convert_samples_to_train_data(bad)
    # depth-1 lists are prompt groups (default rollouts), not checked
    assert slime_train_data([[sample(), sample()], [sample()]])["rollout_ids"] == [0, 1, 2]
    with pytest.raises(TraceError, match=r"sample 2 \(samples\[1\]\[0\]\): lacks response_len"):
        read_trace(write(tmp_path, [[sample(), sample()], [{"tokens": [1]}]]))


def test_extra_travels_with_subset_frame_and_files(tmp_path):
    rec = READABLE["rollout_4"]
    r = read_trace(GOLDEN / rec["dump"])
    sub = r.subset([3, 1, 3])
    assert sub.extra["index"].tolist() == [r.extra["index"][3], r.extra["index"][1],
                                           r.extra["index"][3]]
    assert list(sub.extra.index) == [0, 1, 2]
    frame = r.to_frame()
    assert frame["rollout_id"].tolist() == r.rollout_id.tolist()
    assert frame["rollout_id_given"].isna().tolist() == r.extra["rollout_id"].isna().tolist()
    assert "reward/score" in frame and "status" in frame
    assert list(r.to_frame(extra=False).columns) == ["prompt_len", "response_len", "total_len",
                                                     "rollout_id"]
    for suffix in (".jsonl", ".parquet"):
        back = read_trace(write_trace(r, tmp_path / f"t{suffix}"))
        assert back.rollout_id.tolist() == r.rollout_id.tolist()
        assert back.extra["status"].tolist() == r.extra["status"].tolist()
        assert back.extra["tokens"].map(list).tolist() == r.extra["tokens"].tolist()
        np.testing.assert_array_equal(back.extra["reward/acc"].to_numpy(dtype=float),
                                      r.extra["reward/acc"].to_numpy(dtype=float))
        assert "rollout_id" not in back.extra
    with pytest.raises(ValueError, match="extra has 1 rows but there are 2 samples"):
        Rollouts(prompt_len=[1, 1], response_len=[1, 1], extra=pd.DataFrame({"a": [1]}))
    with pytest.raises(ValueError, match="extra must be a pandas DataFrame"):
        Rollouts(prompt_len=[1], response_len=[1], extra={"a": [1]})
    plain = Rollouts(prompt_len=[1], response_len=[1])
    assert plain.extra is None and plain.subset([0]).extra is None


def test_core_does_not_import_compat():
    code = ("import sys; from varbatch_kit.core.traces import read_trace; "
            f"read_trace({str(GOLDEN / 'rollout_3.pt')!r}); "
            "assert not [m for m in sys.modules if m.startswith('varbatch_kit.compat')]")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not os.environ.get("SLIME_SRC"),
                    reason="set SLIME_SRC to a slime checkout to re-record the golden dumps")
def test_generator_reproduces_the_records(tmp_path):
    subprocess.run([sys.executable, str(REPO / "scripts" / "record_slime_dumps.py"),
                    "--slime", os.environ["SLIME_SRC"], "--out", str(tmp_path),
                    "--slime-commit", PINNED], check=True, capture_output=True)
    again = {p.stem: json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))}
    assert again == RECORDS


def test_rollout_log_probs_and_dict_rewards_are_kept_and_train(tmp_path):
    """A dump's rollout_log_probs become a column (tensors as lists of float), dict rewards stay
    dicts; the training data reads both (reward_key picks the reward)."""
    from varbatch_kit.train import DataConfig, LossConfig
    from varbatch_kit.train.data.rollout_advantages import token_advantages
    from varbatch_kit.train.data.rollout_data import make_training_data

    samples = [sample(reward={"acc": 1.0, "fmt": 0.5}, rollout_log_probs=[-0.5, -1.0, -0.25]),
               sample(reward={"acc": 0.0, "fmt": 1.0},
                      rollout_log_probs=torch.tensor([-2.0, -0.125, -1.5])),
               sample(resp=2, total=4, reward={"acc": 1.0, "fmt": 0.0},
                      rollout_log_probs=[-0.75, -0.5], remove_sample=True)]
    r = read_trace(write(tmp_path, samples))
    assert r.extra["reward"].tolist() == [s["reward"] for s in samples]
    assert r.extra["reward/fmt"].tolist() == [0.5, 1.0, 0.0]
    assert r.extra["rollout_log_probs"].tolist() == [[-0.5, -1.0, -0.25], [-2.0, -0.125, -1.5],
                                                     [-0.75, -0.5]]
    data = DataConfig(n_samples_per_prompt=3)
    loss = LossConfig(reward_key="acc", use_tis=True, grpo_std_normalization=False)
    d = make_training_data(r, vocab_size=8, seed=0, data=data, loss=loss)
    assert d.sample_reward.tolist() == [1.0, 0.0, 1.0]
    assert [x.tolist() for x in d.rollout_log_probs] == r.extra["rollout_log_probs"].tolist()
    adv = token_advantages(d, r, loss=loss, data_cfg=data)
    assert np.concatenate(adv).tolist() == pytest.approx([1 / 3] * 3 + [-2 / 3] * 3 + [1 / 3] * 2)
    assert r.masks()[2].tolist() == [0, 0]  # remove_sample: fully masked, still in its group
    with pytest.raises(ValueError, match=r"dict reward with keys \['acc', 'fmt'\]"):
        make_training_data(r, vocab_size=8, seed=0, data=data, loss=LossConfig())
    # both travel through JSONL and Parquet traces
    for suffix in (".jsonl", ".parquet"):
        back = read_trace(write_trace(r, tmp_path / f"t{suffix}"))
        assert back.extra["reward"].tolist() == r.extra["reward"].tolist()
        assert back.extra["rollout_log_probs"].map(list).tolist() == \
            r.extra["rollout_log_probs"].tolist()
        d2 = make_training_data(back, vocab_size=8, seed=0, data=data, loss=loss)
        assert d2.sample_reward.tolist() == d.sample_reward.tolist()
    # a dump without log-probs has no such column, and TIS is refused before training
    plain = read_trace(write(tmp_path, [sample(reward=1.0), sample(reward=0.0)], "p.pt"))
    assert "rollout_log_probs" not in plain.extra
    with pytest.raises(ValueError, match="loss.use_tis=True needs the rollout engine's"):
        make_training_data(plain, vocab_size=8, seed=0, data=DataConfig(n_samples_per_prompt=2),
                           loss=LossConfig(use_tis=True))


def test_recorded_dump_with_rollout_log_probs_trains_with_them():
    rec = READABLE["rollout_10"]
    dumped = flat(raw_samples(rec))
    assert all(d.get("rollout_log_probs") is not None for d in dumped)
    r = read_trace(GOLDEN / rec["dump"])
    from varbatch_kit.train import DataConfig, LossConfig
    from varbatch_kit.train.data.rollout_data import make_training_data

    d = make_training_data(r, vocab_size=1 << 20, seed=0, data=DataConfig(n_samples_per_prompt=2),
                           loss=LossConfig(use_tis=True, use_rollout_logprobs=True))
    assert [x.tolist() for x in d.rollout_log_probs] == [
        [float(v) for v in s["rollout_log_probs"]] for s in dumped]


def test_without_columns_drops_extra_columns_and_names_missing_ones():
    r = read_trace(GOLDEN / READABLE["rollout_4"]["dump"])
    r2 = r.without_columns("status", "index")
    assert "status" not in r2.extra and "index" not in r2.extra
    assert list(r2.extra.columns) == [c for c in r.extra.columns if c not in ("status", "index")]
    assert r2.rollout_id.tolist() == r.rollout_id.tolist() and len(r2) == len(r)
    assert [m.tolist() for m in r2.masks()] == [m.tolist() for m in r.masks()]
    with pytest.raises(ValueError, match=r"no column\(s\) \['nope'\]"):
        r.without_columns("nope")


# --------------------------------------------------------------------------- loading
def test_the_restricted_loader_reads_what_weights_only_reads(tmp_path):
    """Tensors of several dtypes, nested containers, an OrderedDict, numbers and strings: the
    C unpickler restricted to weights_only's globals gives what torch.load(weights_only=True)
    gives."""
    from collections import OrderedDict

    from varbatch_kit.core.slime_dumps import _load_pt

    obj = {"rollout_id": 3, "samples": [
        {"tokens": torch.arange(7), "lp": torch.randn(4, dtype=torch.bfloat16),
         "mask": torch.ones(3, dtype=torch.bool), "meta": OrderedDict(a=1.5, b=[1, (2, "x")]),
         "status": "completed", "reward": None}]}
    p = tmp_path / "rollout_3.pt"
    torch.save(obj, p)
    got, want = _load_pt(p), torch.load(p, weights_only=True)
    assert isinstance(got["samples"][0]["meta"], OrderedDict)
    for g, w in zip(got["samples"][0].values(), want["samples"][0].values()):
        assert (torch.equal(g, w) and g.dtype == w.dtype) if isinstance(w, torch.Tensor) \
            else g == w


def test_a_global_outside_weights_onlys_list_is_refused_by_name(tmp_path):
    """The restriction is in find_class: a global torch's weights_only loader would refuse
    (os.getcwd, harmless) is refused before anything is built, and named."""
    import os as os_module

    class _Call:
        def __reduce__(self):
            return (os_module.getcwd, ())

    p = tmp_path / "rollout_0.pt"
    torch.save({"rollout_id": 0, "samples": [{"tokens": [1, 2], "response_length": 1,
                                              "x": _Call()}]}, p)
    with pytest.raises(TraceError, match=r"it asks for the Python object '(posix|os)\.getcwd'"):
        read_trace(p)


def test_a_dump_is_read_once_per_process_and_again_when_it_changes(tmp_path, monkeypatch):
    from varbatch_kit.core import slime_dumps

    p = tmp_path / "rollout_0.pt"
    torch.save({"rollout_id": 0, "samples": [
        {"tokens": [1, 2, 3, 4], "response_length": 2, "rollout_id": 0, "status": "completed"},
        {"tokens": [1, 2, 3], "response_length": 1, "rollout_id": 0, "status": "completed"}]}, p)
    loads = []
    real = slime_dumps._load_pt
    monkeypatch.setattr(slime_dumps, "_load_pt", lambda path: loads.append(path) or real(path))
    slime_dumps._READ.clear()
    a = read_trace(p)
    b = read_trace(p)
    assert len(loads) == 1 and a is not b and a.total_len.tolist() == b.total_len.tolist()
    a.extra.loc[0, "status"] = "aborted"  # the caller's copy: the cached batch does not move
    c = read_trace(p)
    assert c.response_len[0] == 2 and c.extra.loc[0, "status"] == "completed"
    # the file changes (size and mtime): it is read again
    torch.save({"rollout_id": 0, "samples": [
        {"tokens": [1, 2, 3, 4, 5], "response_length": 3, "rollout_id": 0,
         "status": "completed"}]}, p)
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    assert read_trace(p).total_len.tolist() == [5] and len(loads) == 2
    # the cache is bounded by the files' bytes: the oldest dump leaves first
    q = tmp_path / "rollout_1.pt"
    torch.save({"rollout_id": 1, "samples": [
        {"tokens": [1, 2, 3], "response_length": 1, "rollout_id": 0, "status": "completed"}]}, q)
    monkeypatch.setattr(slime_dumps, "_READ_MAX_BYTES", p.stat().st_size + q.stat().st_size - 1)
    read_trace(q)  # both do not fit: p leaves
    read_trace(q)
    assert len(loads) == 3
    read_trace(p)
    assert len(loads) == 4 and len(slime_dumps._READ) == 1


def test_an_older_dump_says_once_what_was_assumed(tmp_path):
    """No rollout_id and no status on any sample (an older slime): one warning naming both
    assumptions; a dump that has them reads silently."""
    import warnings

    from varbatch_kit.core.slime_dumps import OlderSlimeDumpWarning

    rec = READABLE["old_rollout_20"]
    with pytest.warns(OlderSlimeDumpWarning) as got:
        read_trace(GOLDEN / rec["dump"])
    assert len(got) == 1
    assert f"each of the {len(raw_samples(rec))} samples was read as a rollout of its own" \
        in str(got[0].message)
    p = tmp_path / "rollout_0.pt"
    torch.save({"rollout_id": 0, "samples": [{"tokens": [1, 2, 3], "response_length": 1}]}, p)
    with pytest.warns(OlderSlimeDumpWarning, match="no sample has a status, so none was "):
        read_trace(p)
    torch.save({"rollout_id": 0, "samples": [
        {"tokens": [1, 2, 3], "response_length": 1, "rollout_id": 0, "status": "completed"}]},
        tmp_path / "rollout_1.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_trace(tmp_path / "rollout_1.pt")
