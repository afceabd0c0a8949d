"""The Hugging Face export (:mod:`varbatch_kit.train.model.hf_export`): megatron-core weights back
to a ``transformers`` checkpoint, for every family the loader supports.

- the mapping inverts :func:`~varbatch_kit.train.model.hf_import.megatron_state_dict` bitwise (tiny
  random Llama / Qwen2 / Qwen3 / Mistral checkpoints, tied and untied, truncated too);
- ``transformers.AutoModelForCausalLM.from_pretrained(export)`` gives the engine's logits
  (1e-5, fp32) after the engine's weights were changed, and loading the export back
  (``load_hf_weights``) gives the engine's tensors bitwise;
- config.json (the trained depth), the tokenizer files, the errors (toy GPT, a state dict
  that does not fit, an occupied output folder).
"""

from __future__ import annotations

import importlib.util
import json
import warnings

import numpy as np
import pytest
import torch
from _export_runs import equal, exported, perturbed, run_folder
from _fake_hf import TINY_FAMILIES, TINY_HF, TINY_MOE_FAMILIES, tiny_hf_checkpoint
from _megatron import single_process_megatron

from varbatch_kit.train import ModelConfig
from varbatch_kit.train.config.model_config import resolve_model

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                               "ignore::FutureWarning"),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None
                           for m in ("transformers", "safetensors")),
                       reason="transformers/safetensors not installed "
                              "(pip install 'varbatch_kit[train]')"),
]

#: tokenizer files a checkpoint may hold next to its weights (contents are not parsed)
#: every family the loader and the export map, mixture-of-experts ones too
FAMILIES = [*TINY_FAMILIES, *TINY_MOE_FAMILIES]
TOKENIZER_FILES = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": "{}",
                   "special_tokens_map.json": "{}", "vocab.json": "{}", "merges.txt": "#\n",
                   "chat_template.jinja": "{{ messages }}"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {f: tiny_hf_checkpoint(f, root / f) for f in FAMILIES}
    for name, text in TOKENIZER_FILES.items():  # one checkpoint with tokenizer files
        (out["qwen2_bias_tied"] / name).write_text(text)
    return out


@pytest.fixture(scope="module")
def megatron():
    with single_process_megatron("cpu") as device:
        yield device


def _load_safetensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# --------------------------------------------------------------------------- the mapping
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_state_dict_inverts_the_loader_bitwise(family, checkpoints):
    from varbatch_kit.train.config.hf_checkpoint import read_hf_model
    from varbatch_kit.train.model.hf_export import hf_state_dict
    from varbatch_kit.train.model.hf_import import megatron_state_dict

    spec = read_hf_model(checkpoints[family])
    original = _load_safetensors(checkpoints[family])
    back = hf_state_dict(megatron_state_dict(spec), spec)
    assert set(back) == set(original)  # tied: no lm_head; Qwen2: biases; Qwen3: q/k norms
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    # truncated: the first 2 layers' tensors only
    two = hf_state_dict(megatron_state_dict(spec, 2), spec)
    assert set(two) == {n for n in original if ".layers.2." not in n}


