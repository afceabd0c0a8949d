"""The nested TrainConfig: each sub-config's validation, the generated CLI flags, the model
resolved once (config.json read once), the schedule built once per run."""

from __future__ import annotations

import argparse
import builtins
import inspect
import pickle
from dataclasses import fields
from pathlib import Path

import pytest
from _factories import synthetic_rollouts
from _fake_hf import fake_checkpoint, llama_like

from varbatch_kit import Rollouts, ScheduleConfig
from varbatch_kit.train import (
    CheckpointConfig,
    DataConfig,
    FaultConfig,
    LossConfig,
    ModelConfig,
    NodesConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from varbatch_kit.train.config.model_config import ResolvedModel, resolve_model
from varbatch_kit.train.config.train_config import SUB_CONFIGS


# --------------------------------------------------------------------------- sub-configs
@pytest.mark.parametrize("cls, kw, match", [
    (ModelConfig, {"num_layers": 0}, r"model\.num_layers=0: give a positive integer or None"),
    (ModelConfig, {"hidden_size": 2.5}, r"model\.hidden_size=2\.5"),
    (ModelConfig, {"vocab_size": True}, r"model\.vocab_size=True"),
    (ModelConfig, {"hidden_size": 30}, r"model\.hidden_size=30 is not divisible by "
                                       r"model\.num_attention_heads=4"),
    (ModelConfig, {"path": 3}, r"model\.path=3: give a checkpoint directory path or None"),
    (OptimConfig, {"lr": 0}, r"optim\.lr=0: give a number in \(0, inf\)"),
    (OptimConfig, {"lr": float("nan")}, r"optim\.lr=nan"),
    (OptimConfig, {"min_lr": 1.0}, r"optim\.min_lr=1\.0: give a number in \[0, 0\.003\]"),
    (OptimConfig, {"lr_decay_style": "step"}, r"optim\.lr_decay_style='step': choose one of "
                                              r"\('constant', 'linear', 'cosine'\)"),
    (OptimConfig, {"lr_warmup_fraction": 1.0}, r"optim\.lr_warmup_fraction=1\.0: .*\[0, 1\)"),
    (OptimConfig, {"lr_increment": "tokens"}, r"optim\.lr_increment='tokens'"),
    (OptimConfig, {"weight_decay": -1}, r"optim\.weight_decay=-1"),
    (OptimConfig, {"adam_beta1": 1.0}, r"optim\.adam_beta1=1\.0"),
    (OptimConfig, {"adam_eps": 0}, r"optim\.adam_eps=0"),
    (OptimConfig, {"clip_grad": -0.5}, r"optim\.clip_grad=-0\.5"),
    (LossConfig, {"eps_clip": 1.5}, r"loss\.eps_clip=1\.5: give a number in \[0, 1\)"),
    (LossConfig, {"advantage_estimator": "ppo"}, r"needs a critic"),
    (LossConfig, {"eps_clip_c": 1.0},
     r"loss\.eps_clip_c=1\.0: give a number in \(1, inf\) or None"),
    (LossConfig, {"use_kl_loss": 1}, r"loss\.use_kl_loss=1: give True or False"),
    (LossConfig, {"kl_loss_type": "k4"}, r"loss\.kl_loss_type=.k4.: choose one of"),
    (LossConfig, {"tis_clip_low": 3.0}, r"loss\.tis_clip_low=3\.0: give a number in \[0, 2\]"),
    (DataConfig, {"rollout_batch_size": 0},
     r"data\.rollout_batch_size=0: give a positive integer or None"),
    (DataConfig, {"seed": -1}, r"data\.seed=-1: give an integer >= 0"),
    (DataConfig, {"n_samples_per_prompt": 0}, r"data\.n_samples_per_prompt=0"),
    (RunConfig, {"max_steps": 0}, r"run\.max_steps=0: give a positive integer or None"),
    (RunConfig, {"device": "tpu"}, r"run\.device='tpu': choose one of \('auto', 'cpu', "
                                   r"'cuda'\)"),
    (RunConfig, {"timeout_s": 0}, r"run\.timeout_s=0"),
    (RunConfig, {"step_timeout_s": -1}, r"run\.step_timeout_s=-1.*or None"),
    (RunConfig, {"threads_per_worker": 0}, r"run\.threads_per_worker=0"),
    (RunConfig, {"save_params_at": (0,)}, r"run\.save_params_at=\(0,\): give 1-based steps"),
    (CheckpointConfig, {"save_every": -1}, r"checkpoint\.save_every=-1: give an integer >= 0"),
    (CheckpointConfig, {"keep_last": 0}, r"checkpoint\.keep_last=0: give a positive integer"),
    (NodesConfig, {"nnodes": 2}, r"nodes\.nnodes=2 needs nodes\.rdzv_endpoint='host:port'"),
    (NodesConfig, {"node_rank": 1}, r"nodes\.node_rank=1: give a node in \[0, nnodes=1\)"),
    (NodesConfig, {"rdzv_endpoint": "nohost"}, r"nodes\.rdzv_endpoint='nohost': give "
                                               r"'host:port'"),
    (NodesConfig, {"rdzv_timeout_s": -1}, r"nodes\.rdzv_timeout_s=-1"),
    (FaultConfig, {"fail_at_step": 0}, r"faults\.fail_at_step=0"),
    (FaultConfig, {"fail_rank": -1}, r"faults\.fail_rank=-1: give an integer >= 0"),
    (FaultConfig, {"kill_at": "lunch:3"}, r"faults\.kill_at='lunch:3': give 'POINT:STEP' with "
                                          r"POINT one of \('before_step'"),
    (FaultConfig, {"kill_at": "mid_step"}, r"faults\.kill_at='mid_step'"),
])
def test_each_sub_config_refuses_a_bad_field_naming_field_value_and_what_works(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        cls(**kw)


def test_sub_configs_are_frozen_and_normalise_values():
    opt = OptimConfig()
    with pytest.raises(AttributeError):
        opt.lr = 1.0  # type: ignore[misc]
    assert RunConfig(save_params_at=[3, 1]).save_params_at == (3, 1)
    assert LossConfig(eps_clip=0.5).eps_clip == 0.5 and LossConfig(eps_clip=0.5).clip_high == 0.5
    assert ModelConfig(path="rel/dir").path == str(Path("rel/dir").resolve())
    assert FaultConfig(kill_at="after_ckpt:2").kill_point() == ("after_ckpt", 2)
    assert {f.__name__ for f in SUB_CONFIGS.values()} == {
        "ModelConfig", "OptimConfig", "LossConfig", "DataConfig", "RunConfig",
        "CheckpointConfig", "NodesConfig", "FaultConfig"}


def test_train_config_checks_what_spans_sub_configs():
    dp2 = ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=64)
    with pytest.raises(ValueError, match=r"faults\.fail_rank=2: give a rank of the world of "
                                         r"dp\*cp\*pp\*tp=2, in \[0, 2\)"):
        TrainConfig(schedule=dp2, faults=FaultConfig(fail_rank=2))
    with pytest.raises(ValueError, match=r"nodes\.nnodes=3 does not divide dp\*cp\*pp\*tp=2"):
        TrainConfig(schedule=dp2, nodes=NodesConfig(nnodes=3, rdzv_endpoint="h:1"))
    with pytest.raises(ValueError, match=r"optim=.*give a OptimConfig"):
        TrainConfig(optim={"lr": 1e-3})
    with pytest.raises(ValueError, match="schedule=.*give a ScheduleConfig"):
        TrainConfig(schedule=None)
    with pytest.raises(ValueError, match="report mode"):
        TrainConfig(mode="nope")


@pytest.mark.parametrize("changes, match", [
    (dict(vpp=2), r"vpp=2 needs pipeline parallelism: set pp > 1 or vpp=1"),
    # the toy GPT's 2 layers cannot fill 4 stages; 3 layers cannot be cut in 2 equal ones
    (dict(pp=4), r"num_layers=2 does not split into pp\*vpp=4 equal pipeline chunks"),
    (dict(pp=2, num_layers=3), r"num_layers=3 does not split into pp\*vpp=2"),
    (dict(pp=2, vpp=2, num_layers=4), r"mb_group=1 with pp=2, vpp=2: .* set mb_group >= 2"),
])
def test_layouts_the_engine_cannot_run_are_refused_not_ignored(changes, match):
    """Accepted and ignored would be a bug: refused in the constructor, before any worker."""
    with pytest.raises(ValueError, match=match):
        TrainConfig().with_(**changes)


def test_a_checkpoints_own_depth_is_checked_once_it_is_read(tmp_path):
    """A checkpoint at its own depth: the config cannot know it, the plan (before any worker
    starts) reads it and refuses 3 layers over 2 stages; given num_layers, the config does."""
    from varbatch_kit.train.runs.plan import plan_runs

    ckpt = fake_checkpoint(tmp_path / "llama", *llama_like(layers=3))
    cfg = TrainConfig().with_(path=str(ckpt), pp=2, global_batch_size=2, max_tokens_per_gpu=64)
    assert cfg.known_depth() is None
    rollouts = Rollouts([3, 3, 3, 3], [5, 6, 7, 8], [0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"num_layers=3 does not split into pp\*vpp=2 .*llama"):
        plan_runs([cfg], rollouts)
    with pytest.raises(ValueError, match=r"num_layers=1 does not split into pp\*vpp=2"):
        cfg.with_(num_layers=1)


def test_pipeline_layouts_the_engine_runs_are_accepted():
    pp2 = TrainConfig().with_(pp=2)
    assert (pp2.world_size, pp2.layout.describe()) == (2, "dp1 cp1 pp2 tp1")
    inter = TrainConfig().with_(dp=2, pp=2, vpp=2, mb_group=2, num_layers=4)
    assert (inter.world_size, inter.layout.describe()) == (4, "dp2 cp1 pp2 vpp2 tp1")


def test_the_layout_spans_the_schedule_and_tp():
    cfg = TrainConfig().with_(dp=2, cp=2, cp_impl="emulated")
    assert cfg.layout.describe() == "dp2 cp2(emulated) pp1 tp1"
    assert cfg.world_size == 4
    summary = cfg.summary()
    assert (summary["pp"], summary["tp"], summary["cp_impl"], summary["world_size"]) == (
        1, 1, "emulated", 4)
    with pytest.raises(ValueError, match=r"tp must be a positive integer \(tensor-parallel "
                                         r"ranks\), got 0"):
        TrainConfig(tp=0)
    with pytest.raises(ValueError, match=r"tp must be a positive integer .*, got 2.0"):
        TrainConfig(tp=2.0)
    with pytest.raises(ValueError, match=r"cp_impl='ring': use one of allgather, emulated"):
        TrainConfig(cp_impl="ring")


def test_with_routes_names_to_their_sub_config():
    c = TrainConfig().with_(lr=1e-2, max_steps=3, dp=2, num_layers=1, save_every=2,
                            **{"loss.eps_clip": 0.3})
    assert (c.optim.lr, c.run.max_steps, c.schedule.dp, c.model.num_layers,
            c.checkpoint.save_every, c.loss.eps_clip) == (1e-2, 3, 2, 1, 2, 0.3)
    assert c.optim.min_lr == OptimConfig().min_lr  # the rest of the sub-config is kept
    with pytest.raises(ValueError, match=r"with_: unknown field\(s\) \['layers'\]"):
        TrainConfig().with_(layers=2)
    with pytest.raises(ValueError, match="names no sub-config"):
        TrainConfig().with_(**{"optimizer.lr": 1.0})
    # a new checkpoint path resets the shape fields taken from the old one
    m = TrainConfig(model=ModelConfig(path="/a", num_layers=2, hidden_size=8))
    assert m.with_(path="/b").model == ModelConfig(path="/b")
    assert m.with_(max_steps=1).model == m.model


# --------------------------------------------------------------------------- model spec
def test_toy_model_resolves_to_the_defaults():
    r = resolve_model(ModelConfig())
    assert (r.num_layers, r.hidden_size, r.num_attention_heads, r.ffn_hidden_size,
            r.vocab_size) == (2, 64, 4, 256, 64)
    assert r.is_toy and r.hf_config is None and r.weights_index is None
    assert resolve_model(ModelConfig(hidden_size=32, ffn_hidden_size=40)).ffn_hidden_size == 40
    assert TrainConfig().model_shape() == r.shape
    with pytest.raises(ValueError, match="give a ModelConfig"):
        resolve_model(TrainConfig())


def test_checkpoint_is_read_once_and_the_resolved_spec_needs_no_file(tmp_path, monkeypatch):
    config, tensors = llama_like(layers=2)
    ckpt = fake_checkpoint(tmp_path / "llama", config, tensors)
    opened: list[str] = []
    real_open = builtins.open
    real_read_text = Path.read_text

    def counting_open(file, *a, **k):
        opened.append(Path(file).name)
        return real_open(file, *a, **k)

    def counting_read_text(self, *a, **k):
        opened.append(self.name)
        return real_read_text(self, *a, **k)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(Path, "read_text", counting_read_text)
    cfg = TrainConfig(model=ModelConfig(path=str(ckpt), num_layers=1))  # reads nothing
    assert opened == []
    spec = cfg.resolve_model()
    assert opened.count("config.json") == 1 and opened.count("model.safetensors") == 1
    monkeypatch.undo()
    (ckpt / "config.json").unlink()  # the resolved spec holds what it read
    (ckpt / "model.safetensors").unlink()
    assert isinstance(spec, ResolvedModel) and spec.hf_config == config
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size, spec.ffn_hidden_size) == (
        1, 8, 32, 16)
    assert spec.weights_index["model.layers.1.mlp.up_proj.weight"] == (
        "model.safetensors", (16, 8))
    shape = spec.shape
    assert (shape.num_layers, shape.num_query_groups, shape.kv_channels) == (1, 1, 4)
    assert shape.name == "llama (first 1 of 2 layers)"
    assert pickle.loads(pickle.dumps(spec)) == spec  # it travels to the workers in the job
    from varbatch_kit.train.model.gpt import transformer_config

    tc = transformer_config(spec)  # the model builder takes its options from the spec
    assert (tc.num_layers, tc.hidden_size, tc.num_query_groups, tc.ffn_hidden_size) == (
        1, 8, 1, 16)
    with pytest.raises(ValueError, match="no config.json"):
        cfg.resolve_model()  # resolving again would read the file (now gone)


def test_checkpoint_shape_conflicts_are_refused_by_the_resolver(tmp_path):
    config, tensors = llama_like()
    ckpt = fake_checkpoint(tmp_path / "llama", config, tensors)
    with pytest.raises(ValueError, match=r"model\.num_layers=2, but llama has 1 layers"):
        resolve_model(ModelConfig(path=str(ckpt), num_layers=2))
    with pytest.raises(ValueError, match=r"model\.hidden_size=64 conflicts with the checkpoint"):
        resolve_model(ModelConfig(path=str(ckpt), hidden_size=64))
    assert resolve_model(ModelConfig(path=str(ckpt), vocab_size=32)).vocab_size == 32
    with pytest.raises(ValueError, match=r"does not exist.*Llama.*Qwen2"):
        resolve_model(ModelConfig(path=str(tmp_path / "nowhere")))


# --------------------------------------------------------------------------- schedule once
def _rollouts():
    return synthetic_rollouts(seed=2, prompt_len=(3, 6), response_len=6, response_sigma=1.0,
                              max_response_len=10)


def test_the_launcher_builds_each_schedule_once_and_the_workers_receive_it(tmp_path,
                                                                          monkeypatch):
    from varbatch_kit.train.runs import launch, plan
    from varbatch_kit.train.runs.worker import Job

    builds = []
    real = plan.build_schedule

    def counting(*a, **k):
        builds.append(a[1])
        return real(*a, **k)

    monkeypatch.setattr(plan, "build_schedule", counting)
    r = _rollouts()
    configs = [TrainConfig(schedule=ScheduleConfig(global_batch_size=4, max_tokens_per_gpu=64),
                           run=RunConfig(max_steps=3)),
               TrainConfig(schedule=ScheduleConfig(dp=2, global_batch_size=4,
                                                   max_tokens_per_gpu=64))]
    plans = plan.plan_runs(configs, r)
    assert builds == [c.schedule for c in configs]  # once per run
    assert [p.num_steps for p in plans] == [3, 4]
    assert plans[0].model is plans[1].model  # the same model: resolved once
    path = launch.write_job(tmp_path / "job", plans, r, "cpu", [tmp_path / "a", tmp_path / "b"])
    with open(path, "rb") as f:
        job: Job = pickle.load(f)
    assert len(builds) == 2  # writing the job builds nothing
    assert [[s.rollout_ids.tolist() for s in steps] for steps in job.steps] == [
        [s.rollout_ids.tolist() for s in p.steps] for p in plans]
    assert job.models == [p.model for p in plans] and job.configs == configs
    # the workers take the steps from the job: no schedule is built there
    from varbatch_kit.train.runs import worker as loop
    from varbatch_kit.train.step import train_step as step

    for module in (loop, step):
        assert "build_schedule" not in inspect.getsource(module)
    assert list(inspect.signature(loop.train).parameters)[:3] == ["cfg", "model_spec", "steps"]


def test_run_many_plans_once_and_the_fingerprint_uses_the_same_steps(tmp_path, monkeypatch):
    """run_many: one build per config for validation, fingerprint and the job together."""
    from varbatch_kit.train.runs import launch, plan

    builds = []
    real = plan.build_schedule
    monkeypatch.setattr(plan, "build_schedule",
                        lambda *a, **k: builds.append(1) or real(*a, **k))
    seen = {}

    def fake_launch(plans, rollouts, device, job_dir, out_dirs, progress, **kw):
        seen["steps"] = [p.num_steps for p in plans]
        seen["prints"] = kw["fingerprints"]
        raise RuntimeError("stop before torchrun")

    monkeypatch.setattr(launch, "_launch", fake_launch)
    cfg = TrainConfig(schedule=ScheduleConfig(global_batch_size=4, max_tokens_per_gpu=64))
    with pytest.raises(RuntimeError, match="stop before torchrun"):
        launch.run_many([cfg, cfg.with_(max_steps=2)], _rollouts(), out_dir=tmp_path,
                        progress=False)
    assert len(builds) == 2 and seen["steps"] == [4, 2]
    assert [p["num_steps"] for p in seen["prints"]] == [4, 2]


# --------------------------------------------------------------------------- CLI flags
def _parser():
    from varbatch_kit.cli import train as cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())
    return p


