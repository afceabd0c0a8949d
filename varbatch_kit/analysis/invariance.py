"""The metric-report invariance check of notebook 06 and the demo, as plain values.

Does a report mode give the same numbers whatever the layout (DP, CP,
micro-batch packing) the same rollouts are trained under?

- :func:`invariance_experiment`: the configuration matrix (layouts x report
  modes, the shared training fields) as an :class:`InvarianceExperiment`;
- :func:`worst_rel_diff`: per report mode, the largest relative difference
  of :func:`varbatch_kit.train.compare`'s table to its reference run;
- :func:`invariance_verdict`: the verdict with its two thresholds, an
  :class:`InvarianceVerdict`.

Pure: tables in, small result objects out; the training itself is
``varbatch_kit.train``'s (nothing here imports torch or the engine).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.rollouts import Rollouts

__all__ = [
    "NAIVE_LABEL",
    "REL_DIFF_COLUMNS",
    "SOUND_LABEL",
    "InvarianceExperiment",
    "InvarianceVerdict",
    "invariance_experiment",
    "invariance_verdict",
    "worst_rel_diff",
]

#: the relative differences :func:`train.compare <varbatch_kit.train.compare>` reports
REL_DIFF_COLUMNS = ("loss_rel_diff", "grad_norm_rel_diff", "param_rel_diff")


@dataclass(frozen=True)
class InvarianceExperiment:
    """A configuration matrix for the report-invariance check, as plain values.

    Every layout is trained once per report mode on the same rollouts
    (``runs()`` lists the ``(layout, mode)`` pairs, mode after mode, the
    reference layout first in each mode). ``train_kwargs`` are the
    :class:`varbatch_kit.train.TrainConfig` fields shared by every run, by name
    (``TrainConfig.with_`` routes each to its sub-config), so::

        configs = [TrainConfig().with_(schedule=s, mode=m, **experiment.train_kwargs)
                   for s, m in experiment.runs()]
        table = train.compare(configs, experiment.rollouts)
    """

    rollouts: Rollouts
    layouts: tuple[ScheduleConfig, ...]
    modes: tuple[str, ...]
    train_kwargs: Mapping[str, Any]

    def runs(self) -> list[tuple[ScheduleConfig, str]]:
        """``(layout, mode)`` for every run, mode after mode."""
        return [(s, m) for m in self.modes for s in self.layouts]


def invariance_experiment(
        layouts: Sequence[ScheduleConfig] | None = None, modes: Sequence[str] | None = None,
        rollouts: Rollouts | None = None, **train_kwargs: Any) -> InvarianceExperiment:
    """The matrix notebook 06 and the demo train: 4 layouts x 4 report modes, 3 steps.

    Defaults: 24 synthetic rollouts of 1-4 samples (8 rollouts per step: 3
    steps of different sample counts); the layouts ``dp=1`` with one sample
    per micro-batch (the reference), ``dp=2`` first-fit dealt round-robin,
    ``dp=2`` first-fit dealt FLOPs-balanced, and ``cp=2``; the sound modes
    ``per_rollout_mean``, ``per_token`` and the naive ``naive_microbatch_mean``,
    ``naive_rank_mean``; a 2-layer, 32-wide GPT at a constant learning rate,
    parameters saved after step 3. ``train_kwargs`` override the model and
    optimiser fields (TrainConfig field names: ``path`` for a checkpoint, ``lr``, ...).
    """
    if rollouts is None:
        rollouts = Rollouts.synthetic(24, samples_per_rollout=(1, 4), prompt_len=(3, 8),
                                      response_len=10, response_sigma=0.5, max_response_len=16,
                                      seed=7)
    if layouts is None:
        layouts = (
            ScheduleConfig(dp=1, global_batch_size=8, micro_batch_size=1),
            ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=48),
            ScheduleConfig(dp=2, global_batch_size=8, max_tokens_per_gpu=48,
                           distribution="flops_kk"),
            ScheduleConfig(dp=1, cp=2, global_batch_size=8, max_tokens_per_gpu=32),
        )
    if modes is None:
        modes = ("per_rollout_mean", "per_token", "naive_microbatch_mean", "naive_rank_mean")
    kwargs: dict[str, Any] = dict(
        num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64, lr=1e-3,
        min_lr=1e-3, lr_decay_style="constant", n_samples_per_prompt=2, save_params_at=(3,))
    kwargs.update(train_kwargs)
    if not layouts or not modes:
        raise ValueError(f"an invariance experiment needs layouts and modes; got "
                         f"{len(layouts)} layouts and {len(modes)} modes")
    return InvarianceExperiment(rollouts, tuple(layouts), tuple(modes), kwargs)


def worst_rel_diff(table, modes: Sequence[str] | None = None):
    """Per report mode, the largest relative difference to its reference run.

    ``table`` is :func:`varbatch_kit.train.compare`'s (columns ``config,
    reference, mode`` and :data:`REL_DIFF_COLUMNS`); the reference runs
    themselves are left out. One row per mode (``modes``, default in order
    of appearance), one column per relative difference (NaN where nothing
    was compared, e.g. parameters that were not saved).
    """
    need = [c for c in ("config", "reference", "mode", *REL_DIFF_COLUMNS)
            if c not in table.columns]
    if need:
        raise ValueError(f"the comparison table lacks column(s) {need}; pass the table "
                         "varbatch_kit.train.compare returns")
    order = list(dict.fromkeys(table["mode"])) if modes is None else list(modes)
    others = table[table["config"] != table["reference"]]
    worst = others.groupby("mode", sort=False)[list(REL_DIFF_COLUMNS)].max()
    worst = worst.reindex(order)
    worst.index.name = "mode"
    return worst


@dataclass(frozen=True)
class InvarianceVerdict:
    """What :func:`invariance_verdict` decided.

    ``worst``: :func:`worst_rel_diff`'s table. ``labels``: ``mode -> verdict``
    in words. ``sound_invariant``: every layout-invariant mode stayed below
    ``sound_tol``; ``naive_drift``: every naive mode moved above
    ``drift_min``. ``ok`` is both.
    """

    worst: Any
    labels: dict[str, str]
    sound_modes: tuple[str, ...]
    naive_modes: tuple[str, ...]
    sound_invariant: bool
    naive_drift: bool
    sound_tol: float
    drift_min: float

    @property
    def ok(self) -> bool:
        return self.sound_invariant and self.naive_drift

    def lines(self) -> list[str]:
        """One line per mode, then the overall verdict."""
        out = [f"{mode:22s} {label}" for mode, label in self.labels.items()]
        out.append(f"verdict: sound modes layout-invariant: {self.sound_invariant}; "
                   f"naive modes drift: {self.naive_drift}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


SOUND_LABEL = ("identical across layouts", "MOVES WITH THE LAYOUT")
NAIVE_LABEL = ("drifts with the layout, as expected", "did not drift here")


def invariance_verdict(table, *, sound_tol: float = 1e-4, drift_min: float = 1e-3,
                       sound_modes: Sequence[str] | None = None,
                       modes: Sequence[str] | None = None) -> InvarianceVerdict:
    """Do the sound report modes stay put across layouts, and do the naive ones move?

    A mode's score is its largest relative difference to its reference run
    (loss, gradient norm or parameters, any step; :func:`worst_rel_diff`).
    A layout-invariant mode passes when its score is below ``sound_tol``
    (float32 rounding stays far below 1e-4); a naive mode is judged to drift
    when its score is above ``drift_min`` (real drift is of order 1e-2 to 1).

    Parameters
    ----------
    table:
        :func:`varbatch_kit.train.compare`'s table.
    sound_tol, drift_min:
        The two thresholds (``sound_tol <= drift_min``).
    sound_modes:
        Modes that must be layout-invariant (default
        :data:`varbatch_kit.report.LAYOUT_INVARIANT_MODES`); every other
        mode of the table is judged as naive.
    modes:
        Modes to judge, in this order (default: the table's, in order of appearance).
    """
    if not (0 < sound_tol <= drift_min):
        raise ValueError(f"need 0 < sound_tol <= drift_min; got sound_tol={sound_tol!r}, "
                         f"drift_min={drift_min!r}")
    if sound_modes is None:
        from varbatch_kit.report import LAYOUT_INVARIANT_MODES as sound_modes
    sound_set = set(sound_modes)
    worst = worst_rel_diff(table, modes)
    labels: dict[str, str] = {}
    sound, naive = [], []
    sound_ok, drift_ok = True, True
    for mode, row in worst.iterrows():
        top = float(row.max())  # NaN-skipping; NaN when nothing was compared
        if mode in sound_set:
            passed = bool(top < sound_tol)
            sound.append(mode)
            sound_ok &= passed
            labels[mode] = SOUND_LABEL[0] if passed else SOUND_LABEL[1]
        else:
            drifted = bool(top > drift_min)
            naive.append(mode)
            drift_ok &= drifted
            labels[mode] = NAIVE_LABEL[0] if drifted else NAIVE_LABEL[1]
    return InvarianceVerdict(worst, labels, tuple(sound), tuple(naive), bool(sound_ok),
                             bool(drift_ok), float(sound_tol), float(drift_min))
