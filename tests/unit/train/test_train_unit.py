"""Training engine, single process: CPU shim, packed batches on the real GPTModel, toy data,
config, CLI."""

from __future__ import annotations

import argparse
import warnings

import numpy as np
import pytest
import torch
from _megatron import single_process_megatron

from varbatch_kit import Rollouts, ScheduleConfig
from varbatch_kit.train import ModelConfig, TrainConfig
from varbatch_kit.train.config.model_config import resolve_model
from varbatch_kit.train.config.train_config import DataConfig, LossConfig
from varbatch_kit.train.data.rollout_advantages import token_advantages
from varbatch_kit.train.data.rollout_data import make_toy_data
from varbatch_kit.train.parallel import cpu_shim
from varbatch_kit.train.step.packed_batch import block_causal_mask, pack, response_token_stats

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


# --------------------------------------------------------------------------- CPU shim
@pytest.fixture
def clean_shim():
    cpu_shim.deactivate()
    yield
    cpu_shim.deactivate()


@pytest.mark.parametrize("host", ["this host", "a GPU host"])
def test_shim_patches_exactly_the_listed_names_and_not_global_torch(clean_shim, monkeypatch,
                                                                    host):
    import importlib

    from varbatch_kit.train.parallel.devices import PRETEND_CUDA_ENV

    if host == "a GPU host":  # the engine sees 8 GPUs; the run still chose the CPU
        monkeypatch.setenv(PRETEND_CUDA_ENV, "8")

    before_cuda = torch.cuda.current_device
    before_zeros = torch.zeros
    names = [(m, "torch") for m in cpu_shim.PATCHED_MODULES] + list(cpu_shim.PATCHED_FUNCTIONS)
    originals = {(m, a): getattr(importlib.import_module(m), a) for m, a in names}
    assert cpu_shim.activate() is True
    assert cpu_shim.activate() is True  # idempotent
    expected = sorted([(m, "torch") for m in cpu_shim.PATCHED_MODULES]
                      + list(cpu_shim.PATCHED_FUNCTIONS))
    assert cpu_shim.patched() == expected
    # the global torch is untouched; only the listed modules see the CPU view
    assert torch.cuda.current_device is before_cuda and torch.zeros is before_zeros
    for (m, a), orig in originals.items():
        assert getattr(importlib.import_module(m), a) is not orig
    view = importlib.import_module("megatron.core.utils").torch
    assert view.cuda.current_device() == torch.device("cpu")
    assert view.zeros(2, device="cuda").device.type == "cpu"
    assert view.empty(3, device=0).device.type == "cpu"
    assert view.tensor([1.0], device=torch.device("cuda")).device.type == "cpu"
    assert view.Tensor is torch.Tensor and view.distributed is torch.distributed
    # pipeline p2p: its buffers on current_device() and its torch.cuda.synchronize()
    p2p = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication").torch
    assert p2p.cuda.current_device() == torch.device("cpu")
    assert p2p.cuda.synchronize() is None and p2p.empty(3, device=p2p.cuda.current_device(),
                                                         dtype=torch.int64).numel() == 3
    # a module nobody listed keeps the real torch
    assert importlib.import_module("megatron.core.transformer.module").torch is torch
    cpu_shim.deactivate()
    assert cpu_shim.patched() == []
    for (m, a), orig in originals.items():
        assert getattr(importlib.import_module(m), a) is orig


def test_shim_applies_by_the_run_device_not_the_host(clean_shim, monkeypatch):
    import importlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a real GPU host
    assert cpu_shim.needed() is False  # the host's default run would use CUDA
    assert cpu_shim.needed("cpu") is True and cpu_shim.needed(torch.device("cpu")) is True
    assert cpu_shim.needed("cuda") is False and cpu_shim.needed("cuda:1") is False
    assert cpu_shim.activate("cuda") is False  # a CUDA run: the real code paths
    assert cpu_shim.patched() == []
    assert cpu_shim.activate("cpu") is True  # a CPU run on that host is shimmed
    assert len(cpu_shim.patched()) == len(cpu_shim.PATCHED_MODULES) + len(
        cpu_shim.PATCHED_FUNCTIONS)
    view = importlib.import_module("megatron.core.utils").torch
    # megatron's patched modules see no CUDA, as on a CPU-only host; the global torch does
    assert view.cuda.is_available() is False and torch.cuda.is_available() is True