def test_cli_flags_are_generated_from_the_config_fields_with_their_names():
    from varbatch_kit.train.config.cli_flags import flag_fields

    flags = {flag for _, flag, _, _ in flag_fields()}
    expected = {"--mode", "--tp", "--ep", "--sequence-parallel", "--cp-impl", "--precision"} | {
        f"--{g}.{f.replace('_', '-')}" for g, cls in SUB_CONFIGS.items()
        for f in cls.__dataclass_fields__}
    assert flags == expected
    help_text = _parser()._subparsers._group_actions[0].choices["train"].format_help()
    for flag in expected:
        assert flag in help_text
    assert "peak learning rate" in help_text  # the field's metadata is the help
    for old in ("--layers", "--steps", "--timeout ", "--hidden", "--save-every", "--nnodes"):
        assert old not in help_text


def test_a_command_line_gives_the_same_train_config():
    from varbatch_kit.cli import train as cli

    argv = ["train", "--dp", "2", "--global-batch-size", "4", "--max-tokens-per-gpu", "64",
            "--mode", "per_token", "--model.num-layers", "1", "--model.hidden-size", "32",
            "--model.num-attention-heads", "2", "--model.max-seq-len", "none",
            "--optim.lr", "1e-4", "--optim.min-lr", "1e-5", "--optim.lr-decay-style", "linear",
            "--loss.eps-clip", "0.1", "--data.seed", "7", "--run.max-steps", "3",
            "--run.timeout-s", "90", "--run.step-timeout-s", "30", "--run.save-params-at", "1",
            "3", "--run.device", "cpu", "--checkpoint.save-every", "2",
            "--checkpoint.keep-last", "3", "--nodes.rdzv-timeout-s", "60",
            "--faults.kill-at", "mid_step:2", "--faults.fail-rank", "1"]
    (cfg,) = cli.configs_from_args(_parser().parse_args(argv))
    want = TrainConfig(
        schedule=ScheduleConfig(dp=2, global_batch_size=4, max_tokens_per_gpu=64),
        mode="per_token",
        model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2),
        optim=OptimConfig(lr=1e-4, min_lr=1e-5, lr_decay_style="linear"),
        loss=LossConfig(eps_clip=0.1), data=DataConfig(seed=7),
        run=RunConfig(max_steps=3, timeout_s=90.0, step_timeout_s=30.0, save_params_at=(1, 3),
                      device="cpu"),
        checkpoint=CheckpointConfig(save_every=2, keep_last=3),
        nodes=NodesConfig(rdzv_timeout_s=60.0),
        faults=FaultConfig(kill_at="mid_step:2", fail_rank=1))
    assert cfg == want
    (plain,) = cli.configs_from_args(_parser().parse_args(["train"]))
    assert plain == TrainConfig(schedule=plain.schedule)  # every default is the field's
    with pytest.raises(SystemExit):  # argparse refuses a choice outside the field's
        _parser().parse_args(["train", "--optim.lr-decay-style", "step"])
    with pytest.raises(ValueError, match=r"optim\.lr=-1\.0"):  # the sub-config refuses
        cli.configs_from_args(_parser().parse_args(["train", "--optim.lr", "-1"]))


