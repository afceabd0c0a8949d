"""Several configurations trained on the same rollouts and seed, as one table against a
reference: the report differences the layout-invariance checks read.

:func:`compare` trains through :func:`~varbatch_kit.train.runs.launch.run_many` (one torchrun
launch per world size) and, per (configuration, step), puts the step report beside the
relative differences of loss, grad norm, parameters and gradients to the reference run
(:func:`~varbatch_kit.train.runs.results.param_rel_diff`,
:func:`~varbatch_kit.train.runs.results.grad_cosine`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.train.config.train_config import TrainConfig
from varbatch_kit.train.runs.launch import run_many
from varbatch_kit.train.runs.results import grad_cosine, param_rel_diff

__all__ = ["compare"]


def compare(configs: Sequence[TrainConfig], rollouts: Rollouts, *, reference: int | None = None,
            out_dir=None, progress: bool = True, runs: list | None = None):
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
    """
    import pandas as pd

    results = run_many(configs, rollouts, out_dir=out_dir, progress=progress)
    if runs is not None:
        runs.extend(results)
    first_of_mode: dict[str, int] = {}
    for k, c in enumerate(configs):
        first_of_mode.setdefault(c.mode, k)
    frames, ref_params, ref_grads = [], {}, {}
    for k, r in enumerate(results):
        ref_k = first_of_mode[r.config.mode] if reference is None else reference
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
            if s in r.config.run.save_params_at and s in ref.config.run.save_params_at:
                if (ref_k, s) not in ref_params:
                    ref_params[(ref_k, s)] = ref.params(s)
                diffs.append(param_rel_diff(r.params(s), ref_params[(ref_k, s)]))
            else:
                diffs.append(float("nan"))
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