def test_shim_clip_replacement_scales_like_megatron():
    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    ps[0].grad = torch.tensor([3.0, 0.0, 0.0])
    ps[1].grad = torch.tensor([0.0, 4.0, 0.0])
    cpu_shim._clip_grad_by_total_norm_cpu(ps, max_norm=1.0, total_norm=5.0)
    assert torch.allclose(ps[0].grad, torch.tensor([0.6, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(ps[1].grad, torch.tensor([0.0, 0.8, 0.0]), atol=1e-6)
    cpu_shim._clip_grad_by_total_norm_cpu(ps, max_norm=10.0, total_norm=1.0)  # no clipping
    assert torch.allclose(ps[1].grad, torch.tensor([0.0, 0.8, 0.0]), atol=1e-6)


def test_shim_clip_replacement_takes_float64_gradients():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad = torch.tensor([3.0, 4.0], dtype=torch.float64)
    cpu_shim._clip_grad_by_total_norm_cpu([p], max_norm=1.0, total_norm=5.0)
    assert p.grad.dtype == torch.float64
    want = torch.tensor([3.0, 4.0], dtype=torch.float64) * (1.0 / (5.0 + 1e-6))  # megatron's eps
    assert torch.allclose(p.grad, want, rtol=1e-15, atol=0)


def test_shim_grad_norm_keeps_float64_and_leaves_float32_to_megatron():
    import torch.distributed as dist
    from megatron.core.optimizer import clip_grads

    with single_process_megatron("cpu"):
        assert cpu_shim.active()
        # (1 + 2^-40) per entry: a float32 norm rounds the 2^-40 away, a float64 one keeps it
        x = 1.0 + 2.0 ** -40
        g64 = [torch.tensor([x, 0.0], dtype=torch.float64),
               torch.tensor([0.0, x], dtype=torch.float64)]
        norm = clip_grads.get_grad_norm_fp32(g64, grad_stats_parallel_group=dist.group.WORLD)
        assert norm == pytest.approx((2 * x * x) ** 0.5, rel=1e-15)
        assert norm != float(torch.tensor(norm, dtype=torch.float32))
        g32 = [t.float() for t in g64]  # megatron-core's own kernel: a float32 norm
        norm32 = clip_grads.get_grad_norm_fp32(g32, grad_stats_parallel_group=dist.group.WORLD)
        assert norm32 == pytest.approx(2 ** 0.5, rel=1e-7) and norm32 != norm


# --------------------------------------------------------------------------- packed batches
def test_block_causal_mask_hand_example():
    m = block_causal_mask([2, 3])[0, 0]
    allowed = (~m).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]


def test_pack_positions_and_response_positions():
    b = pack([np.array([5, 6, 7]), np.array([1, 2, 3, 4])], prompt_lens=[1, 2])
    assert b.tokens.tolist() == [[5, 6, 7, 1, 2, 3, 4]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert b.offsets == (0, 3) and b.response_lens == (2, 2)
    # sample 0 responses (tokens 6, 7) predicted at 0, 1; sample 1 (3, 4) at 4, 5
    assert b.response_positions().tolist() == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="prompt_len"):
        pack([np.array([1, 2])], prompt_lens=[0])


@pytest.fixture(scope="module")
def megatron_single_process():
    """torch.distributed (gloo, world 1) + megatron parallel state here, torn down after."""
    with single_process_megatron() as device:
        yield device


@pytest.mark.parametrize("at_response_rows", [False, True])
def test_response_token_stats_equal_the_float64_log_softmax(at_response_rows):
    """The chunked token stats against a float64 log-softmax over the response rows."""
    g = torch.Generator().manual_seed(0)
    batch = pack([np.arange(9) % 7, np.arange(6) % 5], [3, 2])
    pos = batch.response_positions()
    full = (torch.randn(batch.num_tokens, 7, generator=g) * 3).requires_grad_(True)
    logits = full[pos] if at_response_rows else full
    got = response_token_stats(logits[None], batch, at_response_rows=at_response_rows,
                               temperature=0.8, entropy_grad=True)
    targets = batch.tokens[0, pos + 1]
    logp = torch.log_softmax(full[pos].double() / 0.8, dim=-1)
    want = {"logprob": logp.gather(-1, targets[:, None])[:, 0],
            "entropy": -(logp.exp() * logp).sum(-1)}
    for key, value in want.items():
        assert got[key].dtype == torch.float64 and got[key].shape == (pos.numel(),)
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6)
    assert torch.equal(got["correct"], (logp.argmax(-1) == targets).double())
    w = torch.linspace(-1, 1, pos.numel(), dtype=torch.float64)
    (g_got,) = torch.autograd.grad((got["logprob"] * w + got["entropy"] * w.flip(0)).sum(), full)
    (g_want,) = torch.autograd.grad((want["logprob"] * w + want["entropy"] * w.flip(0)).sum(),
                                    full)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-6)