def test_calibrate_cli_takes_the_model_flags(monkeypatch):
    from varbatch_kit.cli import calibrate as cal_cli

    p = argparse.ArgumentParser()
    cal_cli.add_parser(p.add_subparsers())
    a = p.parse_args(["calibrate", "--model.num-layers", "1", "--model.vocab-size", "32"])
    from varbatch_kit.train.config.cli_flags import config_kwargs

    assert TrainConfig(**config_kwargs(a, groups=("model",))).model == ModelConfig(
        num_layers=1, vocab_size=32)


def test_save_grads_at_takes_1_based_steps_like_save_params_at():
    from varbatch_kit.train import RunConfig

    assert RunConfig(save_grads_at=[2, 1]).save_grads_at == (2, 1)
    for bad in ((0,), ("x",), 3):
        with pytest.raises(ValueError, match=r"run\.save_grads_at=.*give 1-based steps"):
            RunConfig(save_grads_at=bad)


@pytest.mark.parametrize("changes, match", [
    (dict(stale_loss_prescale=True, mode="per_token"),
     r"faults\.stale_loss_prescale with mode='per_token': its loss prescale does not use"),
    (dict(cp_duplicate_token_counts=True, mode="per_token"),
     r"faults\.cp_duplicate_token_counts with mode='per_token', cp=1: .*cp >= 2"),
    (dict(cp_duplicate_token_counts=True, mode="per_rollout_mean", cp=2),
     r"faults\.cp_duplicate_token_counts with mode='per_rollout_mean', cp=2"),
    (dict(microbatch_denominators=True, mode="per_token"),
     r"faults\.microbatch_denominators with mode='per_token': its denominators do not"),
    # the swapped K/V chunk acts on all-gather CP's exchange only, on a rank of the CP group
    (dict(cp_swap_chunks_rank=0),
     r"faults\.cp_swap_chunks_rank=0 with cp=1, cp_impl='allgather': .*cp >= 2"),
    (dict(cp_swap_chunks_rank=1, cp=2, cp_impl="emulated"),
     r"faults\.cp_swap_chunks_rank=1 with cp=2, cp_impl='emulated'"),
    (dict(cp_swap_chunks_rank=2, cp=2),
     r"faults\.cp_swap_chunks_rank=2 with cp=2, .*a rank below 2"),
])
def test_an_injected_bug_that_would_change_nothing_is_refused(changes, match):
    changes = dict(changes)
    fault = {k: changes.pop(k) for k in list(changes) if k in {f.name for f in fields(FaultConfig)}}
    with pytest.raises(ValueError, match=match):
        TrainConfig().with_(faults=FaultConfig(**fault), **changes)


