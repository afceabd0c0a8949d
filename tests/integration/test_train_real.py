"""Real model, real rollouts: SmolLM2 (first 2 layers) trained on its own generations.

The objective is slime's, from slime's own command line (``SLIME_FLAGS``: GRPO with the
asymmetric clip, the low_var_kl KL loss and the entropy bonus, through
``compat.slime.train_config_from_slime_args``), on slime's advantages, which the engine
computes from the generated rewards (generation writes none). The layout matrix: dp {1, 2}
x all-gather cp {1, 2} x packing {first_fit, balanced} for per_rollout_mean and per_token
give the same step-1 and step-2 loss, every objective metric (pg_loss, pg_clipfrac, ppo_kl,
entropy_loss, kl_loss), gradient norm and parameters; the naive micro-batch mean drifts.

The matrix runs in float64 (``precision="fp64"``, CPU): a first version in fp32 took its
tolerance from a floor measured in the same run (dp 1 with each step's micro-batches in
another order) and failed: ``kl_loss`` moved 2.2e-6 under dp 2 where reordering moved it 1e-7,
so one reordering does not bound what the layouts' other reductions move in fp32, and 1e-5
sat at the noise of the machine. In float64 every layout must agree within ``TOL = 1e-9``; the
floor run (``microbatch_order="small_ends"``: the same sums, added in another order) is still
measured and printed, and TOL must sit ``FLOOR_MARGIN`` times above it. The naive mode must
drift by orders of magnitude more. (The fp32 row against float64, the pipeline and tensor
layouts and the injected bugs: tests/integration/test_train_parallel.py.) Step 2 is
off-policy (the log-prob pass ran before step 1), so the ratio, the clip and the KL to the
initial model are all at work there. Runs of the same world size
share one torchrun launch (:func:`varbatch_kit.train.compare`). The rollouts are generated
once (SmolLM2-135M-Instruct, arithmetic questions, two turns per rollout) and cached as a
trace under ``build/cache``; the table of the matrix is cached there too
(:mod:`varbatch_kit.cli.experiment_cache`, keyed by every input and the package source):
notebook 06 section 5 runs the same matrix on the same rollouts, so whichever of the two runs
first trains it and the other reads its table.

(The engine's loss against slime's formulas on transformers logits, not circular:
tests/integration/test_train_objective.py.)
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from _paths import REPO
from _smollm2 import CACHE, GEN

from varbatch_kit import ScheduleConfig, build_schedule
from varbatch_kit.cli.experiment_cache import cached_compare
from varbatch_kit.train import TrainConfig

# one pytest-xdist worker for this file and notebook 06 (they share the matrix's cached run)
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900),
              pytest.mark.xdist_group("smollm2_matrix")]

ROOT = REPO
GBS, CAP = 6, 256
# slime's flags for the objective (issue 20's example command line)
SLIME_FLAGS = ("--advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --use-kl-loss "
               "--kl-loss-coef 0.01 --kl-loss-type low_var_kl --entropy-coef 0.001 "
               "--n-samples-per-prompt 4")
# every metric the matrix compares across layouts (besides grad norm and parameters)
OBJECTIVE_METRICS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "kl_loss",
                     "nll", "advantage")
#: the floor run: dp 1's micro-batches of each step trained in another order
FLOOR_ORDER = "small_ends"
#: every layout within this relative difference of dp 1 (float64), every metric
TOL = 1e-9
#: TOL must be at least this many times the float64 floor measured on this machine
FLOOR_MARGIN = 1000
#: the naive mode must drift at least this many times TOL
NAIVE_MARGIN = 1e6


def _layouts():
    for dp, cp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        for packing in ("first_fit", "balanced"):
            yield ScheduleConfig(dp=dp, cp=cp, global_batch_size=GBS, max_tokens_per_gpu=CAP,
                                 packing=packing)


def _matrix_configs(smollm2_path) -> list[TrainConfig]:
    from varbatch_kit.compat.slime import train_config_from_slime_args

    base = TrainConfig().with_(path=str(smollm2_path), num_layers=2, lr=1e-4, min_lr=1e-4,
                               lr_decay_style="constant", save_params_at=(1, 2), max_steps=2,
                               timeout_s=600, precision="fp64")
    objective = train_config_from_slime_args(SLIME_FLAGS, base=base)
    layouts = list(_layouts())
    configs = [objective.with_(schedule=s, mode=m)
               for m in ("per_rollout_mean", "per_token") for s in layouts]
    # pack-first: dp alone hands the same micro-batches to more ranks, so the naive mean moves
    # with the packing and with cp: dp1 cp1 first_fit (ref), dp1 cp2 first_fit, dp2 cp2 balanced
    naive = [layouts[i] for i in (0, 4, 7)]
    configs += [objective.with_(schedule=s, mode="naive_microbatch_mean") for s in naive]
    # the noise floor: dp1 cp1 first_fit again, each step's micro-batches in another order
    floor = replace(layouts[0], microbatch_order=FLOOR_ORDER)
    configs += [objective.with_(schedule=floor, mode=m, label=f"dp1 cp1 reordered {m}")
                for m in ("per_rollout_mean", "per_token")]
    return configs


def relative_differences(table: pd.DataFrame, label: str, ref: str) -> dict[str, float]:
    """Each metric's difference of run ``label`` to run ``ref`` over both steps, relative to
    the reference's largest magnitude (absolute where the reference is 0), and the parameters'
    (compare's ``param_rel_diff``, against the first run of the mode)."""
    a = table[table.label == label].set_index("step")
    b = table[table.label == ref].set_index("step")
    assert list(a.index) == list(b.index) == [1, 2], (label, ref)
    out = {}
    for k in (*OBJECTIVE_METRICS, "grad_norm"):
        scale = float(np.abs(b[k]).max())
        out[k] = float(np.abs(a[k] - b[k]).max()) / (scale or 1.0)
    out["params"] = float(a["param_rel_diff"].max())
    return out


def test_the_matrix_runs_slimes_objective_from_slimes_flags(smollm2_path):
    c = _matrix_configs(smollm2_path)[0]
    assert (c.loss.advantage_estimator, c.loss.eps_clip, c.loss.eps_clip_high) == ("grpo", 0.2,
                                                                                   0.28)
    assert (c.loss.use_kl_loss, c.loss.kl_loss_coef, c.loss.kl_loss_type) == (True, 0.01,
                                                                              "low_var_kl")
    assert (c.loss.entropy_coef, c.data.n_samples_per_prompt) == (0.001, 4)
    assert c.loss.advantage_grouping == "slime" and c.model.num_layers == 2


def test_notebook_04_runs_this_matrix_on_these_rollouts(tmp_path):
    """Notebook 06 section 5 makes this test's generation and matrix calls (CPU, the settings
    cell's default: the full matrix), which the harness's kernel setup turns into the same
    experiment-cache calls, so whichever runs first computes them once."""
    import nbformat

    from varbatch_kit.train.rl.generate import GenerationStats

    nb = nbformat.read(REPO / "notebooks" / "06_metric_report_invariance.ipynb", as_version=4)
    cells = {c.id: c.source for c in nb.cells}
    checkpoint = tmp_path / "SmolLM2-135M-Instruct"
    seen: dict = {}
    # the notebook's own code, its imports given and the expensive calls recorded instead of run
    from varbatch_kit.compat.slime import train_config_from_slime_args

    class Generated:  # what generate_rollouts returns, recording what the notebook does with it
        def __init__(self, path, kw):
            seen["rollouts"] = (path, kw)

    ns = {"os": os, "Path": Path, "torch": torch, "ScheduleConfig": ScheduleConfig,
          "TrainConfig": TrainConfig, "GenerationStats": GenerationStats,
          "train_config_from_slime_args": train_config_from_slime_args,
          "smollm2_checkpoint": lambda: checkpoint,
          "generate_rollouts": lambda path, **kw: Generated(path, kw),
          "compare": lambda configs, rollouts, **kw: seen.setdefault(
              "compare", (configs, rollouts))}
    code = "\n".join(line for line in "\n".join(
        (cells["06-settings"], cells["04-16"], cells["04-17"])).splitlines()
        if not line.startswith(("import ", "from ")))
    exec(code.split("real_table[[")[0], ns)  # noqa: S102 - the notebook's cells
    assert ns["GPUS"] == (torch.cuda.is_available() and torch.cuda.device_count() >= 4)
    if ns["GPUS"]:
        pytest.skip("with four GPUs notebook 06 trains the full model on them (another matrix)")
    path, kw = seen["rollouts"]
    assert path == checkpoint
    assert {k: v for k, v in kw.items() if k != "stats"} == {**GEN, "device": "cpu"}
    configs, rollouts = seen["compare"]
    assert isinstance(rollouts, Generated)  # as generated: the engine's advantages from rewards
    assert ns["SLIME_FLAGS"] == SLIME_FLAGS
    assert [repr(c) for c in configs] == [repr(c) for c in _matrix_configs(checkpoint)]


def test_smollm2_layout_matrix(real_rollouts, smollm2_path):
    r = real_rollouts  # rewards, no advantages: the engine computes slime's from the rewards
    reward = r.extra["reward"].to_numpy(dtype=float)
    assert len(r) == 24 and r.num_rollouts == 12
    # real data: slime normalises the 24 samples as one group (24 != 3 prompts x 4), so a
    # sample's advantage is 0 only where its reward is the batch mean; every step must hold
    # samples away from it, or the step's policy loss is 0
    assert np.ptp(reward) > 0.1, "the generated rollouts have no reward variance; change GEN"
    for lo in (0, GBS):
        rows = r.rollout_id >= lo
        rows &= r.rollout_id < lo + GBS
        assert np.abs(reward[rows] - reward.mean()).max() > 0.1, (
            "a step holds only samples of the batch's mean reward; change GEN['seed']")

    configs = _matrix_configs(smollm2_path)
    t0 = time.monotonic()
    # computed here, or read back from notebook 06's run of the same matrix (same key)
    table = cached_compare(configs, r, cache_dir=CACHE, progress=False)
    wall = time.monotonic() - t0
    cols = ["label", "step", "samples", "num_microbatches", "loss", "pg_loss", "pg_clipfrac",
            "ppo_kl", "entropy_loss", "kl_loss", "grad_norm", "loss_rel_diff",
            "grad_norm_rel_diff", "param_rel_diff"]
    with pd.option_context("display.width", 250, "display.max_rows", 100,
                           "display.float_format", "{:.6g}".format):
        print(f"\nSmolLM2 (2 of 30 layers) on {len(r)} generated samples, "
              f"{len(configs)} runs in {wall:.0f} s (about 0 s where read back from {CACHE})")
        print(table[cols].to_string())
        sound = table[table["mode"] != "naive_microbatch_mean"]
        print("max rel diffs (sound modes):",
              sound[["loss_rel_diff", "grad_norm_rel_diff", "param_rel_diff"]].max().to_dict())

    assert table[table.config == 0]["samples"].tolist() == [12, 12]
    step1 = table[table.step == 1]
    assert len({tuple(x) for x in step1["num_microbatches"]}) >= 3  # the layouts really differ
    # cp 2 ran all-gather CP for real (the default), none emulated
    assert set(step1["cp"]) == {1, 2} and not step1["cp_emulated"].any()
    assert set(step1[step1.cp == 2]["cp_impl"]) == {"allgather"}
    # the floor run trains the same micro-batches in another order
    ref_cfg, floor_cfg = configs[0], configs[-2]
    orders = [[[s.micro_batches[b].tolist() for b in s.rank_bins[0]] for s in
               build_schedule(r, c.schedule, model=c.model_shape()).steps] for c in
              (ref_cfg, floor_cfg)]
    assert orders[0] != orders[1] and all(sorted(x) == sorted(y) for x, y in zip(*orders)), (
        "the floor run must train the same micro-batches in another order")
    rows = []
    for mode in ("per_rollout_mean", "per_token"):
        t = table[table["mode"] == mode]
        ref = t[t.config == t.reference]["label"].iloc[0]
        assert ref == "dp1 cp1 fp64 first_fit/strided " + mode
        floor = relative_differences(table, f"dp1 cp1 reordered {mode}", ref)
        layouts = [lab for lab in dict.fromkeys(t.label) if "reordered" not in lab]
        assert len(layouts) == 8
        diffs = {lab: relative_differences(table, lab, ref) for lab in layouts}
        for k, f in floor.items():
            worst = max(diffs, key=lambda lab, k=k: diffs[lab][k])
            rows.append(dict(mode=mode, metric=k, floor=f, tolerance=TOL,
                             worst=diffs[worst][k], worst_layout=worst.rsplit(" ", 1)[0]))
        for step in (1, 2):
            s = t[t.step == step]
            assert (s["grad_norm"] > 0).all() and (s["loss"].abs() > 1e-4).all()
        # step 1 is on-policy (the log-prob pass's model is the actor, and the reference): no
        # ratio, no clip, no KL; step 2 is off-policy: all three at work, in every layout
        one, two = t[t.step == 1], t[t.step == 2]
        assert (one["ppo_kl"] == 0).all() and (one["pg_clipfrac"] == 0).all()
        assert (one["kl_loss"] == 0).all()
        assert (two["ppo_kl"].abs() > 1e-6).all() and (two["kl_loss"] > 1e-9).all()
    floors = pd.DataFrame(rows)
    with pd.option_context("display.width", 250, "display.max_rows", 100):
        print("float64: measured floor (dp 1 reordered), tolerance, worst layout\n"
              + floors.to_string(float_format="{:.1e}".format))
    assert floors.floor.max() * FLOOR_MARGIN <= TOL, (
        f"the float64 floor is {floors.floor.max():.1e}: TOL={TOL:.0e} is not {FLOOR_MARGIN}x "
        "above it on this machine")
    over = floors[floors.worst > TOL]
    assert over.empty, f"layouts beyond TOL={TOL:.0e}:\n{over}"
    n = table[(table["mode"] == "naive_microbatch_mean") & (table.step == 1)]
    moved = n[n.config != n.reference]
    drift = np.maximum(moved["loss_rel_diff"], moved["grad_norm_rel_diff"])
    print(f"naive drift (loss / grad norm) at least {drift.min():.1e} = "
          f"{drift.min() / TOL:.0e} x TOL")
    assert (drift > NAIVE_MARGIN * TOL).all(), n