def test_packed_losses_equal_each_sample_alone(megatron_single_process):
    """Packing is real: per-sample log-probs of a packed row == running each sample alone."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from varbatch_kit.train.model.gpt import build_gpt

    device = megatron_single_process
    cfg = resolve_model(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                    vocab_size=64))
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    gpt = build_gpt(cfg, max_seq_len=32).to(device).eval()
    rng = np.random.default_rng(0)
    lengths, prompts = [9, 17, 5, 12], [3, 6, 1, 4]
    seqs = [rng.integers(0, 64, n) for n in lengths]
    with torch.no_grad():
        packed = pack(seqs, prompts, device=device)
        out = response_token_stats(gpt(packed.tokens, packed.position_ids,
                                       packed.attention_mask), packed)["logprob"]
        per_sample = out.split(list(packed.response_lens))
        for seq, p, got in zip(seqs, prompts, per_sample):
            alone = pack([seq], [p], device=device)
            ref = response_token_stats(gpt(alone.tokens, alone.position_ids,
                                           alone.attention_mask), alone)["logprob"]
            rel = (got - ref).abs().max() / ref.abs().max()
            assert rel < 1e-5, rel
        # the mask matters: plain causal attention over the row leaks across samples
        causal = block_causal_mask([packed.num_tokens], device=device)
        leaky = response_token_stats(gpt(packed.tokens, packed.position_ids, causal),
                                     packed)["logprob"].split(list(packed.response_lens))
        assert (leaky[1] - per_sample[1]).abs().max() > 1e-4


# --------------------------------------------------------------------------- toy data
def test_toy_advantages_take_slimes_path_over_samples():
    """Each sample's reward is its rollout's; the advantages are slime's over the samples:
    groups of n_samples_per_prompt consecutive samples when the batch holds
    rollout_batch_size * n of them, else one group of the whole batch."""
    single = Rollouts.synthetic(6, samples_per_rollout=(1, 1), prompt_len=(2, 5), response_len=6,
                                max_response_len=10, seed=2)
    data, loss = DataConfig(n_samples_per_prompt=3), LossConfig()
    d = make_toy_data(single, vocab_size=32, seed=5, data=data, loss=loss)
    assert d.group_of_sample.tolist() == [0, 0, 0, 1, 1, 1]
    adv = [a[0] for a in token_advantages(d, single, loss=loss, data_cfg=data)]
    for g in (slice(0, 3), slice(3, 6)):
        r = d.sample_reward[g]
        want = (r - r.mean()) / (np.std(r, ddof=1) + 1e-6)
        assert np.allclose(adv[g], want, atol=1e-5)
    # multi-sample rollouts: 18 samples != 2 prompts * 3, one group over every sample
    multi = Rollouts.synthetic(6, samples_per_rollout=(2, 4), prompt_len=(2, 5), response_len=6,
                               max_response_len=10, seed=2)
    d = make_toy_data(multi, vocab_size=32, seed=5, data=data, loss=loss)
    assert len(multi) > 6 and d.group_of_sample.tolist() == [0] * len(multi)
    adv = token_advantages(d, multi, loss=loss, data_cfg=data)
    r = d.sample_reward
    want = (r - r.mean()) / (np.std(r, ddof=1) + 1e-6)
    assert np.allclose([a[0] for a in adv], want, atol=1e-5)
    assert all((a == a[0]).all() for a in adv)
    # good rollouts (quality 0.9) get positive advantages, sloppy ones (0.1) negative
    _ids, members = multi.rollout_order()
    for k, m in enumerate(members):
        assert np.sign(adv[int(m[0])][0]) == np.sign(d.rollout_reward[k] - r.mean())


def test_toy_data_is_seeded_per_rollout_and_follows_the_rule():
    r = Rollouts.synthetic(8, samples_per_rollout=(1, 3), prompt_len=(2, 5), response_len=6,
                           max_response_len=10, seed=1)
    cfg = dict(data=DataConfig(n_samples_per_prompt=4), loss=LossConfig())
    d = make_toy_data(r, vocab_size=32, seed=5, **cfg)
    # rule bookkeeping: follows_rule marks exactly the tokens equal to previous + 1
    for i, seq in enumerate(d.tokens):
        p = int(r.prompt_len[i])
        assert seq.size == r.total_len[i]
        assert np.array_equal(d.follows_rule[i], seq[p:] == (seq[p - 1:-1] + 1) % 32)
    # reward = fraction of rule tokens over the rollout's samples (all-ones masks), and
    # every sample carries its rollout's reward
    _ids, groups = r.rollout_order()
    for k, members in enumerate(groups):
        hits = sum(int(d.follows_rule[i].sum()) for i in members)
        total = sum(int(r.response_len[i]) for i in members)
        assert d.rollout_reward[k] == pytest.approx(hits / total)
        assert np.all(d.sample_reward[members] == d.rollout_reward[k])
    assert d.rollout_log_probs is None and d.given_advantages is None
    # a rollout's tokens do not depend on the other rollouts in the batch
    last = r.subset(groups[-1])
    d2 = make_toy_data(last, vocab_size=32, seed=5, **cfg)
    for j, i in enumerate(groups[-1]):
        assert np.array_equal(d2.tokens[j], d.tokens[i])
    # and the seed matters
    d3 = make_toy_data(r, vocab_size=32, seed=6, **cfg)
    assert any(not np.array_equal(a, b) for a, b in zip(d.tokens, d3.tokens))


# --------------------------------------------------------------------------- config and CLI
def test_train_config_validation_and_helpers():
    c = TrainConfig(schedule=ScheduleConfig(dp=2, cp=2, global_batch_size=4, micro_batch_size=1))
    assert c.world_size == 4 and c.name == "dp2 cp2 static/strided per_rollout_mean"
    assert c.lr_increment_unit() == "rollouts"
    assert TrainConfig(mode="per_token").lr_increment_unit() == "samples"
    c2 = c.with_(dp=1, packing="first_fit", max_tokens_per_gpu=64, mode="per_token")
    assert (c2.dp, c2.schedule.packing, c2.mode) == (1, "first_fit", "per_token")
    assert c2.model_shape().hidden_size == c.resolve_model().hidden_size == 64
    for bad, match in [({"mode": "nope"}, "report mode"), ({"hidden_size": 30}, "divisible"),
                       ({"lr_decay_style": "step"}, "lr_decay_style"),
                       ({"fail_rank": 3}, "fail_rank"), ({"save_params_at": (0,)}, "1-based"),
                       ({"device": "tpu"}, "device")]:
        with pytest.raises(ValueError, match=match):
            TrainConfig().with_(**bad)  # routed to its sub-config, which refuses it


def test_run_rejects_bad_inputs_before_launching():
    from varbatch_kit.train import run

    r = Rollouts(prompt_len=[0, 3], response_len=[4, 4])
    with pytest.raises(ValueError, match="prompt_len"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=1, micro_batch_size=1)), r)
    r = Rollouts(prompt_len=[2, 3], response_len=[4, 4])
    with pytest.raises(ValueError, match="max_seq_len"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=1, micro_batch_size=1),
                        model=ModelConfig(max_seq_len=5)), r)
    # two one-sample rollouts with slime's default n_samples_per_prompt=1: groups of one
    # sample, whose std is undefined (slime would train on NaN advantages)
    with pytest.raises(ValueError, match="sample 0 is alone in its reward group"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=1, micro_batch_size=1)), r)
    with pytest.raises(ValueError, match="global_batch_size"):
        run(TrainConfig(schedule=ScheduleConfig(global_batch_size=3, micro_batch_size=1),
                        data=DataConfig(n_samples_per_prompt=2)), r)


def test_cli_builds_every_combination():
    from varbatch_kit.cli import train as cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())
    a = p.parse_args(["compare", "--dp", "1", "2", "--cp", "1", "2", "--packing", "static",
                      "first_fit", "--micro-batch-size", "2", "--max-tokens-per-gpu", "64",
                      "--mode", "per_rollout_mean", "per_token", "--run.max_steps", "3"])
    configs = cli.configs_from_args(a)
    assert len(configs) == 16
    assert {(c.dp, c.cp, c.schedule.packing, c.mode) for c in configs} == {
        (dp, cp, pk, m) for dp in (1, 2) for cp in (1, 2) for pk in ("static", "first_fit")
        for m in ("per_rollout_mean", "per_token")}
    static = [c for c in configs if c.schedule.packing == "static"]
    assert all(c.schedule.micro_batch_size == 2 and c.run.max_steps == 3 for c in static)
    a = p.parse_args(["train", "--packing", "static"])
    with pytest.raises(ValueError, match="micro-batch-size"):
        cli.configs_from_args(a)
    a = p.parse_args(["train", "--dp", "2", "--rollouts", "16"])
    (c,) = cli.configs_from_args(a)
    assert c.dp == 2 and c.schedule.max_tokens_per_gpu == 256
    assert len(cli.rollouts_from_args(a).rollout_order()[0]) == 16
    a = p.parse_args(["compare", "--dp", "2", "--cp", "2", "--cp-mode", "fixed", "dynamic",
                      "--max-tokens-per-gpu", "64"])
    assert [c.schedule.cp_mode for c in cli.configs_from_args(a)] == ["fixed", "dynamic"]
    a = p.parse_args(["train", "--cp-mode", "dynamic"])  # cp=1: nothing to choose
    with pytest.raises(ValueError, match="cp >= 2"):
        cli.configs_from_args(a)


def test_cli_batching_is_core_configs_decision_in_flag_words():
    """``core.config.batching_fields`` decides the path; the errors name the CLI's flags."""
    from varbatch_kit.cli import train as cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())

    def schedule(*argv):
        (c,) = cli.configs_from_args(p.parse_args(["train", *argv]))
        return c.schedule.micro_batch_size, c.schedule.max_tokens_per_gpu, c.schedule.packing

    assert schedule() == (None, 256, "first_fit")
    assert schedule("--packing", "ffd") == (None, 256, "ffd")
    assert schedule("--micro-batch-size", "2") == (2, None, "static")
    assert schedule("--max-tokens-per-gpu", "64") == (None, 64, "first_fit")
    both = ("--micro-batch-size", "2", "--max-tokens-per-gpu", "64")
    assert schedule(*both, "--packing", "static") == (2, None, "static")
    assert schedule(*both, "--packing", "first_fit") == (None, 64, "first_fit")
    for argv, msg in [
        (["--packing", "static"],
         r"^packing='static' needs --micro-batch-size \(static batching\)$"),
        (["--packing", "first_fit", "--micro-batch-size", "2"],
         r"^packing='first_fit' packs under a token cap: set --max-tokens-per-gpu \(dynamic "
         r"batching\) instead of --micro-batch-size, or use packing='static'$"),
        (list(both), r"^set exactly one of --micro-batch-size \(static batching\) and "
                     r"--max-tokens-per-gpu \(dynamic batching\); got --micro-batch-size=2, "
                     r"--max-tokens-per-gpu=64; to let a packing pick, give --packing too$"),
    ]:
        with pytest.raises(ValueError, match=msg):
            schedule(*argv)


