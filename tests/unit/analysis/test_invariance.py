"""invariance: the report-invariance matrix of notebook 06, the worst differences, the verdict.

The verdict is tried on both sides of its thresholds on hand-made
``train.compare`` tables.
"""

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from varbatch_kit import Rollouts
from varbatch_kit.analysis import invariance


def test_invariance_imports_neither_plotly_nor_torch():
    code = ("import sys\n"
            "from varbatch_kit.analysis import invariance\n"
            "invariance.invariance_experiment()\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'plotly', 'torch', "
            "'ipywidgets'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"


def compare_table(diffs: dict[str, tuple[float, float, float]], refs_too: bool = True):
    """A hand-made train.compare table: per mode a reference run (config k, zero diffs) and
    one other run with the given (loss, grad_norm, param) relative differences at step 2,
    zero at step 1."""
    rows = []
    k = 0
    for mode, (loss, gn, par) in diffs.items():
        ref = k
        for step in (1, 2):
            rows.append({"config": ref, "reference": ref, "mode": mode, "step": step,
                         "loss_rel_diff": 0.0, "grad_norm_rel_diff": 0.0,
                         "param_rel_diff": 0.0 if step == 2 else np.nan})
            big = step == 2
            rows.append({"config": ref + 1, "reference": ref, "mode": mode, "step": step,
                         "loss_rel_diff": loss if big else 0.0,
                         "grad_norm_rel_diff": gn if big else 0.0,
                         "param_rel_diff": par if big else np.nan})
        k += 2
    df = pd.DataFrame(rows)
    return df if refs_too else df[df.config != df.reference]


SOUND = ("per_rollout_mean", "per_token")


def test_worst_rel_diff_leaves_the_references_out():
    table = compare_table({"per_token": (1e-7, 2e-7, 3e-7), "naive_rank_mean": (0.5, 0.1, 0.2)})
    # a reference run that disagrees with itself would be a bug; it must not count
    table.loc[table.config == table.reference, "loss_rel_diff"] = 99.0
    worst = invariance.worst_rel_diff(table)
    assert worst.index.tolist() == ["per_token", "naive_rank_mean"]
    assert worst.columns.tolist() == list(invariance.REL_DIFF_COLUMNS)
    np.testing.assert_allclose(worst.loc["per_token"], [1e-7, 2e-7, 3e-7])
    np.testing.assert_allclose(worst.loc["naive_rank_mean"], [0.5, 0.1, 0.2])
    only = invariance.worst_rel_diff(table, ["naive_rank_mean"])
    assert only.index.tolist() == ["naive_rank_mean"]
    with pytest.raises(ValueError, match="param_rel_diff"):
        invariance.worst_rel_diff(table.drop(columns="param_rel_diff"))


@pytest.mark.parametrize("sound_top, naive_top, sound_ok, drift", [
    (9.9e-5, 1.01e-3, True, True),     # just inside both thresholds
    (1.0e-4, 1.01e-3, False, True),    # a sound mode at the tolerance fails
    (3e-4, 0.5, False, True),
    (1e-7, 1.0e-3, True, False),       # a naive mode at drift_min has not drifted
    (1e-7, 2e-4, True, False),
])
def test_invariance_verdict_around_the_default_thresholds(sound_top, naive_top, sound_ok, drift):
    table = compare_table({"per_rollout_mean": (1e-8, sound_top, np.nan),
                           "per_token": (1e-9, 1e-9, 1e-9),
                           "naive_microbatch_mean": (0.3, 0.2, 0.1),
                           "naive_rank_mean": (naive_top / 10, naive_top, naive_top / 2)})
    v = invariance.invariance_verdict(table, sound_modes=SOUND)
    assert (v.sound_invariant, v.naive_drift, v.ok) == (sound_ok, drift, sound_ok and drift)
    assert (v.sound_tol, v.drift_min) == (1e-4, 1e-3)
    assert v.sound_modes == SOUND
    assert v.naive_modes == ("naive_microbatch_mean", "naive_rank_mean")
    assert v.labels["per_rollout_mean"] == ("identical across layouts" if sound_ok
                                            else "MOVES WITH THE LAYOUT")
    assert v.labels["naive_rank_mean"] == ("drifts with the layout, as expected" if drift
                                           else "did not drift here")
    assert v.labels["per_token"] == "identical across layouts"
    assert v.labels["naive_microbatch_mean"] == "drifts with the layout, as expected"
    assert str(v).splitlines()[-1] == (f"verdict: sound modes layout-invariant: {sound_ok}; "
                                       f"naive modes drift: {drift}")


def test_invariance_verdict_thresholds_are_parameters_and_the_text_is_notebook_04s():
    table = compare_table({"per_rollout_mean": (2e-5, 0, 0), "naive_rank_mean": (5e-4, 0, 0)})
    assert not invariance.invariance_verdict(table, sound_modes=SOUND).naive_drift
    v = invariance.invariance_verdict(table, sound_tol=1e-5, drift_min=1e-4, sound_modes=SOUND)
    assert (v.sound_invariant, v.naive_drift) == (False, True)
    v = invariance.invariance_verdict(table, sound_tol=1e-4, drift_min=1e-4, sound_modes=SOUND)
    assert v.ok
    assert str(v) == ("per_rollout_mean       identical across layouts\n"
                      "naive_rank_mean        drifts with the layout, as expected\n"
                      "verdict: sound modes layout-invariant: True; naive modes drift: True")
    with pytest.raises(ValueError, match="sound_tol <= drift_min"):
        invariance.invariance_verdict(table, sound_tol=1e-2, drift_min=1e-3)
    with pytest.raises(ValueError, match="sound_tol"):
        invariance.invariance_verdict(table, sound_tol=0)


def test_invariance_verdict_default_sound_modes_are_the_reports():
    pytest.importorskip("torch")
    from varbatch_kit.report import LAYOUT_INVARIANT_MODES, NAIVE_MODES

    table = compare_table({m: (1e-9, 1e-9, 1e-9) for m in LAYOUT_INVARIANT_MODES}
                          | {m: (0.1, 0.1, 0.1) for m in NAIVE_MODES})
    v = invariance.invariance_verdict(table)
    assert set(v.sound_modes) == set(LAYOUT_INVARIANT_MODES)
    assert set(v.naive_modes) == set(NAIVE_MODES)
    assert v.ok


def test_invariance_verdict_nothing_compared_is_not_invariant():
    table = compare_table({"per_token": (0.0, 0.0, 0.0)})
    table.loc[table.config != table.reference, list(invariance.REL_DIFF_COLUMNS)] = np.nan
    v = invariance.invariance_verdict(table, sound_modes=SOUND)
    assert not v.sound_invariant and v.labels["per_token"] == "MOVES WITH THE LAYOUT"


def test_invariance_experiment_is_notebook_04s_matrix():
    e = invariance.invariance_experiment()
    assert len(e.rollouts) == len(Rollouts.synthetic(
        24, samples_per_rollout=(1, 4), prompt_len=(3, 8), response_len=10,
        response_sigma=0.5, max_response_len=16, seed=7))
    assert e.rollouts.num_rollouts == 24
    assert [(s.dp, s.cp, s.packing, s.distribution) for s in e.layouts] == [
        (1, 1, "static", "strided"), (2, 1, "first_fit", "strided"),
        (2, 1, "first_fit", "flops_kk"), (1, 2, "first_fit", "strided")]
    assert all(s.global_batch_size == 8 for s in e.layouts)
    assert e.modes == ("per_rollout_mean", "per_token", "naive_microbatch_mean",
                       "naive_rank_mean")
    runs = e.runs()
    assert len(runs) == 16
    assert [m for _, m in runs[:4]] == ["per_rollout_mean"] * 4  # mode after mode
    assert [s for s, _ in runs[4:8]] == list(e.layouts)  # the reference layout first
    assert e.train_kwargs["save_params_at"] == (3,)
    small = invariance.invariance_experiment(layouts=e.layouts[:2], modes=["per_token"],
                                             hidden_size=64)
    assert len(small.runs()) == 2 and small.train_kwargs["hidden_size"] == 64
    assert small.train_kwargs["num_layers"] == 2
    with pytest.raises(ValueError, match="layouts and modes"):
        invariance.invariance_experiment(modes=[])