def test_hf_state_dict_names_what_does_not_fit(checkpoints):
    from varbatch_kit.train.config.hf_checkpoint import read_hf_model
    from varbatch_kit.train.model.hf_export import hf_state_dict
    from varbatch_kit.train.model.hf_import import megatron_state_dict

    spec = read_hf_model(checkpoints["qwen3_qknorm"])
    sd = megatron_state_dict(spec)
    gone = "decoder.layers.1.mlp.linear_fc2.weight"
    with pytest.raises(ValueError, match=r"lacks.*decoder\.layers\.1\.mlp\.linear_fc2\.weight"):
        hf_state_dict({k: v for k, v in sd.items() if k != gone}, spec)
    with pytest.raises(ValueError, match=r"unexpected.*decoder\.layers\.0\.extra\.weight"):
        hf_state_dict({**sd, "decoder.layers.0.extra.weight": torch.zeros(1)}, spec)
    bad = {**sd, "decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(5, 48)}
    with pytest.raises(ValueError, match=r"linear_qkv\.weight has shape \[5, 48\].*\[120, 48\]"):
        hf_state_dict(bad, spec)
    with pytest.raises(ValueError, match=r"layers 0, 1, 2, 3.*has 3 layers"):
        hf_state_dict({**sd, **{k.replace("layers.2.", "layers.3."): v
                                for k, v in sd.items() if "layers.2." in k}}, spec)
    # megatron's _extra_state entries (None in a state_dict) are not weights: ignored
    extra = {**sd, "output_layer._extra_state": None,
             "decoder.layers.0.mlp.linear_fc1._extra_state": None}
    assert set(hf_state_dict(extra, spec)) == set(hf_state_dict(sd, spec))


# --------------------------------------------------------------------------- the export
def _engine(path, num_layers=None):
    from varbatch_kit.train.model.gpt import build_gpt

    return build_gpt(resolve_model(ModelConfig(path=str(path), num_layers=num_layers)),
                     max_seq_len=64).eval()


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_the_export_with_the_engines_logits(family, checkpoints, megatron,
                                                               tmp_path):
    """Changed engine weights -> export -> transformers: the engine's logits (fp32, 1e-5);
    and the export read back by the loader is the engine's weights bitwise."""
    from transformers import AutoModelForCausalLM

    from varbatch_kit.train.config.hf_checkpoint import read_hf_model
    from varbatch_kit.train.model.hf_export import export_hf
    from varbatch_kit.train.model.hf_import import load_hf_weights, megatron_state_dict

    source = checkpoints[family]
    rng = np.random.default_rng(5)
    seqs = [torch.from_numpy(rng.integers(0, TINY_HF["vocab_size"], n)) for n in (23, 7)]
    for layers in (None, 2):
        gpt = _engine(source, layers)
        with torch.no_grad():
            for (_, p), (_, moved) in zip(gpt.named_parameters(),
                                          perturbed(dict(gpt.named_parameters()), 7).items()):
                p.copy_(moved)
        state = {k: v.detach().clone() for k, v in gpt.named_parameters()}
        out = export_hf(state, resolve_model(ModelConfig(path=str(source), num_layers=layers)),
                        tmp_path / f"export{layers}")
        config = json.loads((out / "config.json").read_text())
        assert config["num_hidden_layers"] == (layers or 3)
        if "layer_types" in config:
            assert len(config["layer_types"]) == config["num_hidden_layers"]
        hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        assert type(hf).__name__ == json.loads((source / "config.json").read_text())[
            "architectures"][0]
        with torch.no_grad():
            for ids in seqs:
                want = gpt(ids[None], torch.arange(len(ids))[None], None)[0]
                got = hf(ids[None]).logits[0]
                assert _rel(got, want) < 1e-5, (family, layers, _rel(got, want))
        # not the input's weights: the export holds the changed ones
        emb = _load_safetensors(out)["model.embed_tokens.weight"]
        assert torch.equal(emb, state["embedding.word_embeddings.weight"])
        assert not torch.equal(emb, _load_safetensors(source)["model.embed_tokens.weight"])
        # round trip: the loader reads the export back as the engine's tensors, bitwise
        spec = read_hf_model(out)
        back = megatron_state_dict(spec)
        assert set(back) == set(state)
        assert all(torch.equal(back[k], state[k]) for k in state)
        again = _engine(out)
        load_hf_weights(again, spec)
        assert all(torch.equal(p, state[k]) for k, p in again.named_parameters())


def test_export_writes_config_weights_and_the_tokenizer_files(checkpoints, tmp_path):
    from varbatch_kit.train.model.hf_export import export_hf
    from varbatch_kit.train.model.hf_import import megatron_state_dict

    source = checkpoints["qwen2_bias_tied"]
    model = resolve_model(ModelConfig(path=str(source)))
    out = export_hf(megatron_state_dict(model.hf), model, tmp_path / "out")
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", "model.safetensors", "generation_config.json",
                     *TOKENIZER_FILES}
    for name in [*TOKENIZER_FILES, "generation_config.json"]:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    want = json.loads((source / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == want  # full depth: unchanged
    assert "lm_head.weight" not in _load_safetensors(out)  # tied
    # a checkpoint without tokenizer files: none appear
    plain = resolve_model(ModelConfig(path=str(checkpoints["mistral_untied"])))
    out2 = export_hf(megatron_state_dict(plain.hf), plain.hf, tmp_path / "plain")
    assert {p.name for p in out2.iterdir()} == {"config.json", "model.safetensors",
                                                "generation_config.json"}


def test_export_refuses_what_it_cannot_or_must_not_write(checkpoints, tmp_path):
    from varbatch_kit.train.model.hf_export import export_hf
    from varbatch_kit.train.model.hf_import import megatron_state_dict

    toy = resolve_model(ModelConfig())
    with pytest.raises(ValueError, match=r"toy GPT.*model\.path"):
        export_hf({}, toy, tmp_path / "toy")
    assert not (tmp_path / "toy").exists()
    source = checkpoints["llama_rope3_untied"]
    model = resolve_model(ModelConfig(path=str(source), num_layers=2))
    sd = megatron_state_dict(model.hf, 2)
    with pytest.raises(ValueError, match=r"num_layers=2.*3 layers"):
        export_hf(megatron_state_dict(model.hf), model, tmp_path / "depth")
    with pytest.raises(ValueError, match="source checkpoint"):
        export_hf(sd, model, source, overwrite=True)
    with pytest.raises(ValueError, match="model="):
        export_hf(sd, "not a model", tmp_path / "x")
    out = export_hf(sd, model, tmp_path / "out")
    with pytest.raises(ValueError, match=r"out_dir=.*not empty.*overwrite=True \(--overwrite"):
        export_hf(sd, model, out)
    moved = perturbed(sd, 1)
    export_hf(moved, model, out, overwrite=True)
    emb = _load_safetensors(out)["model.embed_tokens.weight"]
    assert torch.equal(emb, moved["embedding.word_embeddings.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporaries left
    with pytest.raises(ValueError, match="dtype="):
        export_hf(sd, model, tmp_path / "d", dtype="float8")
    half = export_hf(sd, model, tmp_path / "bf16", dtype="bfloat16")
    assert _load_safetensors(half)["model.norm.weight"].dtype == torch.bfloat16
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"


# --------------------------------------------------------------------------- a run's weights
def _run(folder, source, layers=2):
    from varbatch_kit.train import TrainConfig
    from varbatch_kit.train.runs.results import load_run

    cfg = TrainConfig(model=ModelConfig(path=None if source is None else str(source),
                                        num_layers=layers))
    return load_run(cfg, folder, float("nan"))


def test_run_export_hf_writes_the_final_or_a_chosen_steps_weights(checkpoints, tmp_path):
    source = checkpoints["qwen3_qknorm"]
    folder, states = run_folder(tmp_path / "a", source, params_at=(1, 3), ckpt_at=(2,))
    run = _run(folder, source)
    out = run.export_hf(tmp_path / "final")  # default: the final step (3), from params_step3.pt
    assert out == tmp_path / "final"
    assert equal(exported(out), states[3])
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert equal(exported(run.export_hf(tmp_path / "s2", step=2)), states[2])  # checkpoint
    assert equal(exported(run.export_hf(tmp_path / "s1", step=1)), states[1])  # params
    with pytest.raises(ValueError, match=r"step=4.*steps 1\.\.3"):
        run.export_hf(tmp_path / "s4", step=4)


def test_run_export_hf_from_the_newest_checkpoint_and_what_to_set_without_one(checkpoints,
                                                                             tmp_path):
    source = checkpoints["llama_rope3_untied"]
    folder, states = run_folder(tmp_path / "a", source, params_at=(), ckpt_at=(2, 3))
    assert equal(exported(_run(folder, source).export_hf(tmp_path / "o")), states[3])
    bare, _ = run_folder(tmp_path / "b", source, params_at=(1,), ckpt_at=(2,))
    with pytest.raises(ValueError, match=(
            r"no weights saved after step 3.*RunConfig\(save_params_at=\(3,\)\).*"
            r"CheckpointConfig\(save_every=N\).*params at steps \[1\].*checkpoints at steps "
            r"\[2\]")):
        _run(bare, source).export_hf(tmp_path / "none")
    assert not (tmp_path / "none").exists()
    toy, _ = run_folder(tmp_path / "toy", None)
    with pytest.raises(ValueError, match="toy GPT"):
        _run(toy, None).export_hf(tmp_path / "t")
