"""A mixture-of-experts checkpoint (a tiny random Qwen3-MoE made by transformers) in the engine:
megatron-core's router and experts, trained in torchrun workers under data parallelism.

The loader and the export are checked against transformers' logits family by family
(tests/integration/test_train_hf.py, tests/unit/train/model/test_hf_export.py); here the
training itself, with the router's load-balancing loss and z-loss trained (per sample,
train/step/router_losses.py): the same steps at dp 1, at dp 1 under a smaller token cap and
at dp 2 (three packings of the same samples) give the same reports (the router losses
included), gradient norms and parameters in float64 under both sound modes; the mean of
micro-batch means, which depends on the packing, drifts, and so do megatron's per-row router
losses when injected (FaultConfig.moe_aux_per_row): the test can fail. The step log's expert
load (tokens per expert and layer, summed over the ranks) is the same under every layout.
One matrix trains every layout the engine builds for a mixture of experts (dp, ep, cp
all-gather / emulated / dynamic, pp, tp with sequence parallelism, and their combinations)
to dp 1's numbers; expert parallelism with dynamic CP, tp without sequence parallelism and
checkpoints of an expert-parallel run are refused before any worker starts.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from _factories import masked_rollouts
from _fake_hf import tiny_hf_checkpoint

from varbatch_kit import Rollouts
from varbatch_kit.train import TrainConfig, compare, run
from varbatch_kit.train.config.sub_configs import FaultConfig
from varbatch_kit.train.runs.results import param_rel_diff
from varbatch_kit.train.step.train_step import report_keys

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

TOL = 1e-9  # float64, relative


def rollouts() -> Rollouts:
    """Two steps of 6 rollouts of 1-2 samples; responses of 5-30 tokens."""
    return masked_rollouts([1, 2, 1, 2, 1, 1] * 2, seed=7)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return tiny_hf_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe")


#: the router's losses, weighted well above slime's usual 1e-3 so that they move the update
ROUTER = dict(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
#: the matrix: name -> what differs from dp 1 (the tiny model has 3 layers: pp 3)
LAYOUTS = {
    "dp1": {},
    "dp1 cap 24": dict(max_tokens_per_gpu=24),  # the same samples re-packed
    "dp2": dict(dp=2),
    "dp2 ep2": dict(dp=2, ep=2),  # the experts over 2 ranks, megatron's all-to-all
    "dp4 ep2": dict(dp=4, ep=2),  # two expert-parallel groups (each expert twice)
    "cp2 allgather": dict(cp=2),
    "cp2 emulated": dict(cp=2, cp_impl="emulated"),
    "dp2 cp2 dynamic": dict(dp=2, cp=2, cp_mode="dynamic"),
    "dp2 cp2 ep4": dict(dp=2, cp=2, ep=4),  # one expert per rank of the dp x cp pool
    "pp3": dict(pp=3),
    "pp3 cp2": dict(pp=3, cp=2),
    "tp2": dict(tp=2),  # sequence parallelism on (tp's default; megatron's MoE needs it)
    "tp2 cp2": dict(tp=2, cp=2),
    "tp2 pp3": dict(tp=2, pp=3),
    "dp2 pp3 ep2": dict(dp=2, pp=3, ep=2),  # each stage's experts over its 2 ranks
    "tp2 dp2 ep2": dict(tp=2, dp=2, ep=2),  # tokens all-gathered over tp x ep (uneven)
}
SOUND = ("per_rollout_mean", "per_token")
FP32_TOL = 1e-5  # fp32 against fp32 dp 1 (fp32 rounding: ~3e-7 measured)


def _rel(a: pd.Series, b: pd.Series) -> float:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def test_the_moe_layout_matrix(moe_checkpoint, tmp_path):
    """Every layout the engine runs a mixture of experts under, both sound modes, float64:
    every report metric (the router losses included), the grad norm and the parameters
    within TOL of dp 1, and the expert load the same. It can fail: the naive mode drifts,
    megatron's per-row router losses (injected) drift with the packing, the router losses
    move the update; one fp32 row within FP32_TOL; exports load in transformers with dp 1's
    logits."""
    import torch
    from transformers import AutoModelForCausalLM

    base = TrainConfig().with_(path=str(moe_checkpoint), lr=1e-3, min_lr=1e-3,
                               lr_decay_style="constant", n_samples_per_prompt=3,
                               global_batch_size=6, max_tokens_per_gpu=48,
                               packing="first_fit", precision="fp64", entropy_coef=0.01,
                               save_params_at=(1, 2), max_steps=2, **ROUTER)
    configs = [base.with_(mode=mode, label=f"{name} {mode}", **layout)
               for mode in SOUND for name, layout in LAYOUTS.items()]
    configs += [base.with_(mode="naive_microbatch_mean", label=f"{name} naive", **LAYOUTS[name])
                for name in ("dp1", "dp2")]
    # the injected bug: megatron's per-row router losses, at the reference cap and re-packed
    configs += [base.with_(mode="per_rollout_mean", label=f"bug: per-row aux, {name}",
                           faults=FaultConfig(moe_aux_per_row=True), **LAYOUTS[name])
                for name in ("dp1", "dp1 cap 24")]
    configs.append(base.with_(mode="per_rollout_mean", label="dp1 no router losses",
                              moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0))
    configs += [base.with_(precision="fp32", label=f"{name} fp32", **LAYOUTS[name])
                for name in ("dp1", "dp2 ep2")]
    runs: list = []
    table = compare(configs, rollouts(), out_dir=tmp_path, progress=False, runs=runs)
    runs = {r.config.name: r for r in runs}
    cols = ["label", "step", "num_microbatches", "loss", "moe_aux_loss", "moe_z_loss",
            "grad_norm", "expert_parallel_load_max_over_mean", "param_rel_diff"]
    with pd.option_context("display.width", 250, "display.max_rows", 200):
        print(table[cols].to_string())
    rows = {label: t.sort_values("step") for label, t in table.groupby("label")}
    keys = [*report_keys(base.loss, False, moe=True), "grad_norm"]

    def worst(label: str, ref: str) -> dict[str, float]:
        a, b = rows[label], rows[ref]
        d = {k: _rel(a[k], b[k]) for k in keys}
        d["params"] = max(param_rel_diff(runs[label].params(s), runs[ref].params(s))
                          for s in (1, 2))
        return d

    # the layouts pack differently (so the test can see a packing leak)
    packs = {tuple(map(tuple, rows[f"{name} per_token"]["num_microbatches"]))
             for name in LAYOUTS}
    assert len(packs) >= 5, packs
    summary = []
    for mode in SOUND:
        for name in LAYOUTS:
            label = f"{name} {mode}"
            d = worst(label, f"dp1 {mode}")
            summary.append((mode, name, max(d.values())))
            assert max(d.values()) <= TOL, (label, d)
            # every expert's tokens, counted once wherever they were routed
            assert (list(rows[label]["expert_tokens"])
                    == list(rows[f"dp1 {mode}"]["expert_tokens"])), label
            assert (rows[label]["expert_parallel_load_max_over_mean"] >= 1).all()
        assert (rows[f"dp1 {mode}"]["moe_aux_loss"] > 0.5).all()  # E sum f P >= 1 if even
    print(pd.DataFrame(summary, columns=["mode", "layout", "worst"]).to_string())
    # the naive mode drifts where the packing changes
    assert _rel(rows["dp2 naive"]["grad_norm"], rows["dp1 naive"]["grad_norm"]) > 1e3 * TOL
    # megatron's per-row router losses move with the packing: in the report and the update
    d = worst("bug: per-row aux, dp1 cap 24", "bug: per-row aux, dp1")
    print("per-row router losses, re-packed:", d)
    assert d["moe_aux_loss"] > 1e3 * TOL and d["params"] > 1e3 * TOL, d
    # the router losses are trained: without them the update differs, the first report not
    off = worst("dp1 no router losses", "dp1 per_rollout_mean")
    assert off["params"] > 1e3 * TOL and off["grad_norm"] > 1e3 * TOL, off
    first = rows["dp1 no router losses"]["moe_aux_loss"].iloc[0]
    assert first == pytest.approx(rows["dp1 per_rollout_mean"]["moe_aux_loss"].iloc[0], rel=TOL)
    d = worst("dp2 ep2 fp32", "dp1 fp32")
    print(f"fp32: worst {max(d.values()):.1e} (FP32_TOL {FP32_TOL:.0e})")
    assert max(d.values()) <= FP32_TOL, d
    # the runs hold the same model: every expert once in the saved parameters
    ref = runs["dp1 per_token"]
    for name in ("dp4 ep2", "dp2 cp2 ep4", "pp3", "tp2", "tp2 pp3", "dp2 pp3 ep2",
                 "tp2 dp2 ep2"):
        assert runs[f"{name} per_token"].meta["parameters"] == ref.meta["parameters"], name
        assert set(runs[f"{name} per_token"].params(2)) == set(ref.params(2)), name
    logits = {}
    for name in ("dp1", "dp4 ep2", "dp2 pp3 ep2"):
        label = f"{name} per_rollout_mean"
        out = runs[label].export_hf(tmp_path / "export" / label.replace(" ", "_"))
        # float32: transformers' MoE experts (torch's grouped matmul) refuse float64
        hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        with torch.no_grad():
            logits[name] = hf(torch.arange(3, 40)[None]).logits
    for name in ("dp4 ep2", "dp2 pp3 ep2"):
        a, b = logits[name], logits["dp1"]
        assert float((a - b).norm() / b.norm()) < FP32_TOL, name
    # the step log's expert load: per layer, the tokens each of the 4 experts received (top
    # 2: every token twice); rank 0's micro-batches, one figure each
    for _, row in table[table["label"] == "dp2 per_rollout_mean"].iterrows():
        load = np.array(row["expert_tokens"])
        assert load.shape == (3, 4), load.shape  # 3 layers x 4 experts
        assert (load.sum(axis=1) == 2 * row["tokens"]).all(), (load, row["tokens"])
        assert len(row["micro_batch_expert_max_over_mean"]) == row["num_microbatches"][0]


def test_moe_layouts_the_engine_does_not_build_are_refused(moe_checkpoint):
    base = TrainConfig().with_(path=str(moe_checkpoint), global_batch_size=6,
                               max_tokens_per_gpu=48)
    with pytest.raises(ValueError, match=r"tp=2 without sequence parallelism"):
        run(base.with_(tp=2, sequence_parallel=False), rollouts(), progress=False)
    with pytest.raises(ValueError, match=r"ep=2 runs with fixed CP only"):
        run(base.with_(dp=2, cp=2, cp_mode="dynamic", ep=2), rollouts(), progress=False)
    with pytest.raises(ValueError, match="ep=3 does not divide the 4 experts"):
        run(base.with_(dp=3, ep=3), rollouts(), progress=False)
    with pytest.raises(ValueError, match="checkpoints of an expert-parallel run"):
        run(base.with_(dp=2, ep=2, save_every=1), rollouts(), progress=False)


@pytest.mark.parametrize("setting", [dict(moe_aux_loss_coeff=1e-3), dict(moe_z_loss_coeff=1e-3),
                                     dict(dp=2, ep=2),
                                     dict(faults=FaultConfig(moe_aux_per_row=True))])
def test_a_dense_model_refuses_the_routers_settings(setting):
    """Accepted and ignored would be a bug: the toy GPT has no router."""
    cfg = TrainConfig().with_(global_batch_size=6, max_tokens_per_gpu=48, **setting)
    with pytest.raises(ValueError, match=r"dense model \(no router\)"):
        run(cfg, rollouts(), progress=False)
