"""A run folder's trained weights, and their export as a Hugging Face checkpoint.

A run folder (``out_dir/runNN-<label>``, :mod:`varbatch_kit.train.runs.launch`) holds the
weights rank 0 saved: ``params_stepN.pt`` after the steps of
``RunConfig.save_params_at`` and full checkpoints ``checkpoints/step_NNNNNN/model.pt``
every ``CheckpointConfig.save_every`` steps (:mod:`varbatch_kit.train.runs.checkpoint`).
Both are full ``GPTModel.named_parameters()`` state dicts (the engine keeps every
parameter whole on every rank). :func:`saved_weights` reads those of one step (default:
the run's final step, from ``steps.jsonl``); :func:`export_run` writes them with
:func:`varbatch_kit.train.model.hf_export.export_hf`. The model is the run's
``TrainConfig.model`` (:meth:`~varbatch_kit.train.runs.results.Run.export_hf`) or, for a folder
alone (``varbatch-kit export RUN_DIR OUT_DIR``), the one its ``meta.json`` records
(``"model": {"path", "num_layers"}``, written by the training loop).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["export_run", "find_run_dir", "recorded_model", "saved_weights"]


def find_run_dir(path: str | os.PathLike) -> Path:
    """``path`` when it is a run folder (it holds ``meta.json``), or the one run folder
    ``runNN-*`` inside it (the ``out_dir`` of a single run); ValueError otherwise."""
    p = Path(path).expanduser()
    if (p / "meta.json").is_file():
        return p
    if not p.is_dir():
        raise ValueError(f"RUN_DIR={str(p)!r} does not exist; give a run's output folder "
                         "(runNN-<label>, with meta.json and steps.jsonl)")
    runs = sorted(q for q in p.glob("run[0-9][0-9]-*") if (q / "meta.json").is_file())
    if len(runs) == 1:
        return runs[0]
    if runs:
        raise ValueError(f"RUN_DIR={str(p)!r} holds several runs: "
                         f"{', '.join(q.name for q in runs)}; give one of them")
    raise ValueError(f"RUN_DIR={str(p)!r} holds no run (no meta.json, no runNN-*/meta.json); "
                     "give a run's output folder")


def recorded_model(run_dir: str | os.PathLike):
    """The :class:`~varbatch_kit.train.config.model_config.ModelConfig` the run's ``meta.json``
    records."""
    from varbatch_kit.train.config.model_config import ModelConfig

    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "meta.json").read_text())
    model = meta.get("model")
    if not isinstance(model, dict):
        raise ValueError(
            f"{run_dir / 'meta.json'} records no model (a run of an older varbatch_kit); "
            "export it from Python: Run.export_hf(out_dir), whose TrainConfig names the model")
    return ModelConfig(path=model.get("path"), num_layers=model.get("num_layers"))


#: a key of a sharded checkpoint's model.pt (train/runs/run_state.py)
_SHARD = re.compile(r"^stage\d+/")


def _saved_steps(run_dir: Path) -> tuple[dict[int, Path], dict[int, Path]]:
    """``(params files, complete checkpoint folders)`` by step."""
    from varbatch_kit.train.runs.checkpoint import checkpoint_dirs

    params = {}
    for p in run_dir.glob("params_step*.pt"):
        number = p.name[len("params_step"):-len(".pt")]
        if number.isdigit():
            params[int(number)] = p
    return params, dict(checkpoint_dirs(run_dir / "checkpoints"))


def _final_step(run_dir: Path) -> int:
    from varbatch_kit.train.runs.step_log import read_records

    steps = [int(r["step"]) for r in read_records(run_dir / "steps.jsonl", warn=False)
             if "step" in r]
    if not steps:
        raise ValueError(f"{run_dir} holds no trained step (steps.jsonl is missing or empty)")
    return max(steps)


def saved_weights(run_dir: str | os.PathLike, step: int | None = None) -> tuple[int, dict]:
    """``(step, state dict)``: the weights after ``step`` (default: the run's final step),
    from ``params_step{step}.pt`` or the checkpoint of that step.

    ValueError when neither was saved, naming the option that saves them
    (``RunConfig.save_params_at``, ``CheckpointConfig.save_every``) and the steps that
    were saved.
    """
    import torch

    run_dir = Path(run_dir)
    final = _final_step(run_dir)
    if step is None:
        step = final
    elif isinstance(step, bool) or not isinstance(step, int) or not 1 <= step <= final:
        raise ValueError(f"step={step!r}: the run trained steps 1..{final}; give one of them "
                         "(or None: the final step)")
    params, ckpts = _saved_steps(run_dir)
    if step in params:  # rank 0 saved views of its parameter buffer: one tensor each here
        state = torch.load(params[step], map_location="cpu", weights_only=True)
        return step, {k: v.clone() for k, v in state.items()}
    if step in ckpts:
        state = torch.load(ckpts[step] / "model.pt", map_location="cpu", weights_only=True)
        if any(_SHARD.match(name) for name in state):
            raise ValueError(
                f"the checkpoint of step {step} in {run_dir} holds pipeline-stage / tensor-"
                "parallel shards (model.pt keys stage{k}[/tp{t}]/NAME), for resuming; the "
                "export reads full tensors: train with "
                f"RunConfig(save_params_at=({step},)) (--run.save-params-at {step}), which "
                "saves them under every layout")
        return step, state
    raise ValueError(
        f"no weights saved after step {step} in {run_dir}: train with "
        f"RunConfig(save_params_at=({step},)) (--run.save-params-at {step}) or "
        f"CheckpointConfig(save_every=N) with N dividing {step} (--checkpoint.save-every N); "
        f"saved: params at steps {sorted(params)}, checkpoints at steps {sorted(ckpts)}")


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, model: Any = None,
               step: int | None = None, dtype: str | None = None,
               overwrite: bool = False) -> Path:
    """Export the weights of ``run_dir`` after ``step`` (default: the final step) as a Hugging
    Face checkpoint in ``out_dir`` (:func:`~varbatch_kit.train.model.hf_export.export_hf`).

    ``model``: the run's :class:`~varbatch_kit.train.config.model_config.ModelConfig` (default: the
    one
    its ``meta.json`` records). The toy GPT cannot be exported (ValueError).
    """
    from varbatch_kit.train.config.model_config import resolve_model
    from varbatch_kit.train.model.hf_export import export_hf, source_spec

    run_dir = Path(run_dir)
    resolved = resolve_model(recorded_model(run_dir) if model is None else model)
    source_spec(resolved)  # the toy GPT: its message, before any weights are looked for
    _, state = saved_weights(run_dir, step)
    return export_hf(state, resolved, out_dir, dtype=dtype, overwrite=overwrite)
