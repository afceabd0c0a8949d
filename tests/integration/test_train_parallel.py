"""The parallel layouts slime runs, trained for real: the same numbers as dp 1.

One matrix on the toy GPT and one on truncated SmolLM2 (4 layers: enough for
pp 2 x vpp 2): tensor parallelism (tp 2), pipeline parallelism (pp 2, 1F1B;
pp 2 x vpp 2, interleaved), all-gather context parallelism (cp 2) and dynamic
CP on a pool of 4 (degrees 1 and 2 in one step), and tp 2 x pp 2. Each gives
the step-1 and step-2 loss, grad norm, every report metric and the parameters
of dp 1 within 1e-5 (fp32), for ``per_rollout_mean`` and ``per_token``; the
naive mode still moves where the micro-batches change. Runs of one world size
share a launch (``compare`` groups them), so the matrix costs three launches
per model.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from _factories import TINY_GPT

from varbatch_kit import Rollouts, build_schedule
from varbatch_kit.train import TrainConfig, compare
from varbatch_kit.train.step import report_keys

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

MODES = ("per_rollout_mean", "per_token")
#: name -> what differs from dp 1 (TrainConfig.with_ names)
LAYOUTS = {
    "dp1": {},
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
    "pp2 vpp2": dict(pp=2, vpp=2, mb_group=2),
    "cp2 allgather": dict(cp=2, cp_impl="allgather"),
    "dp2 cp2 dynamic": dict(dp=2, cp=2, cp_mode="dynamic", cp_impl="allgather"),
    "tp2 pp2": dict(tp=2, pp=2),
}
#: where the naive mode must move: layouts whose micro-batches differ from dp 1's
NAIVE = ("dp1", "cp2 allgather", "dp2 cp2 dynamic")
TOY = {**TINY_GPT, "num_layers": 4}


def mixed_rollouts(long_len=(56, 70)) -> Rollouts:
    """Steps of 6 rollouts: one or two long samples among short ones (dynamic CP: degrees 1
    and 2 in one step)."""
    rng = np.random.default_rng(11)
    counts = [1, 2, 1, 1, 2, 1] * 2
    rid = np.repeat(np.arange(len(counts)), counts)
    prompt = rng.integers(3, 7, rid.size)
    resp = rng.integers(5, 14, rid.size)
    for i in (0, 8):  # a long sample in every step
        resp[i] = rng.integers(*long_len)
    masks = [(rng.random(r) < 0.85).astype(int) for r in resp]
    for m in masks:
        m[0] = 1
    return Rollouts(prompt, resp, rid, masks)


def built(base: TrainConfig) -> dict[str, TrainConfig]:
    """The layouts of the matrix the engine runs (a layout still refused is left out, named;
    so is one the model cannot split, e.g. SmolLM2's 9 heads over tp 2, which ``run``
    refuses before any worker starts)."""
    from varbatch_kit.train.tensor_parallel import check_tp_split

    out = {}
    for name, changes in LAYOUTS.items():
        try:
            cfg = base.with_(**changes)
            check_tp_split(cfg.resolve_model(), cfg.tp)
            out[name] = cfg
        except ValueError as e:
            print(f"layout {name!r} left out: {e}")
    return out


def matrix(base: TrainConfig, rollouts: Rollouts, out_dir, *, cap: int):
    layouts = built(base.with_(global_batch_size=6, max_tokens_per_gpu=cap,
                               packing="first_fit"))
    configs = [c.with_(mode=m, label=f"{name} {m}")
               for m in MODES for name, c in layouts.items()]
    configs += [layouts[n].with_(mode="naive_microbatch_mean", label=f"{n} naive")
                for n in NAIVE if n in layouts]
    runs: list = []
    table = compare(configs, rollouts, out_dir=out_dir, progress=False, runs=runs)
    return layouts, table, runs


def check(layouts, table, runs, rollouts) -> None:
    keys = report_keys(runs[0].config, False)
    cols = ["label", "step", "num_microbatches", "loss", "grad_norm", "loss_rel_diff",
            "grad_norm_rel_diff", "param_rel_diff"]
    with pd.option_context("display.width", 250, "display.max_rows", 200):
        print(table[cols].to_string())
    walls = {r.config.world_size: round(r.launch_wall_s, 1) for r in runs}
    print("launch wall time per world size (s):", walls)

    dyn = layouts.get("dp2 cp2 dynamic")
    if dyn is not None:  # the dynamic plan gives degrees 1 and 2 in one step
        plan = build_schedule(rollouts, dyn.schedule, model=dyn.model_shape())
        degrees = [sorted({p.degree for p in s.placements}) for s in plan.steps[:2]]
        assert [1, 2] in degrees, degrees

    for mode in MODES:
        t = table[table["mode"] == mode]
        ref = t[t.config == t.reference]
        assert ref["label"].iloc[0] == f"dp1 {mode}"
        assert len(t) == 2 * len(layouts)
        for key in keys:
            r = ref.set_index("step")[key]
            for label, g in t.groupby("label"):
                got = g.set_index("step")[key]
                np.testing.assert_allclose(got, r, rtol=1e-5, atol=1e-7,
                                           err_msg=f"{label}: {key}")
        assert t["grad_norm_rel_diff"].max() < 1e-5, t[cols]
        assert t["param_rel_diff"].notna().all()
        assert t["param_rel_diff"].max() < 1e-5, t[cols]
        assert (t["grad_norm"] > 0).all() and (t["loss"].abs() > 1e-4).all()

    naive = table[(table["mode"] == "naive_microbatch_mean") & (table.step == 1)]
    moved = naive[naive.config != naive.reference]
    if len(moved):
        assert (np.maximum(moved["loss_rel_diff"], moved["grad_norm_rel_diff"]) > 0.01).all(), \
            naive[cols]


def test_toy_gpt_layout_matrix(tmp_path):
    rollouts = mixed_rollouts()
    base = TrainConfig().with_(lr=1e-3, min_lr=1e-3, lr_decay_style="constant",
                               n_samples_per_prompt=3, save_params_at=(1, 2), max_steps=2,
                               entropy_coef=0.01, **TOY)
    layouts, table, runs = matrix(base, rollouts, tmp_path, cap=40)
    assert set(layouts) == set(LAYOUTS)  # the toy GPT runs every layout: none left out
    check(layouts, table, runs, rollouts)


def test_smollm2_layout_matrix(smollm2_path, tmp_path):
    rollouts = mixed_rollouts(long_len=(90, 110))
    # no gradient clipping: on random tokens SmolLM2's gradient norm is 40-1400, so clipping
    # is always active, and the fp32 rounding of the norm (summed per stage, per shard)
    # moves the clip factor by an ulp, which Adam turns into 1e-5 at step 2; the toy matrix
    # and tests/integration/test_train_real.py keep clipping on
    base = TrainConfig().with_(path=str(smollm2_path), num_layers=4, lr=1e-5, min_lr=1e-5,
                               lr_decay_style="constant", n_samples_per_prompt=3,
                               save_params_at=(1, 2), max_steps=2, entropy_coef=0.01,
                               clip_grad=0.0, timeout_s=600)
    layouts, table, runs = matrix(base, rollouts, tmp_path, cap=64)
    # only the tensor-parallel layouts are left out (9 heads, 3 key/value groups)
    assert set(LAYOUTS) - set(layouts) == {"tp2", "tp2 pp2"}
    check(layouts, table, runs, rollouts)
    # the export of a pipelined run (its stages' parameters gathered under dp 1's names):
    # transformers loads it and gives dp 1's export's logits (relative norm of the difference)
    import torch
    from transformers import AutoModelForCausalLM

    by_label = {r.config.name: r for r in runs}
    logits = {}
    for label in ("dp1 per_token", "pp2 vpp2 per_token"):
        out = by_label[label].export_hf(tmp_path / "export" / label.replace(" ", "_"))
        hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        with torch.no_grad():
            logits[label] = hf(torch.arange(5, 69)[None]).logits
    a, b = logits["pp2 vpp2 per_token"], logits["dp1 per_token"]
    rel = float((a - b).norm() / b.norm())  # the two runs' weights differ by ~1e-8 relative
    assert rel < 1e-6, rel


def test_smollm2_cannot_split_its_heads_over_two_tp_ranks(smollm2_path):
    """9 query heads and 3 key/value groups: tp 2 is refused before any worker starts."""
    from varbatch_kit.train import run

    base = TrainConfig().with_(path=str(smollm2_path), num_layers=4, tp=2)
    with pytest.raises(ValueError, match=r"tp=2"):
        run(base, mixed_rollouts(), progress=False)
