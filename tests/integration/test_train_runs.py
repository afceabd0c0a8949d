"""Training engine end to end: real torchrun workers, megatron-core GPT, gloo on CPU.

Runtime is kept small by training many configurations per torchrun launch
(:func:`varbatch_kit.train.run_many` groups them by world size).
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from _factories import TINY_GPT as TINY

from varbatch_kit import Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.train import TrainConfig, TrainingError, TrainingTimeout, compare, run, run_many
from varbatch_kit.train.runs.supervise import _alive, job_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(420)]



def _invariance_rollouts() -> Rollouts:
    """12 rollouts of 1-4 samples; gbs=4 gives steps of 8, 4 and 12 samples; partial masks."""
    counts = [2, 1, 3, 2, 1, 1, 1, 1, 3, 3, 2, 4]
    rid = np.repeat(np.arange(len(counts)), counts)
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, 9, rid.size)
    resp = rng.integers(4, 17, rid.size)
    masks = [(rng.random(r) < 0.85).astype(int) for r in resp]
    for m in masks:
        m[0] = 1
    return Rollouts(prompt, resp, rid, masks)


def _layouts():
    for dp, cp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        for packing in ("static", "first_fit"):
            for dist in ("strided", "flops_kk"):
                sizes = ({"micro_batch_size": 2} if packing == "static"
                         else {"max_tokens_per_gpu": 24})
                yield ScheduleConfig(dp=dp, cp=cp, global_batch_size=4, packing=packing,
                                     distribution=dist, **sizes)


@pytest.mark.start_early
def test_reports_gradients_and_parameters_do_not_move_with_the_layout(tmp_path):
    rollouts = _invariance_rollouts()
    # 24 samples of 12 rollouts: slime's rule normalises the rewards over the whole batch
    # (24 != 12 // 3 * 3), so a step's advantages do not sum to 0 and its loss is far from
    # 0: relative differences are meaningful
    base = dict(TINY, lr=1e-3, min_lr=1e-3, lr_decay_style="constant", n_samples_per_prompt=3,
                save_params_at=(1, 3), save_grads_at=(1,))
    layouts = list(_layouts())
    configs = [TrainConfig().with_(schedule=s, mode=mode, **base)
               for mode in ("per_rollout_mean", "per_token") for s in layouts]
    # dp 2 x cp 2 with the distributed optimizer (ZeRO-1 over the pool of 4): its saved
    # gradient is the reduced shards gathered back, its parameters the shards' updates
    configs += [TrainConfig().with_(schedule=layouts[15], mode=mode, distributed=True, **base)
                for mode in ("per_rollout_mean", "per_token")]
    naive_layouts = [layouts[i] for i in (0, 2, 8, 15)]  # ref, first_fit, cp=2, dp2 cp2 kk
    configs += [TrainConfig().with_(schedule=s, mode="naive_microbatch_mean", **base)
                for s in naive_layouts]
    runs: list = []
    table = compare(configs, rollouts, out_dir=tmp_path, progress=False, runs=runs)
    cols = ["label", "step", "samples", "num_microbatches", "loss", "grad_norm",
            "loss_rel_diff", "grad_norm_rel_diff", "param_rel_diff"]
    with pd.option_context("display.width", 250, "display.max_rows", 500):
        print(table[table.step.isin([1, 3])][cols].to_string())

    # the data is what the acceptance asks for: multi-sample rollouts, variable step sizes,
    # and layouts that really differ (micro-batch counts per rank, all-gather CP)
    assert table[table.config == 0]["samples"].tolist() == [8, 4, 12]
    step1 = table[table.step == 1]
    assert len({tuple(x) for x in step1["num_microbatches"]}) >= 4
    # cp 2 ran all-gather CP for real (the default), none emulated
    assert set(step1["cp"]) == {1, 2} and not step1["cp_emulated"].any()
    assert set(step1[step1.cp == 2]["cp_impl"]) == {"allgather"}

    for mode in ("per_rollout_mean", "per_token"):
        t = table[table["mode"] == mode]
        ref = t[t.config == t.reference]
        assert ref["label"].iloc[0] == "dp1 cp1 static/strided " + mode
        s1, s3 = t[t.step == 1], t[t.step == 3]
        assert len(s1) == 17 and len(s3) == 17  # the 16 layouts, and dp2 cp2 dist-opt
        assert s1["loss_rel_diff"].max() < 1e-5, s1[cols]
        assert s1["grad_norm_rel_diff"].max() < 1e-5, s1[cols]
        assert s1["param_rel_diff"].max() < 1e-5, s1[cols]
        # the whole gradient vector, not only its norm (reduced over the ranks, pre-clipping)
        assert s1["grad_rel_diff"].max() < 1e-5, s1[cols + ["grad_rel_diff"]]
        assert (s1["grad_cosine"] > 1 - 1e-9).all()
        assert s3["loss_rel_diff"].max() < 1e-4, s3[cols]
        assert s3["grad_norm_rel_diff"].max() < 1e-4, s3[cols]
        assert s3["param_rel_diff"].max() < 1e-4, s3[cols]
        assert (s1["grad_norm"] > 0).all() and (s1["loss"].abs() > 1e-4).all()

    # a naive normalisation moves with the layout on the same data (> 1 %)
    naive = table[(table["mode"] == "naive_microbatch_mean") & (table.step == 1)]
    moved = naive[naive.config != naive.reference]
    assert (np.maximum(moved["loss_rel_diff"], moved["grad_norm_rel_diff"]) > 0.01).all(), naive
    assert (moved["grad_rel_diff"] > 0.01).all()  # the gradient's direction moves too

    # micro-batch timing (train/step/microbatch_timer.py) of the same launches: per world rank, one
    # record per
    # micro-batch in training order, with its lengths; busy and straggler follow from them
    lengths = rollouts.total_len
    for r in runs:
        for rec in (json.loads(x) for x in r.jsonl_path.read_text().splitlines()):
            timing = rec["micro_batch_timing"]
            assert len(timing) == r.config.world_size
            for w, mbs in enumerate(timing):
                dp_rank = w // r.config.cp
                assert [sum(m["lengths"]) for m in mbs] == rec["micro_batch_tokens"][dp_rank]
                assert sum(len(m["lengths"]) for m in mbs) == rec["samples_per_rank"][dp_rank]
                assert all(m["fwd_s"] > 0 and m["bwd_s"] > 0 for m in mbs)
            busy = [sum(m["fwd_s"] + m["bwd_s"] for m in mbs) for mbs in timing]
            assert rec["busy_s"] == pytest.approx(busy)
            assert rec["straggler_s"] == pytest.approx([max(busy) - b for b in busy])
            assert max(busy) <= rec["step_time_s"]
    dp2 = next(r for r in runs if r.config.dp == 2 and r.config.cp == 1
               and r.config.schedule.packing == "first_fit")
    mb = dp2.micro_batches
    assert list(mb.columns) == ["step", "rank", "position", "num_samples", "sum_len",
                                "sum_len_sq", "fwd_s", "bwd_s", "time_s"]
    assert len(mb) == sum(sum(n) for n in dp2.steps["num_microbatches"])
    step1 = build_schedule(rollouts, dp2.config.schedule, model=dp2.config.model_shape()).steps[0]
    first = step1.ranks[1][0]  # rank 1's first micro-batch of step 1
    row = mb[(mb.step == 1) & (mb["rank"] == 1) & (mb.position == 0)].iloc[0]
    assert row.num_samples == len(first) and row.sum_len == lengths[first].sum()
    assert row.sum_len_sq == (lengths[first] ** 2).sum()
    assert row.time_s == pytest.approx(row.fwd_s + row.bwd_s)


def test_keep_params_false_compares_in_the_workers_with_the_same_numbers(tmp_path):
    """``compare(..., keep_params=False)``: only the references write parameter files, every
    other run computes ``||p - p_ref||`` in its worker against the reference's file; the
    table is the one of ``keep_params=True``, bitwise. A run whose reference trains in a
    later launch writes its file as before; a run named in ``keep_params`` keeps its."""
    base = TrainConfig().with_(lr=1e-3, min_lr=1e-3, lr_decay_style="constant",
                               n_samples_per_prompt=3, save_params_at=(1, 3), global_batch_size=4,
                               max_tokens_per_gpu=24, packing="first_fit", **TINY)
    configs = [base.with_(mode="per_token", label="ref token"),               # world 1
               base.with_(dp=2, mode="per_rollout_mean", label="ref rollout"),  # world 2
               base.with_(dp=2, mode="per_token", label="dp2 token"),        # in its worker
               base.with_(cp=2, mode="per_token", label="cp2 token"),        # kept (named)
               # its reference (world 2) trains in the second launch: it writes its file
               base.with_(mode="per_rollout_mean", label="dp1 rollout")]
    rollouts = _invariance_rollouts()
    tables, runs = {}, {}
    for keep in (True, False):
        got: list = []
        tables[keep] = compare(configs, rollouts, out_dir=tmp_path / str(keep), progress=False,
                               runs=got, keep_params=True if keep else {"cp2 token"})
        runs[keep] = {r.config.name: r for r in got}
    cols = ["label", "step", "reference", "loss", "param_rel_diff"]
    print(tables[False][cols].to_string())
    timings = ["step_time_s", "wall_s", "busy_s", "straggler_s", "micro_batch_timing",
               "log_prob_pass_s"]  # the only columns two launches may differ in
    pd.testing.assert_frame_equal(tables[True].drop(columns=timings),
                                  tables[False].drop(columns=timings), check_exact=True)
    moved = tables[False][tables[False].step.isin([1, 3])
                          & (tables[False].config != tables[False].reference)]
    assert len(moved) == 6 and (moved["param_rel_diff"] > 0).all()  # not 0: p != p_ref
    assert (moved["param_rel_diff"] < 1e-5).all()

    def files(r):
        return sorted(p.name for p in r.out_dir.glob("params_step*.pt"))

    both = ["params_step1.pt", "params_step3.pt"]
    kept = runs[False]
    for name in ("ref token", "ref rollout", "cp2 token", "dp1 rollout"):
        assert files(kept[name]) == both, name
        assert not kept[name].compared_in_worker(1)
    worker = kept["dp2 token"]
    assert files(worker) == [] and worker.compared_in_worker(1) and worker.compared_in_worker(3)
    assert not worker.compared_in_worker(2)  # no parameters saved at step 2
    assert {"param_sq_diff", "param_sq_ref"} <= set(worker.steps.columns)
    with pytest.raises(ValueError, match=r"kept no parameters of step 1.*keep_params"):
        worker.params(1)
    assert all(files(r) == both for r in runs[True].values())


def test_keep_params_and_params_against_are_checked_before_any_worker_starts():
    base = TrainConfig().with_(max_steps=1, **TINY)
    configs = [base.with_(label="a"), base.with_(dp=2, label="b")]
    rollouts = _invariance_rollouts()
    for bad, match in (("a", "give True, False or a collection"),
                       ({"a", "c"}, r"not compared: \['c'\]")):
        with pytest.raises(ValueError, match=match):
            compare(configs, rollouts, progress=False, keep_params=bad)
    with pytest.raises(ValueError, match="reference=5"):
        compare(configs, rollouts, progress=False, reference=5)
    for bad in ([None], [1, 1], [None, True], [None, 2]):
        with pytest.raises(ValueError, match="params_against="):
            run_many(configs, rollouts, progress=False, params_against=bad)


def test_variable_batch_lr_schedule_and_loss_curve(tmp_path):
    """One launch: 30 steps on the toy task (one rollout batch per step: on-policy, the model
    learns the rule), and a per-token run whose LR schedule advances by each step's sample
    count."""
    curve_rollouts = Rollouts.synthetic(240, samples_per_rollout=(1, 2), prompt_len=(4, 8),
                                        response_len=12, response_sigma=0.5,
                                        max_response_len=24, seed=3)
    gbs8 = ScheduleConfig(global_batch_size=8, max_tokens_per_gpu=256)
    curve_cfg = TrainConfig().with_(schedule=gbs8,
                            num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64,
                            lr=3e-3, min_lr=3e-4, n_samples_per_prompt=4, num_steps_per_rollout=1,
                            label="curve")
    lr_cfg = TrainConfig().with_(schedule=gbs8,
                         mode="per_token", lr=1e-3, min_lr=0.0, lr_decay_style="linear",
                         max_steps=5, label="lr", **TINY)
    curve, lr_run = run_many([curve_cfg, lr_cfg], curve_rollouts, out_dir=tmp_path,
                             progress=False)

    s = curve.steps
    print("loss curve:", [round(x, 4) for x in s["loss"]])
    print("token_acc:", [round(x, 3) for x in s["token_acc"]])
    print("nll:", [round(x, 3) for x in s["nll"]])
    assert s["step"].tolist() == list(range(1, 31))
    # on-policy (the log-prob pass before every step): ratio 1, so slime's PPO loss is the
    # reported mean of -advantage, nothing is clipped, and ppo_kl is 0 (the pass and the
    # step run the same micro-batches: bit for bit)
    assert np.allclose(s["loss"], -s["advantage"], rtol=0, atol=1e-12)
    assert (s["pg_clipfrac"] == 0).all() and (s["ppo_kl"] == 0).all()
    assert (s["log_prob_pass_s"] > 0).all()
    first, last = s["nll"].iloc[:5].mean(), s["nll"].iloc[-5:].mean()
    assert last < first - 0.1, (first, last)
    assert s["token_acc"].iloc[-5:].mean() > s["token_acc"].iloc[:5].mean() + 0.05
    assert (s["rollouts"] == 8).all() and s["lr_increment"].eq(8).all()  # per-rollout: rollouts

    # variable global batch size: the per-step sample counts vary, the JSONL shows them,
    # and the LR schedule advanced by exactly those counts (linear decay to 0)
    steps = build_schedule(curve_rollouts, lr_cfg.schedule, model=lr_cfg.model_shape()).steps[:5]
    samples = [st.num_samples for st in steps]
    assert len(set(samples)) > 1
    lines = [json.loads(x) for x in lr_run.jsonl_path.read_text().splitlines()]
    assert [x["samples"] for x in lines] == samples
    assert [x["lr_increment"] for x in lines] == samples
    total, consumed = sum(samples), np.cumsum([0] + samples[:-1])
    assert np.allclose([x["lr"] for x in lines], 1e-3 * (1 - consumed / total), rtol=1e-9)
    assert lines[-1]["lr_next"] == pytest.approx(0.0, abs=1e-12)
    for key in ("step", "rollouts", "samples", "tokens", "num_microbatches", "loss", "nll",
                "grad_norm", "lr", "wall_s", "samples_per_rank", "tokens_per_rank"):
        assert key in lines[0], key
    assert lines[0]["tokens"] == int(curve_rollouts.total_len[steps[0].sample_indices].sum())


def test_failing_worker_stops_everything_and_raises_its_traceback(tmp_path):
    rollouts = _invariance_rollouts()
    cfg = TrainConfig().with_(dp=2, global_batch_size=4, max_tokens_per_gpu=32,
                      fail_at_step=2, fail_rank=1, timeout_s=900, **TINY)
    with pytest.raises(TrainingError) as info:
        run(cfg, rollouts, out_dir=tmp_path, progress=False)
    err = info.value
    # fails fast, whatever the machine's load: the worker's error ends the launch, not the
    # launch timeout (900 s, far beyond the run) and not the step timeout
    assert not isinstance(err, TrainingTimeout), str(err)
    assert "timed out" not in str(err) and "step_timeout_s" not in str(err)
    assert err.rank == 1
    assert "fail_at_step=2: rank 1 raises on purpose" in str(err)
    assert "Traceback" in err.worker_error
    assert len(err.worker_pids) == 2
    assert not any(_alive(p) for p in err.worker_pids)
    assert not _alive(err.torchrun_pid)
    assert job_processes(err.job_dir) == []  # nothing else started for this job survives
    # step 1 did complete before the failure
    lines = (next(tmp_path.glob("run00-*")) / "steps.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 1


def test_cli_train_writes_the_table(tmp_path, capsys):
    from varbatch_kit.cli import main

    csv = tmp_path / "steps.csv"
    rc = main(["train", "--rollouts", "8", "--global-batch-size", "4", "--dp", "1",
               "--model.hidden-size", "32", "--model.num-attention-heads", "2", "--quiet",
               "--out", str(tmp_path / "run"),
               "--csv", str(csv)])
    assert rc == 0
    out = capsys.readouterr().out
    table = pd.read_csv(csv)
    assert table["step"].tolist() == [1, 2]
    assert "grad_norm" in out and "dp1 cp1 first_fit/strided per_rollout_mean" in out
    rc = main(["train", "--packing", "static", "--quiet"])
    assert rc == 2  # a user error: message on stderr, no traceback
    assert "micro-batch-size" in capsys.readouterr().err


@pytest.mark.start_early
def test_cli_runs_pipeline_and_tensor_layouts(tmp_path, capsys):
    """``train --pp 2 --vpp 2 --mb-group 2``, ``train --slime-args=...`` and ``compare --tp 1 2
    --pp 1 2`` run; in float64
    the four layouts' losses and grad norms agree (steps of 6 and 4 micro-batches)."""
    from varbatch_kit.cli import main

    toy = ["--rollouts", "8", "--global-batch-size", "4", "--max-tokens-per-gpu", "32",
           "--model.hidden-size", "32", "--model.num-attention-heads", "2",
           "--run.max-steps", "2", "--quiet"]
    assert main(["train", "--pp", "2", "--vpp", "2", "--mb-group", "2",
                 "--model.num-layers", "4", "--out", str(tmp_path / "vpp"), *toy]) == 0
    assert "pp2 vpp2" in capsys.readouterr().out
    slime = "--advantage-estimator grpo --eps-clip 0.1 --use-kl-loss --kl-loss-coef 0.01"
    assert main(["train", f"--slime-args={slime}", "--model.num-layers", "2",
                 "--out", str(tmp_path / "slime"), *toy]) == 0
    (log,) = (tmp_path / "slime").rglob("steps.jsonl")
    assert len(log.read_text().splitlines()) == 2
    csv = tmp_path / "compare.csv"
    assert main(["compare", "--tp", "1", "2", "--pp", "1", "2", "--precision", "fp64",
                 "--model.num-layers", "2", "--out", str(tmp_path / "cmp"), "--csv", str(csv),
                 *toy]) == 0
    table = pd.read_csv(csv)
    assert sorted(table["label"].unique()) == sorted(
        f"dp1 cp1{pp}{tp} fp64 first_fit/strided per_rollout_mean"
        for pp in ("", " pp2") for tp in ("", " tp2"))
    assert table.groupby("label").size().tolist() == [2, 2, 2, 2]
    assert table["num_microbatches"].nunique() == 2  # steps of different counts
    assert (table["loss_rel_diff"].abs() < 1e-9).all(), table
    assert (table["grad_norm_rel_diff"].abs() < 1e-9).all(), table


