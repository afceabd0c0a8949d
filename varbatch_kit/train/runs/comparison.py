"""Several configurations trained on the same rollouts and seed, as one table against a
reference: the report differences the layout-invariance checks read.

:func:`compare` trains through :func:`~varbatch_kit.train.runs.launch.run_many` (one torchrun
launch per world size) and, per (configuration, step), puts the step report beside the
relative differences of loss, grad norm, parameters and gradients to the reference run
(:func:`~varbatch_kit.train.runs.results.param_rel_diff`,
:func:`~varbatch_kit.train.runs.results.grad_cosine`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.train.config.train_config import TrainConfig
from varbatch_kit.train.runs.launch import run_many
from varbatch_kit.train.runs.results import grad_cosine, param_rel_diff, rel_diff_of

__all__ = ["compare"]


def compare(configs: Sequence[TrainConfig], rollouts: Rollouts, *, reference: int | None = None,
            out_dir=None, progress: bool = True, runs: list | None = None,
            keep_params: bool | Collection[str] = True):
    """Run ``configs`` on the same rollouts and seed; one table, one row per (config, step).

    Columns: ``config`` (index into ``configs``), ``reference`` (the index it is
    compared with), the config summary (label, dp, cp, packing, distribution,
    mode, ...), the step report (step, rollouts, samples, tokens,
    num_microbatches, loss, metrics, grad_norm, lr, step_time_s, ...), and,
    against the reference at the same step: ``loss_rel_diff``,
    ``grad_norm_rel_diff`` and ``param_rel_diff`` (``||p - p_ref|| / ||p_ref||``
    where both saved parameters at that step, see ``RunConfig.save_params_at``; else NaN);
    ``grad_rel_diff`` (``||g - g_ref|| / ||g_ref||``) and ``grad_cosine`` where both saved
    gradients at that step (``RunConfig.save_grads_at``; else NaN).

    ``reference``: an index into ``configs``; ``None`` (default) compares each
    configuration with the first one of the same report mode. Pass a list as
    ``runs`` to receive the :class:`Run` objects too.

    ``keep_params``: ``True`` (default): every run writes its parameter files (SmolLM2
    truncated to 4 layers, float64: 336 MB a saved step) and they are compared here. ``False``: only
    the references write theirs; every other run compares its parameters with its
    reference's file in its own worker and keeps none (``Run.params`` then says so); the
    same ``param_rel_diff``, the same arithmetic. A collection of run names
    (``TrainConfig.name``, e.g. the labels): those runs keep their files too. A run whose
    reference has not saved that step yet (its launch comes later: ``compare`` launches the
    world sizes in the order they first appear) writes its file as before.
    """
    import pandas as pd

    configs = list(configs)
    refs = _references(configs, reference)
    results = run_many(configs, rollouts, out_dir=out_dir, progress=progress,
                       params_against=_params_against(configs, refs, keep_params))
    if runs is not None:
        runs.extend(results)
    frames, ref_params, ref_grads = [], {}, {}
    for k, r in enumerate(results):
        ref_k = refs[k]
        ref = results[ref_k]
        ref_steps = ref.steps.set_index("step")
        df = r.steps.copy()
        for key, value in reversed(list(r.config.summary().items())):
            if key in df.columns:
                df = df.drop(columns=key)
            df.insert(0, key, value)
        df.insert(0, "reference", ref_k)
        df.insert(0, "config", k)
        ref_loss = ref_steps["loss"].reindex(df["step"]).to_numpy()
        ref_gn = ref_steps["grad_norm"].reindex(df["step"]).to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            df["loss_rel_diff"] = np.abs(df["loss"].to_numpy() - ref_loss) / np.abs(ref_loss)
            df["grad_norm_rel_diff"] = np.abs(df["grad_norm"].to_numpy() - ref_gn) / np.abs(ref_gn)
        diffs = []
        for s in df["step"]:
            if s in r.config.run.save_params_at and r.compared_in_worker(s):
                row = r.steps[r.steps["step"] == s].iloc[0]
                diffs.append(rel_diff_of(float(row["param_sq_diff"]), float(row["param_sq_ref"])))
            elif s in r.config.run.save_params_at and s in ref.config.run.save_params_at:
                if (ref_k, s) not in ref_params:
                    ref_params[(ref_k, s)] = ref.params(s)
                diffs.append(param_rel_diff(r.params(s), ref_params[(ref_k, s)]))
            else:
                diffs.append(float("nan"))
        df = df.drop(columns=[c for c in ("param_sq_diff", "param_sq_ref") if c in df])
        df["param_rel_diff"] = diffs
        grad_diffs, cosines = [], []
        for s in df["step"]:
            if s in r.config.run.save_grads_at and s in ref.config.run.save_grads_at:
                if (ref_k, s) not in ref_grads:
                    ref_grads[(ref_k, s)] = ref.grads(s)
                mine = r.grads(s)
                grad_diffs.append(param_rel_diff(mine, ref_grads[(ref_k, s)]))
                cosines.append(grad_cosine(mine, ref_grads[(ref_k, s)]))
            else:
                grad_diffs.append(float("nan"))
                cosines.append(float("nan"))
        df["grad_rel_diff"], df["grad_cosine"] = grad_diffs, cosines
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def _references(configs: list, reference: int | None) -> list[int]:
    """Per configuration, the index of the run it is compared with: ``reference``, or the
    first configuration of its report mode."""
    if reference is not None and not 0 <= reference < len(configs):
        raise ValueError(f"reference={reference}: give an index into the {len(configs)} "
                         "configurations")
    first_of_mode: dict[str, int] = {}
    for k, c in enumerate(configs):
        first_of_mode.setdefault(c.mode, k)
    return [first_of_mode[c.mode] if reference is None else reference for c in configs]


def _params_against(configs: list, refs: list[int],
                    keep_params: bool | Collection[str]) -> list[int | None]:
    """Per configuration, the index whose parameter files it is compared with in its worker
    (``keep_params``), or None: it writes its own (a reference, or a run kept)."""
    names = [c.name for c in configs]
    if isinstance(keep_params, bool):
        kept = set(names) if keep_params else set()
    elif isinstance(keep_params, str) or not isinstance(keep_params, Collection):
        raise ValueError(f"keep_params={keep_params!r}: give True, False or a collection of "
                         "run names (TrainConfig.name) that keep their parameter files")
    else:
        kept = set(keep_params)
        unknown = sorted(kept - set(names))
        if unknown:
            raise ValueError(f"keep_params names runs that are not compared: {unknown}; the "
                             f"runs are {names}")
    return [None if ref_k == k or c.name in kept else ref_k
            for k, (c, ref_k) in enumerate(zip(configs, refs))]
