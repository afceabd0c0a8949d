"""A slime run's dumps read as one run (:mod:`varbatch_kit.core.run_dumps`).

The dumps are slime's own (``tests/golden/dumps/rollout_*.pt``, written by
slime's ``save_debug_rollout_data``; see ``scripts/record_slime_dumps.py``),
copied into a temporary folder as a run.
"""

import shutil

import numpy as np
import pytest
import torch
from _paths import GOLDEN

from varbatch_kit.core.run_dumps import RunDumps, is_run_path, read_run
from varbatch_kit.core.slime_dumps import read_slime_dump
from varbatch_kit.core.trace_errors import TraceError
from varbatch_kit.core.traces import read_trace

DUMPS = GOLDEN / "dumps"
IDS = [2, 10, 9, 1]  # copied out of order: 10 sorts before 9 as text


@pytest.fixture
def run_dir(tmp_path):
    for k in IDS:
        shutil.copy(DUMPS / f"rollout_{k}.pt", tmp_path / f"rollout_{k}.pt")
    return tmp_path


def test_a_directory_reads_as_one_run_in_rollout_id_order(run_dir):
    run = read_run(run_dir)
    assert isinstance(run, RunDumps)
    assert run.rollout_ids == [1, 2, 9, 10]
    assert len(run) == 4 and [s.path.name for s in run] == [
        "rollout_1.pt", "rollout_2.pt", "rollout_9.pt", "rollout_10.pt"]
    assert run.pattern == str(run_dir / "rollout_{rollout_id}.pt")
    for step in run:  # each step is exactly what reading its dump alone gives
        alone = read_slime_dump(DUMPS / f"rollout_{step.rollout_id}.pt")
        np.testing.assert_array_equal(step.rollouts.response_len, alone.response_len)
        np.testing.assert_array_equal(step.rollouts.prompt_len, alone.prompt_len)
        np.testing.assert_array_equal(step.rollouts.rollout_id, alone.rollout_id)
    assert run.num_samples == sum(len(read_slime_dump(DUMPS / f"rollout_{k}.pt")) for k in IDS)
    assert len(run.step(9)) == 9 and len(run.step(10)) == 16  # sample counts of those dumps
    with pytest.raises(ValueError, match=r"rollout_id=3 .*\[1, 2, 9, 10\]"):
        run.step(3)
    assert "4 rollout steps (rollout_id 1..10)" in repr(run)


def test_the_template_form_reads_the_same_run(run_dir):
    template = str(run_dir / "rollout_{rollout_id}.pt")
    assert is_run_path(template) and is_run_path(run_dir)
    assert not is_run_path(run_dir / "rollout_1.pt")
    run = read_run(template)
    assert run.rollout_ids == [1, 2, 9, 10] and run.pattern == template
    assert [len(s.rollouts) for s in run] == [len(s.rollouts) for s in read_run(run_dir)]


def test_the_template_picks_its_files_and_skips_eval_dumps(run_dir):
    # slime writes evaluation rollouts to the template with rollout_id "eval_<k>"
    shutil.copy(DUMPS / "rollout_3.pt", run_dir / "rollout_eval_3.pt")
    shutil.copy(DUMPS / "old_rollout_20.pt", run_dir / "other_20.pt")
    run = read_run(run_dir / "rollout_{rollout_id}.pt")
    assert run.rollout_ids == [1, 2, 9, 10]
    assert [p.name for p in run.eval_paths] == ["rollout_eval_3.pt"]


def test_the_kept_fields_of_slime_sample(tmp_path):
    # slime's Sample carries rollout_log_probs, teacher_log_probs (on-policy distillation)
    # and weight_versions; a dump keeps them as columns
    obj = torch.load(DUMPS / "rollout_1.pt", weights_only=True)
    for j, s in enumerate(obj["samples"]):
        n = s["response_length"]
        s["rollout_log_probs"] = [-0.5 - j] * n
        s["teacher_log_probs"] = None if j == 1 else [-0.25 * (j + 1)] * n
        s["weight_versions"] = [f"v{j}", f"v{j + 1}"]
    torch.save(obj, tmp_path / "rollout_1.pt")
    extra = read_run(tmp_path).step(1).extra
    assert extra["rollout_log_probs"].iloc[2] == [-2.5] * obj["samples"][2]["response_length"]
    assert extra["teacher_log_probs"].iloc[0] == [-0.25] * obj["samples"][0]["response_length"]
    assert extra["teacher_log_probs"].iloc[1] is None
    assert list(extra["weight_versions"]) == [[f"v{j}", f"v{j + 1}"] for j in range(6)]
    # slime's default, no versions recorded: no column
    assert "weight_versions" not in read_trace(DUMPS / "rollout_1.pt").extra.columns