def test_timeout_kills_torchrun_and_workers(tmp_path):
    # rank 1 hangs at step 2 (no step timeout): the run can only end by the launch timeout,
    # however fast the machine (a plain run of this size once took longer than 4 s; a faster
    # start made it finish first)
    cfg = TrainConfig().with_(dp=2, global_batch_size=4, max_tokens_per_gpu=32,
                              timeout_s=4, hang_at_step=2, fail_rank=1, **TINY)
    with pytest.raises(TrainingTimeout) as info:
        run(cfg, _invariance_rollouts(), out_dir=tmp_path, progress=False)
    # the launch timeout fired (an ordering, not a wall-time bound that load can break):
    # raised only once timeout_s has passed with the run still going
    assert "training timed out after 4 s (timeout_s)" in str(info.value)
    assert not _alive(info.value.torchrun_pid)
    assert job_processes(info.value.job_dir) == []


def test_a_cpu_run_on_a_gpu_host_trains(tmp_path, monkeypatch):
    """VARBATCH_KIT_PRETEND_CUDA: the engine takes a GPU host's decisions (8 GPUs per node seen)
    while the run chose the CPU; the worker, which inherits the switch, trains on the CPU
    through the shim (the "auto" fallback and its reason:
    tests/unit/train/parallel/test_devices.py)."""
    from varbatch_kit.train.parallel.devices import PRETEND_CUDA_ENV

    monkeypatch.setenv(PRETEND_CUDA_ENV, "8")
    cfg = TrainConfig().with_(global_batch_size=4, max_tokens_per_gpu=32, max_steps=1,
                              device="cpu", **TINY)
    r = run(cfg, _invariance_rollouts(), out_dir=tmp_path, progress=False)
    choice = r.meta["device_choice"]
    assert (choice["requested"], choice["device"], choice["local_ranks"],
            choice["gpus_per_node"]) == ("cpu", "cpu", 1, 8)
    assert choice["reason"] == "run.device='cpu' (8 GPUs per node)"
    assert r.meta["device"] == "cpu" and r.steps["device"].tolist() == ["cpu"]
    assert np.isfinite(r.steps["loss"]).all() and (r.steps["grad_norm"] > 0).all()