def test_injected_bugs_are_accepted_where_they_act_and_must_be_bools():
    TrainConfig().with_(faults=FaultConfig(stale_loss_prescale=True, microbatch_denominators=True))
    TrainConfig().with_(faults=FaultConfig(cp_duplicate_token_counts=True), mode="per_token",
                        cp=2)
    for rank in (0, 1):
        TrainConfig().with_(faults=FaultConfig(cp_swap_chunks_rank=rank), cp=2)
    with pytest.raises(ValueError, match=r"faults\.stale_loss_prescale=1: give True or False"):
        FaultConfig(stale_loss_prescale=1)


def test_fp64_precision_is_accepted_and_named_in_the_label():
    cfg = TrainConfig().with_(precision="fp64")
    assert cfg.precision == "fp64" and cfg.name.startswith("dp1 cp1 fp64 ")
    with pytest.raises(ValueError, match=r"precision='fp16': choose one of \('fp32', 'bf16', "
                                         r"'fp64'\)"):
        TrainConfig().with_(precision="fp16")


def test_a_4d_layout_with_context_parallelism_is_a_run():
    """dp x cp x pp x tp: CP with tensor and pipeline parallelism is accepted, world size 16."""
    from varbatch_kit import ScheduleConfig

    cfg = TrainConfig(tp=2, schedule=ScheduleConfig(dp=2, cp=2, pp=2, global_batch_size=4,
                                                  max_tokens_per_gpu=256))
    assert cfg.world_size == 16 and cfg.layout.unsupported() == []
    assert cfg.layout.describe() == "dp2 cp2(allgather) pp2 tp2 sp"  # sequence parallel: tp's


