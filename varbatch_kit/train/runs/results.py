"""A finished training run read back from its folder, and how two runs' parameters differ."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from varbatch_kit.train.config.train_config import TrainConfig

__all__ = ["Run", "grad_cosine", "load_run", "param_rel_diff", "param_sq_sums", "rel_diff_of"]


@dataclass
class Run:
    """One finished training run.

    Attributes
    ----------
    config:
        The :class:`TrainConfig`.
    steps:
        pandas table, one row per step (the JSON lines of ``steps.jsonl``):
        step, rollouts, samples, tokens, num_microbatches (per DP rank),
        loss and the other reported metrics, grad_norm (before clipping), lr,
        wall_s (per rank), micro_batch_timing, busy_s and straggler_s (per rank), ...
    out_dir:
        Folder with ``steps.jsonl``, ``meta.json`` and any saved parameters.
    meta:
        Device, world size, parameter count, whether CP was emulated, ...; and
        ``device_choice``: the launcher's decision (requested, device, local ranks,
        GPUs per node, reason: :class:`~varbatch_kit.train.parallel.devices.DeviceChoice`).
    launch_wall_s:
        Wall time of the torchrun launch this run was part of.
    """

    config: TrainConfig
    steps: object
    out_dir: Path
    meta: dict = field(default_factory=dict)
    launch_wall_s: float = float("nan")

    @property
    def jsonl_path(self) -> Path:
        return self.out_dir / "steps.jsonl"

    @property
    def micro_batches(self):
        """pandas table, one row per (step, rank, micro-batch) in training order: ``step, rank``
        (world rank), ``position``, ``num_samples``, ``sum_len``, ``sum_len_sq`` (of the
        samples' total lengths), ``fwd_s``, ``bwd_s``, ``time_s`` (their sum), from the
        steps' ``micro_batch_timing`` (see :mod:`varbatch_kit.train.step.microbatch_timer`); empty
        when
        the run recorded none."""
        import pandas as pd

        from varbatch_kit.analysis.cost_model import ROW_KEYS, micro_batch_rows

        records = self.steps.to_dict("records") if "micro_batch_timing" in self.steps else []
        return pd.DataFrame(micro_batch_rows(records), columns=list(ROW_KEYS))

    @property
    def losses(self) -> np.ndarray:
        return self.steps["loss"].to_numpy()

    def compared_in_worker(self, step: int) -> bool:
        """Whether the worker compared this run's parameters after ``step`` with its
        reference's file instead of saving them (``compare(..., keep_params=False)``): the
        step log then holds ``param_sq_diff`` and ``param_sq_ref``, ``||p - p_ref||^2`` and
        ``||p_ref||^2``."""
        if "param_sq_diff" not in self.steps:
            return False
        row = self.steps[self.steps["step"] == step]
        return len(row) == 1 and bool(np.isfinite(row["param_sq_diff"].iloc[0]))

    def params(self, step: int) -> dict:
        """Parameters (name -> CPU tensor) saved after ``step`` (see ``save_params_at``)."""
        return self._saved("params", "save_params_at", step)

    def grads(self, step: int) -> dict:
        """Gradients (name -> CPU tensor) of ``step``, reduced over the ranks, before clipping
        (see ``save_grads_at``)."""
        return self._saved("grads", "save_grads_at", step)

    def _saved(self, what: str, field: str, step: int) -> dict:
        import torch

        path = self.out_dir / f"{what}_step{step}.pt"
        if not path.is_file() and what == "params" and self.compared_in_worker(step):
            raise ValueError(
                f"run {self.config.name!r} kept no parameters of step {step}: it compared "
                "them with its reference's in its worker (compare(..., keep_params=False)); "
                "pass keep_params=True, or name this run in keep_params, to keep its files")
        if not path.is_file():
            raise ValueError(
                f"no {what} saved at step {step}; set RunConfig({field}=({step},)) "
                f"(saved: {sorted(p.name for p in self.out_dir.glob(f'{what}_step*.pt'))})"
            )
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)

    def export_hf(self, out_dir, step: int | None = None, *, dtype: str | None = None,
                  overwrite: bool = False) -> Path:
        """Write the weights after ``step`` (default: the final step) as a Hugging Face
        checkpoint that ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` loads:
        config.json (the trained depth), model.safetensors, the input's tokenizer files.

        The weights come from ``params_step{step}.pt`` (``RunConfig.save_params_at``) or the
        checkpoint of that step (``CheckpointConfig.save_every``); ValueError naming the
        option to set when neither was saved, and for the toy GPT (no checkpoint to export
        to). See :mod:`varbatch_kit.train.runs.run_export`. Returns ``out_dir``.
        """
        from varbatch_kit.train.runs.run_export import export_run

        return export_run(self.out_dir, out_dir, model=self.config.model, step=step,
                          dtype=dtype, overwrite=overwrite)

    def __repr__(self) -> str:
        n = len(self.steps)
        last = f", last loss {self.steps['loss'].iloc[-1]:.5g}" if n else ""
        return f"Run({self.config.name!r}, {n} steps{last}, out_dir={str(self.out_dir)!r})"


def load_run(cfg: TrainConfig, out: Path, wall: float) -> Run:
    import pandas as pd

    from varbatch_kit.train.runs.step_log import read_records

    lines = read_records(out / "steps.jsonl")  # a torn last line (older crash): dropped, warned
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").is_file() else {}
    return Run(cfg, pd.DataFrame(lines), out, meta, wall)


def grad_cosine(a: dict, b: dict) -> float:
    """The cosine of the angle between two gradients (all parameters flattened together)."""
    import torch

    if set(a) != set(b):
        raise ValueError("parameter sets differ")
    dot = sum(float(torch.sum(a[k].double() * b[k].double())) for k in b)
    na = sum(float(torch.sum(a[k].double() ** 2)) for k in a) ** 0.5
    nb = sum(float(torch.sum(b[k].double() ** 2)) for k in b) ** 0.5
    return dot / (na * nb) if na and nb else float("nan")


def param_sq_sums(a: dict, b: dict) -> tuple[float, float]:
    """``(||a - b||^2, ||b||^2)`` over all parameters (flattened together), float64, summed
    tensor by tensor in ``b``'s order: what :func:`param_rel_diff` divides (a worker that
    compares its parameters with its reference's file records the two, ``compare``'s
    ``keep_params``)."""
    import torch

    if set(a) != set(b):
        raise ValueError("parameter sets differ")
    # one temporary per tensor (the difference), none for the squares: 3x faster on the
    # float64 parameters of a 135M model than squaring into new tensors
    num = sum(float(torch.linalg.vector_norm(a[k].double() - b[k].double())) ** 2 for k in b)
    den = sum(float(torch.linalg.vector_norm(b[k].double())) ** 2 for k in b)
    return num, den


def rel_diff_of(num: float, den: float) -> float:
    """``sqrt(num / den)``; with ``den`` 0: 1.0 when ``num`` > 0, else 0.0."""
    return (num / den) ** 0.5 if den else float(num > 0)


def param_rel_diff(a: dict, b: dict) -> float:
    """``||a - b|| / ||b||`` over all parameters (flattened together)."""
    return rel_diff_of(*param_sq_sums(a, b))