def test_agents_forked_by_the_server_train_as_fresh_ones_do(tmp_path, monkeypatch):
    """The agent server (train/runs/agent_server.py) changes how a CPU launch's agent starts,
    nothing it computes: the same run from a fresh agent (VARBATCH_KIT_FRESH_AGENTS=1, and a
    launch from another thread) gives the same steps bit for bit, and the served launch's
    agent is a fork of this process's one server, recorded in the job's pid files."""
    import threading

    from varbatch_kit.train.runs import agent_server

    cfg = TrainConfig().with_(dp=2, global_batch_size=4, max_tokens_per_gpu=32, max_steps=2,
                              **TINY)
    rollouts = _invariance_rollouts()
    served = run(cfg, rollouts, out_dir=tmp_path / "served", progress=False)
    (job,) = (tmp_path / "served").glob("job0-*")
    assert (job / "pids" / "agent.pid").is_file()
    server = agent_server._server
    assert server is not None and server.alive()
    monkeypatch.setenv(agent_server.FRESH_AGENTS_ENV, "1")
    fresh = run(cfg, rollouts, out_dir=tmp_path / "fresh", progress=False)
    (job,) = (tmp_path / "fresh").glob("job0-*")
    assert not (job / "pids" / "agent.pid").exists()  # a fresh interpreter names its job
    monkeypatch.delenv(agent_server.FRESH_AGENTS_ENV)
    got = []
    thread = threading.Thread(target=lambda: got.append(
        run(cfg, rollouts, out_dir=tmp_path / "thread", progress=False)))
    thread.start()
    thread.join()
    cols = ["step", "loss", "grad_norm", "samples", "num_microbatches"]
    for other in (fresh, got[0]):
        pd.testing.assert_frame_equal(served.steps[cols], other.steps[cols], check_exact=True)