def test_sequence_parallelism_is_on_with_tensor_parallelism_unless_turned_off():
    """slime's layouts run tp with --sequence-parallel: None means on when tp > 1; True at tp 1
    (nothing to split the sequence over) is refused, not ignored."""
    assert not TrainConfig().layout.sp
    on = TrainConfig(tp=2)
    assert on.layout.sp and on.summary()["sequence_parallel"] and "no-sp" not in on.name
    off = TrainConfig(tp=2, sequence_parallel=False)
    assert not off.layout.sp and " tp2 no-sp " in off.name
    assert off.layout.describe() == "dp1 cp1 pp1 tp2"
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs tp > 1"):
        TrainConfig(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel='yes': give True, False or None"):
        TrainConfig(tp=2, sequence_parallel="yes")


def test_the_sequence_parallel_fault_is_refused_where_it_would_change_nothing():
    from varbatch_kit.train.config.sub_configs import FaultConfig

    bug = FaultConfig(sp_norm_grads_unreduced=True)
    TrainConfig(tp=2, faults=bug)
    for cfg in (dict(), dict(tp=2, sequence_parallel=False)):
        with pytest.raises(ValueError, match=r"sp_norm_grads_unreduced without sequence "):
            TrainConfig(faults=bug, **cfg)


def test_the_distributed_optimizer_is_a_switch_named_in_the_label():
    from varbatch_kit.train.config.sub_configs import OptimConfig

    cfg = TrainConfig().with_(dp=2, distributed=True)
    assert cfg.optim.distributed and cfg.name.startswith("dp2 cp1 dist-opt ")
    with pytest.raises(ValueError, match=r"optim.distributed='yes'"):
        OptimConfig(distributed="yes")


def test_fp64_checkpoints_of_the_distributed_optimizer_are_refused():
    """megatron gathers the optimizer's shards for a checkpoint in float32: a float64 run would
    resume from rounded moments, so the combination is refused before any worker starts."""
    cfg = TrainConfig().with_(dp=2, distributed=True, precision="fp64")
    cfg.with_(precision="fp32", save_every=1)
    cfg.with_(distributed=False, save_every=1)
    with pytest.raises(ValueError, match=r"gathers its shards for a checkpoint in float32"):
        cfg.with_(save_every=1)