def test_no_dump_found_names_the_pattern(tmp_path):
    with pytest.raises(TraceError, match=r"no slime dump found in .*looked for .*\*\{rollout_id\}"
                                         r"\.pt"):
        read_run(tmp_path)
    with pytest.raises(TraceError, match=r"looked for files named rollout_\{rollout_id\}\.pt "
                                         r"\(\{rollout_id\} an integer\)"):
        read_run(tmp_path / "rollout_{rollout_id}.pt")
    (tmp_path / "rollout_eval_1.pt").write_bytes((DUMPS / "rollout_1.pt").read_bytes())
    with pytest.raises(TraceError, match=r"only evaluation dumps: \['rollout_eval_1\.pt'\]"):
        read_run(tmp_path / "rollout_{rollout_id}.pt")
    with pytest.raises(TraceError, match="does not exist"):
        read_run(tmp_path / "missing")
    with pytest.raises(TraceError, match=r"exactly once"):
        read_run(str(tmp_path / "r_{rollout_id}_{rollout_id}.pt"))


def test_a_file_that_is_not_a_dump_is_named(run_dir):
    (run_dir / "rollout_5.pt").write_bytes(b"not a torch file")
    with pytest.raises(TraceError, match=r"rollout_5\.pt.* not a readable torch\.save file"):
        read_run(run_dir)


def test_mixed_formats_and_templates_are_refused(run_dir):
    shutil.copy(DUMPS / "old_rollout_20.pt", run_dir / "old_rollout_20.pt")
    with pytest.raises(TraceError, match=r"several templates: old_rollout_\{rollout_id\}\.pt "
                                         r"\(1 files\), rollout_\{rollout_id\}\.pt \(4 files\)"):
        read_run(run_dir)
    (run_dir / "old_rollout_20.pt").unlink()
    (run_dir / "trace.jsonl").write_text('{"prompt_len": 1, "response_len": 2}\n')
    with pytest.raises(TraceError, match=r"mixes formats: slime dumps \(4 \.pt files\) and trace "
                                         r"tables \(trace\.jsonl\)"):
        read_run(run_dir)
    (run_dir / "trace.jsonl").unlink()
    shutil.copy(DUMPS / "unsafe_status_enum.pt", run_dir / "model.pt")
    with pytest.raises(TraceError, match=r"\['model\.pt'\] do not end in a rollout id"):
        read_run(run_dir)


def test_one_rollout_id_twice_or_a_disagreeing_id_is_refused(run_dir):
    shutil.copy(DUMPS / "rollout_2.pt", run_dir / "rollout_02.pt")
    with pytest.raises(TraceError, match=r"both dumps of rollout_id 2"):
        read_run(run_dir)
    (run_dir / "rollout_02.pt").unlink()
    shutil.copy(DUMPS / "rollout_3.pt", run_dir / "rollout_4.pt")  # saved rollout_id 3
    with pytest.raises(TraceError, match=r"rollout_4\.pt' says rollout_id 3 but its name says 4"):
        read_run(run_dir)


def test_read_trace_reads_one_file_and_points_a_run_to_read_run(run_dir):
    with pytest.raises(TraceError, match=r"is a run .*read_run"):
        read_trace(run_dir)
    with pytest.raises(TraceError, match=r"is a run .*read_run"):
        read_trace(run_dir / "rollout_{rollout_id}.pt")
    with pytest.raises(TraceError, match=r"is one dump, not a run: read it with read_trace"):
        read_run(run_dir / "rollout_1.pt")
