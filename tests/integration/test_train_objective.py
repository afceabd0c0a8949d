"""The engine's step-1 loss and metrics equal slime's formulas computed independently.

Not circular: the reference below is written in this file from the formulas of
docs/objective.md (slime's ``policy_loss_function`` / ``loss_function``), in float64, on
logits computed by ``transformers`` (each sample alone) for a tiny random Llama checkpoint;
the engine trains the same checkpoint through megatron-core in torchrun workers, packing the
samples into several micro-batches. Nothing here calls the engine's loss code.

Every option of the objective is on: asymmetric and dual clip, TIS against the rollout
log-probs used as the old policy, the entropy bonus, the KL loss (low_var_kl, unbiased), the
rollout temperature; one sample is fully masked (slime counts it as one token per_token).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from varbatch_kit import Rollouts, ScheduleConfig

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
transformers = pytest.importorskip("transformers")

from varbatch_kit.train import LossConfig, TrainConfig, run_many  # noqa: E402

VOCAB = 64
OPTIONS = dict(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0, use_kl_loss=True,
               kl_loss_coef=0.05, kl_loss_type="low_var_kl", use_unbiased_kl=True,
               entropy_coef=0.01, use_tis=True, tis_clip=1.5, tis_clip_low=0.5,
               use_rollout_logprobs=True, rollout_temperature=0.8)


def _checkpoint(out: Path) -> Path:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.3, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def _rollouts() -> Rollouts:
    """7 rollouts, 10 samples; sample 4 fully masked; rollout log-probs near the model's."""
    rng = np.random.default_rng(5)
    rid = np.repeat(np.arange(7), [2, 1, 2, 1, 2, 1, 1])
    n = rid.size
    prompt, resp = rng.integers(2, 6, n), rng.integers(3, 9, n)
    masks = [(rng.random(r) < 0.75).astype(int) for r in resp]
    for m in masks:
        m[-1] = 1
    masks[4][:] = 0
    extra = pd.DataFrame({
        "tokens": [rng.integers(0, VOCAB, p + r).tolist() for p, r in zip(prompt, resp)],
        "advantage": rng.normal(0, 1, n).round(3).tolist(),
        # the rollout engine's log-probs: about log(1/64), spread enough to clip and to
        # leave the TIS bounds on both sides
        "rollout_log_probs": [(-4.1 + rng.normal(0, 0.6, r)).tolist() for r in resp],
    })
    return Rollouts(prompt, resp, rid, masks, extra=extra)


def _reference(path: Path, r: Rollouts, mode: str) -> dict[str, float]:
    """slime's step values from the formulas, float64, transformers logits per sample."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    o = OPTIONS
    sums: dict[str, float] = {}
    masks = r.masks()
    rollout_tokens = {int(k): sum(float(masks[i].sum()) for i in np.flatnonzero(r.rollout_id == k))
                      for k in np.unique(r.rollout_id)}
    count = sum(max(float(m.sum()), 1.0) for m in masks)  # slime's clamp_min(., 1) per sample
    for i in range(len(r)):
        ids = torch.tensor(r.extra["tokens"][i])
        p = int(r.prompt_len[i])
        with torch.no_grad():
            logits = model(ids[None]).logits[0].double()[p - 1:-1] / o["rollout_temperature"]
        logp_all = torch.log_softmax(logits, -1)
        lp = logp_all.gather(-1, ids[p:, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        old = torch.tensor(r.extra["rollout_log_probs"][i], dtype=torch.float64)
        a = torch.full_like(lp, r.extra["advantage"][i])
        ppo_kl = old - lp
        ratio = torch.exp(-ppo_kl)
        pg = torch.maximum(-a * ratio,
                           -a * ratio.clamp(1 - o["eps_clip"], 1 + o["eps_clip_high"]))
        clipped = (-a * ratio.clamp(1 - o["eps_clip"], 1 + o["eps_clip_high"]) > -a * ratio)
        pg = torch.where(a < 0, torch.minimum(pg, -o["eps_clip_c"] * a), pg)
        # TIS: the log-prob pass's policy (step 1: the model itself) over the rollout engine's
        tis = torch.exp(lp - old)
        w = tis.clamp(o["tis_clip_low"], o["tis_clip"])
        pg = pg * w
        # low_var_kl to the reference (step 1: the model itself), weighted by new / old
        d = lp - lp
        kl = (torch.exp(lp - old) * (torch.exp(-d) - 1 + d)).clamp(-10, 10)
        terms = {
            "pg_loss": pg, "entropy_loss": entropy, "pg_clipfrac": clipped.double(),
            "ppo_kl": ppo_kl, "train_rollout_logprob_abs_diff": (lp - old).abs(), "kl_loss": kl,
            "ois": ratio, "tis": tis, "tis_clipfrac": (w != tis).double(),
            "tis_abs": (tis - 1).abs(), "nll": -lp, "advantage": a,
        }
        m = torch.as_tensor(masks[i], dtype=torch.float64)
        denom = rollout_tokens[int(r.rollout_id[i])] if mode == "per_rollout_mean" else 1.0
        for k, v in terms.items():
            sums[k] = sums.get(k, 0.0) + float((v * m).sum()) / max(denom, 1.0)
    z = float(len(rollout_tokens)) if mode == "per_rollout_mean" else count
    out = {k: v / z for k, v in sums.items()}
    out["loss"] = (out["pg_loss"] - o["entropy_coef"] * out["entropy_loss"]
                   + o["kl_loss_coef"] * out["kl_loss"])
    return out


def test_engine_step_1_equals_slimes_formulas_on_transformers_logits(tmp_path):
    path = _checkpoint(tmp_path / "tiny-llama")
    r = _rollouts()
    base = TrainConfig(loss=LossConfig(**OPTIONS)).with_(
        path=str(path), lr=1e-3, min_lr=1e-3, lr_decay_style="constant", max_steps=1,
        schedule=ScheduleConfig(dp=1, global_batch_size=7, max_tokens_per_gpu=24))
    modes = ("per_rollout_mean", "per_token")
    runs = run_many([base.with_(mode=m) for m in modes], r, out_dir=tmp_path / "runs",
                    progress=False)
    for mode, run in zip(modes, runs):
        got = run.steps.iloc[0]
        assert got["num_microbatches"][0] >= 3  # packed into several micro-batches
        want = _reference(path, r, mode)
        print(mode, {k: (round(float(got[k]), 6), round(v, 6)) for k, v in want.items()})
        assert run.meta["metrics"][:5] == ["loss", "pg_loss", "entropy_loss", "pg_clipfrac",
                                           "ppo_kl"]
        for key, value in want.items():
            assert math.isclose(float(got[key]), value, rel_tol=2e-5, abs_tol=2e-6), (
                mode, key, float(got[key]), value)
        # the options really act on this batch: clipping, TIS bounds on both sides
        assert 0 < want["pg_clipfrac"] < 1 and 0 < want["tis_clipfrac"] < 1
