"""Run folders as the training loop leaves them, for the tests of the Hugging Face export
(``Run.export_hf``, ``varbatch-kit export``): no training, weights derived from a checkpoint."""

from __future__ import annotations

import json

import torch


def perturbed(state: dict, seed: int) -> dict:
    """Every tensor moved (a stand-in for training steps): the export cannot be a copy."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=g)
            for k, v in state.items()}


def run_folder(root, source, *, steps=3, params_at=(3,), ckpt_at=(), layers=2, model=True):
    """A run folder as the training loop leaves it (meta.json, steps.jsonl, params_stepN.pt,
    checkpoints/step_N), with weights that differ per step; returns it and those weights."""
    from varbatch_kit.train.config.hf_checkpoint import read_hf_model
    from varbatch_kit.train.model.hf_import import megatron_state_dict
    from varbatch_kit.train.runs.checkpoint import save_checkpoint
    from varbatch_kit.train.runs.step_log import append_record

    out = root / "run00-export"
    out.mkdir(parents=True)
    meta = {"device": "cpu", "world_size": 1}
    if model:
        meta["model"] = {"path": None if source is None else str(source), "num_layers": layers}
    (out / "meta.json").write_text(json.dumps(meta))
    for s in range(1, steps + 1):
        append_record(out / "steps.jsonl", {"step": s, "loss": 1.0 / s})
    if source is None:
        return out, {}
    base = megatron_state_dict(read_hf_model(source), layers)
    states = {s: perturbed(base, s) for s in range(1, steps + 1)}
    for s in params_at:
        torch.save(states[s], out / f"params_step{s}.pt")
    for s in ckpt_at:
        save_checkpoint(out / "checkpoints", s, model=states[s], optimizer={}, state={"step": s},
                        fingerprint={}, keep_last=5)
    return out, states


def exported(out) -> dict:
    from varbatch_kit.train.config.hf_checkpoint import read_hf_model
    from varbatch_kit.train.model.hf_import import megatron_state_dict

    return megatron_state_dict(read_hf_model(out))


def equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
