"""Each scheduler warning once per public call, with the number of schedules that raised it
(:mod:`varbatch_kit.analysis.warn_once`), not once per policy, layout or trace."""

import logging
import threading
import warnings

import pytest
from _factories import TINY, rollouts

from varbatch_kit import ScheduleConfig, build_schedule
from varbatch_kit.analysis import sweeps
from varbatch_kit.analysis.optimum_gap import SmallStep
from varbatch_kit.analysis.warn_once import MAX_LINES, warn_once
from varbatch_kit.core.build import DROPPED_ROLLOUTS_MESSAGE, OversizeSampleWarning

#: 8 one-sample rollouts, two (12 and 11 tokens) longer than a cap of 10
OVER = rollouts([5, 12, 8, 2, 11, 1, 4, 6])
CFG = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=10)
PAIRS = [("first_fit", "strided"), ("ffd", "strided"), ("bfd", "flops_kk")]


def recorded(call):
    """Run ``call``; its warnings (every one, as Python would show them) and its result."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = call()
    return [w for w in caught if issubclass(w.category, OversizeSampleWarning)], out


def drops(caplog):
    return [r.getMessage() for r in caplog.records if "trailing rollouts" in r.getMessage()]


# ----------------------------------------------------------------- the public calls
def test_policy_table_says_the_oversize_warning_once_with_its_count():
    caught, table = recorded(lambda: sweeps.policy_table(OVER, CFG, TINY, PAIRS))
    assert len(caught) == 1  # was one per policy
    msg = str(caught[0].message)
    assert msg.startswith("in 3 of 3 policies: 2 of 8 samples (25.0 %) are longer than the "
                          "token cap 10")
    assert "\n" not in msg  # every policy said the same
    assert caught[0].filename == __file__  # at the caller of policy_table, as build_schedule
    assert table.oversize_alone.tolist() == [2, 2, 2]


def test_policy_table_logs_the_dropped_rollouts_once(caplog):
    r = rollouts([3, 4, 5, 6, 7, 8, 9])  # 7 rollouts, steps of 2: rollout 6 fills no step
    cfg = ScheduleConfig(dp=1, global_batch_size=2, max_tokens_per_gpu=20)
    with caplog.at_level(logging.WARNING, logger="varbatch_kit"):
        sweeps.policy_table(r, cfg, TINY, PAIRS)
    assert drops(caplog) == [
        "in 3 of 3 policies: dropping 1 trailing rollouts (1 samples) that do not fill a "
        "step of global_batch_size=2"]


def test_sweep_table_counts_the_layouts_and_gives_each_message_a_line():
    # cap 10: 12 and 11 are over it; cap 11: only 12; cap 20: none
    caught, table = recorded(lambda: sweeps.sweep_table(
        OVER, CFG, TINY, max_tokens_per_gpu=[10, 11, 20], dp=[1, 2]))
    assert len(caught) == 1  # was one per layout with an over-cap sample: four
    lines = str(caught[0].message).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("in 2 of 6 layouts: 2 of 8 samples (25.0 %) are longer than "
                               "the token cap 10")
    assert lines[1].startswith("in 2 of 6 layouts: 1 of 8 samples (12.5 %) are longer than "
                               "the token cap 11")
    assert len(table) == 6


def test_policy_table_by_trace_says_it_once_for_every_trace():
    traces = {"a": OVER, "b": rollouts([5, 30, 8, 2, 9, 1, 4, 6]), "c": rollouts([1, 2, 3, 4])}
    caught, table = recorded(lambda: sweeps.policy_table_by_trace(
        traces, TINY, dp=2, max_tokens_per_gpu=10, steps=2, policies=PAIRS))
    assert len(caught) == 1  # was one per trace and policy: six
    lines = str(caught[0].message).splitlines()
    assert [ln.split(":")[0] for ln in lines] == [
        "in 3 of 9 schedules (traces x policies)"] * 2
    assert "2 of 8 samples" in lines[0] and "1 of 8 samples" in lines[1]
    assert len(table) == 9


def test_simulated_comparison_says_it_once():
    caught, cmp = recorded(lambda: sweeps.simulated_comparison(OVER, CFG, TINY, PAIRS))
    assert len(caught) == 1
    assert str(caught[0].message).startswith("in 3 of 3 policies: 2 of 8 samples")
    assert len(cmp.totals) == 3


def test_optimum_gap_says_it_once():
    pytest.importorskip("ortools")
    from varbatch_kit.analysis.optimum_gap import gap_to_optimal

    step = SmallStep(OVER.total_len, 10, 2)
    caught, rows = recorded(lambda: gap_to_optimal(step, TINY, PAIRS[:2], time_limit_s=0.5))
    assert len(caught) == 1 and str(caught[0].message).startswith("in 2 of 2 policies: ")
    assert [r["policy"] for r in rows] == ["first_fit+strided", "ffd+strided"]


def test_run_quality_table_says_it_once_and_leaves_the_drops_to_its_column(tmp_path, caplog):
    import shutil

    from _paths import GOLDEN

    from varbatch_kit import ModelShape
    from varbatch_kit.analysis.run_quality import run_quality_table
    from varbatch_kit.core.run_dumps import read_run

    for k in (3, 1, 13):
        shutil.copy(GOLDEN / "dumps" / f"rollout_{k}.pt", tmp_path / f"rollout_{k}.pt")
    cfg = ScheduleConfig(dp=1, global_batch_size=3, max_tokens_per_gpu=16)
    with caplog.at_level(logging.WARNING, logger="varbatch_kit"):
        caught, table = recorded(lambda: run_quality_table(read_run(tmp_path), cfg,
                                                           ModelShape.preset("qwen3-8b")))
    assert len(caught) == 1  # was one per rollout step and policy: six
    lines = str(caught[0].message).splitlines()
    assert len(lines) == 3  # the three rollout steps hold different samples
    assert all(ln.startswith("in 2 of 6 schedules (rollout steps x policies): ")
               for ln in lines)
    assert table.dropped_samples.tolist() == [0, 0, 4, 4, 0, 0]
    assert drops(caplog) == []  # dropped_samples says it


def test_one_build_schedule_still_warns_in_its_own_words():
    with pytest.warns(OversizeSampleWarning) as rec:
        build_schedule(OVER, CFG, TINY)
    assert len(rec) == 1 and str(rec[0].message).startswith("2 of 8 samples (25.0 %)")


def test_the_users_filters_apply_to_the_warning_said_once():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversizeSampleWarning)
        with warnings.catch_warnings(record=True) as caught:
            sweeps.policy_table(OVER, CFG, TINY, PAIRS)
    assert not caught
    with warnings.catch_warnings():
        warnings.simplefilter("error", OversizeSampleWarning)
        with pytest.raises(OversizeSampleWarning, match="in 3 of 3 policies"):
            sweeps.policy_table(OVER, CFG, TINY, PAIRS)


# ------------------------------------------------------------------- the helper
def test_a_case_that_raised_is_not_counted():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with warn_once("things") as tally:
            for i in range(3):
                with pytest.raises(ValueError) if i == 1 else _nothing():
                    with tally.case():
                        warnings.warn("too long", OversizeSampleWarning, stacklevel=1)
                        if i == 1:
                            raise ValueError("cannot run")
    assert [str(w.message) for w in caught] == ["in 2 of 2 things: too long"]


def test_many_different_messages_are_cut_to_a_few_lines_and_a_count():
    n = MAX_LINES + 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with warn_once("things") as tally:
            for i in range(n):
                with tally.case():
                    warnings.warn(f"message {i}", OversizeSampleWarning, stacklevel=1)
    (w,) = caught
    lines = str(w.message).splitlines()
    assert lines[:MAX_LINES] == [f"in 1 of {n} things: message {i}" for i in range(MAX_LINES)]
    assert lines[MAX_LINES:] == [f"(and 2 other variants of this message, in 2 of the {n} "
                                 "things)"]


def test_other_warnings_pass_through_at_once_and_log_records_below_warning_too(caplog):
    with warnings.catch_warnings(record=True) as caught, \
            caplog.at_level(logging.INFO, logger="varbatch_kit"):
        warnings.simplefilter("always")
        with warn_once("things") as tally:
            with tally.case():
                warnings.warn("not ours", RuntimeWarning, stacklevel=1)
                logging.getLogger("varbatch_kit").info("an info line")
                assert [str(w.message) for w in caught] == ["not ours"]
                assert [r.getMessage() for r in caplog.records] == ["an info line"]


def test_held_back_kinds_are_not_said(caplog):
    log = logging.getLogger("varbatch_kit")
    with caplog.at_level(logging.WARNING, logger="varbatch_kit"), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with warn_once("things", hold_back=(DROPPED_ROLLOUTS_MESSAGE,)) as tally:
            for _ in range(2):
                with tally.case():
                    log.warning(DROPPED_ROLLOUTS_MESSAGE, 1, 1, 2)
                    log.warning("step %d moves on", 0)
                    warnings.warn("too long", OversizeSampleWarning, stacklevel=1)
        with warn_once("things", hold_back=True) as tally:
            with tally.case():
                log.warning("step %d moves on", 0)
                warnings.warn("too long", OversizeSampleWarning, stacklevel=1)
    assert [r.getMessage() for r in caplog.records] == ["in 2 of 2 things: step 0 moves on"]
    assert [str(w.message) for w in caught] == ["in 2 of 2 things: too long"]


def test_a_nested_call_joins_the_outer_one():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with warn_once("outer things") as outer:
            with outer.case():
                warnings.warn("a", OversizeSampleWarning, stacklevel=1)
            with warn_once("inner things") as inner:
                assert inner is outer
                with inner.case():
                    warnings.warn("a", OversizeSampleWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["in 2 of 2 outer things: a"]


def test_another_threads_warnings_are_not_held_back():
    def other():
        warnings.warn("from elsewhere", OversizeSampleWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with warn_once("things") as tally:
            for _ in range(2):
                with tally.case():
                    t = threading.Thread(target=other)
                    t.start()
                    t.join()
    assert [str(w.message) for w in caught] == ["from elsewhere"] * 2  # as they came


def test_a_shower_left_behind_after_its_case_passes_warnings_on():
    """``catch_warnings`` is process-wide: interleaved with another thread's, it can restore
    a case's ``showwarning`` after the case ended. That one must not swallow warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with warn_once("things") as tally, tally.case():
            leaked = warnings.showwarning
        warnings.showwarning = leaked
        warnings.warn("after the case", OversizeSampleWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["after the case"]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
