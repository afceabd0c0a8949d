"""bf16 training on CPU: megatron's bf16 with fp32 main params and grads, against fp32.

Two launches (world 1 and 2) train the toy GPT for 4 steps in fp32 and bf16,
and bf16 at dp 2 and cp 2, in ``per_rollout_mean`` and ``per_token``:

- every bf16 step loss stays within 1e-2 relative of fp32's (the issue's bound);
- the bf16 reports stay layout-invariant within :data:`BF16_LAYOUT_RTOL`
  (measured: see the printout; bf16 rounds each matmul differently when the
  packing changes, so the 1e-5 of fp32 does not hold and is not asked);
- the parameters really are bfloat16 and the step lines say ``precision``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from _factories import TINY_GPT

from varbatch_kit import Rollouts
from varbatch_kit.train import TrainConfig, compare

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

#: bf16 layout invariance: reports of dp 2 / cp 2 against dp 1, all in bf16 (relative)
BF16_LAYOUT_RTOL = 5e-3  # measured at most 1.8e-3 (4 steps, toy GPT, CPU)
METRICS = ("loss", "pg_loss", "entropy_loss", "nll", "grad_norm")


def _rollouts() -> Rollouts:
    rng = np.random.default_rng(3)
    counts = [2, 1, 3, 2, 1, 1, 2, 2, 3, 1, 2, 2, 1, 3, 2, 1]
    rid = np.repeat(np.arange(len(counts)), counts)
    masks = [(rng.random(r) < 0.9).astype(int) for r in rng.integers(4, 17, rid.size)]
    for m in masks:
        m[0] = 1
    return Rollouts(rng.integers(3, 9, rid.size), [len(m) for m in masks], rid, masks)


def test_bf16_tracks_fp32_and_stays_layout_invariant(tmp_path):
    base = TrainConfig().with_(**TINY_GPT, lr=1e-3, min_lr=1e-3, lr_decay_style="constant",
                               n_samples_per_prompt=2, global_batch_size=4,
                               max_tokens_per_gpu=48, packing="first_fit", entropy_coef=0.01,
                               save_params_at=(4,))
    configs = []
    for mode in ("per_rollout_mean", "per_token"):
        m = base.with_(mode=mode)
        configs += [m.with_(label=f"fp32 dp1 {mode}"),
                    m.with_(precision="bf16", label=f"bf16 dp1 {mode}"),
                    m.with_(precision="bf16", dp=2, label=f"bf16 dp2 {mode}"),
                    m.with_(precision="bf16", cp=2, label=f"bf16 cp2 {mode}")]
    runs: list = []
    table = compare(configs, _rollouts(), out_dir=tmp_path, progress=False, runs=runs)
    by = {label: g.set_index("step") for label, g in table.groupby("label")}
    rows = []
    for mode in ("per_rollout_mean", "per_token"):
        fp32, bf16 = by[f"fp32 dp1 {mode}"], by[f"bf16 dp1 {mode}"]
        assert len(fp32) == 4
        loss_rel = ((bf16["loss"] - fp32["loss"]).abs() / fp32["loss"].abs()).max()
        rows.append({"mode": mode, "what": "bf16 vs fp32 loss", "max_rel": loss_rel})
        assert loss_rel < 1e-2, (bf16["loss"], fp32["loss"])
        for other in ("dp2", "cp2"):
            got = by[f"bf16 {other} {mode}"]
            worst = max(((got[k] - bf16[k]).abs() / bf16[k].abs().clip(lower=1e-3)).max()
                        for k in METRICS)
            rows.append({"mode": mode, "what": f"bf16 {other} vs bf16 dp1", "max_rel": worst})
            assert worst < BF16_LAYOUT_RTOL, (other, mode)
    with pd.option_context("display.width", 200):
        print(pd.DataFrame(rows).to_string())
        print(table[["label", "step", "loss", "grad_norm", "nll"]].to_string())
    assert set(table["precision"]) == {"fp32", "bf16"}
    params = runs[1].params(4)
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