def test_schedule_fields_routed_by_with_are_the_init_fields():
    from varbatch_kit.train.config.train_config import SCHEDULE_FIELDS

    assert "defaulted" not in SCHEDULE_FIELDS  # derived by ScheduleConfig, not settable
    assert {"dp", "cp", "packing", "distribution", "max_tokens_per_gpu"} <= set(SCHEDULE_FIELDS)
    c = TrainConfig().with_(dp=2, packing="balanced")
    assert (c.schedule.dp, c.schedule.distribution) == (2, "balanced")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is inactive under CUDA")
def test_shim_bf16_optimizer_keeps_fp32_main_copies_of_bf16_params(clean_shim):
    """megatron's mixed-precision optimizer sorts parameters by CUDA type names; the shim's
    version sorts them by dtype: bf16 ones get an fp32 main copy, fp32 ones are stepped as
    they are, anything else is refused."""
    import megatron.core.optimizer as mo
    from megatron.core.optimizer import OptimizerConfig

    low = torch.nn.Parameter(torch.tensor([1.5, -2.25], dtype=torch.bfloat16))
    full = torch.nn.Parameter(torch.tensor([0.5]))
    cpu_shim.activate()
    cls = mo.Float16OptimizerWithFloat16Params
    opt = cls(torch.optim.Adam([low, full], lr=0.1), OptimizerConfig(bf16=True), None,
              lambda o, config=None: None)
    assert opt.float16_groups == [[low]] and opt.fp32_from_fp32_groups == [[full]]
    (main,) = opt.fp32_from_float16_groups[0]
    assert main.dtype == torch.float32 and torch.equal(main, low.float())
    assert low.main_param is main and opt.optimizer.param_groups[0]["params"] == [main, full]
    bad = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    with pytest.raises(TypeError, match="dtype torch.float64"):
        cls(torch.optim.Adam([bad], lr=0.1), OptimizerConfig(bf16=True), None,
            lambda o, config=None: None)
