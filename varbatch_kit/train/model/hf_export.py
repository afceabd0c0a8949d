"""megatron-core weights back to a Hugging Face checkpoint that ``transformers`` loads.

The inverse of :mod:`varbatch_kit.train.config.hf_checkpoint`'s mapping (its module docstring has
the
table): a full, unsharded megatron-core state dict (``GPTModel.named_parameters()``
names -> tensors, as rank 0 saves them in ``params_stepN.pt`` and in a checkpoint's
``model.pt``) becomes the tensors of the input checkpoint's family:

- ``self_attention.linear_qkv`` is split per query group (each group's query heads,
  its key head, its value head) into ``q_proj``, ``k_proj``, ``v_proj``, and so are
  its biases (Qwen2);
- ``mlp.linear_fc1`` = ``[gate; up]`` is split into ``gate_proj`` and ``up_proj``; a
  mixture of experts: ``mlp.router`` -> the family's router (Qwen3-MoE ``mlp.gate``,
  Mixtral ``block_sparse_moe.gate``), each expert's ``linear_fc1`` / ``linear_fc2`` -> its
  gate / up / down projections (Mixtral: ``w1`` / ``w3`` / ``w2``);
- the norms (Qwen3's ``q_norm`` / ``k_norm`` too), ``o_proj``, ``down_proj`` and the
  embeddings keep their values; ``lm_head`` is written only when the embeddings are
  untied.

:func:`export_hf` writes a checkpoint folder: ``config.json`` (the input's, with
``num_hidden_layers`` set to the trained depth when the model was truncated, and
the dtype written), ``model.safetensors``, and the tokenizer and generation files
of the input checkpoint when it has them (:data:`COPIED_FILES`). The folder appears
whole (written beside it, then renamed). The toy GPT has no Hugging Face form: a
``ValueError``. Tensor- or pipeline-parallel shards would be gathered into one full
state dict before this (the engine keeps every parameter whole on every rank).

:meth:`varbatch_kit.train.runs.results.Run.export_hf` and ``varbatch-kit export RUN_DIR OUT_DIR``
find a run's trained weights and call this.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from varbatch_kit.train.config.hf_checkpoint import HFModelSpec, read_config_json

__all__ = ["COPIED_FILES", "export_hf", "hf_state_dict", "source_spec"]

#: files of the input checkpoint copied into the export when present (glob patterns):
#: the tokenizer in its usual forms, the chat template, the generation defaults
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
                "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
                "generation_config.json")
_DTYPES = ("float32", "bfloat16", "float16")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _layer_names(spec: HFModelSpec, i: int) -> list[str]:
    dst = f"decoder.layers.{i}."
    names = [dst + s for s in ("input_layernorm.weight", "pre_mlp_layernorm.weight",
                               "self_attention.linear_qkv.weight",
                               "self_attention.linear_proj.weight")]
    if spec.is_moe:
        names.append(dst + "mlp.router.weight")
        names += [dst + f"mlp.experts.local_experts.{e}.linear_fc{k}.weight"
                  for e in range(spec.num_experts) for k in (1, 2)]
    else:
        names += [dst + "mlp.linear_fc1.weight", dst + "mlp.linear_fc2.weight"]
    if spec.qkv_bias:
        names.append(dst + "self_attention.linear_qkv.bias")
    if spec.qk_norm:
        names += [dst + "self_attention.q_layernorm.weight",
                  dst + "self_attention.k_layernorm.weight"]
    return names


def _megatron_shapes(spec: HFModelSpec, n: int) -> dict[str, tuple[int, ...]]:
    """Every megatron-core parameter of the first ``n`` layers and its shape."""
    h, d, f, v = spec.hidden_size, spec.kv_channels, spec.ffn_hidden_size, spec.vocab_size
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    per_layer = {"input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
                 "self_attention.linear_qkv.weight": (q + 2 * kv, h),
                 "self_attention.linear_qkv.bias": (q + 2 * kv,),
                 "self_attention.q_layernorm.weight": (d,),
                 "self_attention.k_layernorm.weight": (d,),
                 "self_attention.linear_proj.weight": (h, q),
                 "mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f),
                 "mlp.router.weight": (spec.num_experts, h),
                 "mlp.experts.linear_fc1.weight": (2 * spec.moe_ffn_hidden_size, h),
                 "mlp.experts.linear_fc2.weight": (h, spec.moe_ffn_hidden_size)}
    shapes = {"embedding.word_embeddings.weight": (v, h), "decoder.final_layernorm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["output_layer.weight"] = (v, h)
    for i in range(n):
        for name in _layer_names(spec, i):
            key = re.sub(r"\.local_experts\.\d+\.", ".", name.split(".", 3)[3])
            shapes[name] = per_layer[key]
    return shapes


def _depth(state: Mapping[str, Any], spec: HFModelSpec) -> int:
    """The number of layers the state dict holds (layers 0..n-1, at most the checkpoint's)."""
    found = sorted({int(m.group(1)) for k in state if (m := _LAYER.match(k))})
    if not found or found != list(range(len(found))) or len(found) > spec.num_layers:
        shown = ", ".join(map(str, found)) or "none"
        raise ValueError(f"state dict: it holds decoder layers {shown}; a model of "
                         f"{spec.name} needs layers 0..n-1 for some n <= {spec.num_layers} "
                         f"(the checkpoint has {spec.num_layers} layers)")
    return len(found)


def _split_qkv(fused, spec: HFModelSpec):
    """Inverse of :func:`varbatch_kit.train.model.hf_import._fused_qkv`: per query group, its query
    heads, then its key head, then its value head."""
    g, d = spec.num_query_groups, spec.kv_channels
    per_group = spec.num_attention_heads // g * d
    grouped = fused.reshape(g, per_group + 2 * d, *fused.shape[1:])
    q, k, v = grouped.split([per_group, d, d], dim=1)
    rest = fused.shape[1:]
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def hf_state_dict(state: Mapping[str, Any], spec: HFModelSpec) -> dict[str, Any]:
    """The Hugging Face tensors (names with the checkpoint's prefix) of a megatron-core state
    dict of a model built for ``spec``; the number of layers is the state dict's.

    ``state`` maps every ``GPTModel.named_parameters()`` name to a full tensor; megatron's
    ``*._extra_state`` entries are ignored. ValueError naming a missing, unexpected or
    misshapen tensor. The tensors keep their dtype and are fresh (no shared storage).
    """
    import torch

    weights = {k: v for k, v in state.items() if not k.endswith("._extra_state")}
    n = _depth(weights, spec)
    shapes = _megatron_shapes(spec, n)
    missing = [k for k in shapes if k not in weights]
    unexpected = sorted(set(weights) - set(shapes))
    if missing or unexpected:
        what = []
        if missing:
            what.append(f"lacks {len(missing)} tensor(s): {', '.join(missing[:5])}")
        if unexpected:
            what.append(f"has unexpected tensor(s): {', '.join(unexpected[:5])}")
        raise ValueError(f"state dict: {'; '.join(what)} (a {spec.family} model of {spec.name} "
                         f"with {n} layer(s), tie_word_embeddings={spec.tie_word_embeddings})")
    for name, want in shapes.items():
        got = tuple(weights[name].shape)
        if got != want:
            raise ValueError(f"state dict: {name} has shape {list(got)}, a model of "
                             f"{spec.name} needs {list(want)}")

    def t(name: str):
        return weights[name].detach().to("cpu").clone().contiguous()

    p = spec.prefix
    out = {f"{p}embed_tokens.weight": t("embedding.word_embeddings.weight"),
           f"{p}norm.weight": t("decoder.final_layernorm.weight")}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = t("output_layer.weight")
    f = spec.ffn_hidden_size
    for i in range(n):
        src, dst = f"decoder.layers.{i}.", f"{p}layers.{i}."
        att = dst + "self_attn."
        out[dst + "input_layernorm.weight"] = t(src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = t(src + "pre_mlp_layernorm.weight")
        qkv = _split_qkv(t(src + "self_attention.linear_qkv.weight"), spec)
        for x, tensor in zip("qkv", qkv):
            out[att + f"{x}_proj.weight"] = tensor
        if spec.qkv_bias:
            qkv = _split_qkv(t(src + "self_attention.linear_qkv.bias"), spec)
            for x, tensor in zip("qkv", qkv):
                out[att + f"{x}_proj.bias"] = tensor
        if spec.qk_norm:
            out[att + "q_norm.weight"] = t(src + "self_attention.q_layernorm.weight")
            out[att + "k_norm.weight"] = t(src + "self_attention.k_layernorm.weight")
        out[att + "o_proj.weight"] = t(src + "self_attention.linear_proj.weight")
        if spec.is_moe:  # the router, then each expert's [gate; up] and down
            out[spec.moe_tensor(i, "router")] = t(src + "mlp.router.weight")
            fe = spec.moe_ffn_hidden_size
            for e in range(spec.num_experts):
                mine = f"{src}mlp.experts.local_experts.{e}."
                gate, up = torch.split(t(mine + "linear_fc1.weight"), [fe, fe], dim=0)
                out[spec.moe_tensor(i, "gate", e)] = gate.contiguous()
                out[spec.moe_tensor(i, "up", e)] = up.contiguous()
                out[spec.moe_tensor(i, "down", e)] = t(mine + "linear_fc2.weight")
            continue
        gate, up = torch.split(t(src + "mlp.linear_fc1.weight"), [f, f], dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate.contiguous()
        out[dst + "mlp.up_proj.weight"] = up.contiguous()
        out[dst + "mlp.down_proj.weight"] = t(src + "mlp.linear_fc2.weight")
    return out


def source_spec(model: Any) -> HFModelSpec:
    """The input checkpoint of ``model`` (a ResolvedModel or an HFModelSpec); ValueError for
    the toy GPT, which has none, and for anything else."""
    return _spec_and_config(model)[0]


def _spec_and_config(model: Any) -> tuple[HFModelSpec, dict[str, Any], int | None]:
    """``(spec, parsed config.json, kept layers or None)`` of a ResolvedModel or HFModelSpec."""
    from varbatch_kit.train.config.model_config import ResolvedModel

    if isinstance(model, ResolvedModel):
        if model.is_toy:
            raise ValueError(
                "model: the toy GPT (model.path=None) has no Hugging Face checkpoint to export "
                "to; train a checkpoint's model (model.path=DIR: a Llama, Qwen2, Qwen3 or "
                "Mistral checkpoint) to export it")
        return model.hf, dict(model.hf_config), model.num_layers
    if isinstance(model, HFModelSpec):
        return model, read_config_json(model.path), None
    raise ValueError(f"model={model!r}: give the run's ResolvedModel "
                     "(resolve_model(ModelConfig(path=DIR, ...))) or an HFModelSpec "
                     "(read_hf_model(DIR))")


def _config_json(cfg: dict[str, Any], spec: HFModelSpec, n: int, dtype: str) -> dict[str, Any]:
    cfg = dict(cfg)
    if n != cfg.get("num_hidden_layers"):
        cfg["num_hidden_layers"] = n
        if isinstance(cfg.get("layer_types"), list):  # transformers 5: one entry per layer
            cfg["layer_types"] = cfg["layer_types"][:n]
    cfg["dtype"] = dtype  # transformers 5's name; 4 reads torch_dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    return cfg


def _check_out_dir(out: Path, spec: HFModelSpec, overwrite: bool) -> None:
    if out.resolve() == spec.path.resolve():
        raise ValueError(f"out_dir={str(out)!r} is the source checkpoint {spec.path}; "
                         "export into another folder")
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir={str(out)!r} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"out_dir={str(out)!r} is not empty; give a new or empty folder, or "
                         "overwrite=True (--overwrite on the command line) to replace it")


def export_hf(state: Mapping[str, Any], model: Any, out_dir: str | os.PathLike, *,
              dtype: str | None = None, overwrite: bool = False) -> Path:
    """Write ``state`` (a full megatron-core state dict) as a Hugging Face checkpoint folder.

    ``model``: the run's :class:`~varbatch_kit.train.config.model_config.ResolvedModel` (its
    ``num_layers`` must be the state dict's) or the input's
    :class:`~varbatch_kit.train.config.hf_checkpoint.HFModelSpec`. ``dtype``: ``"float32"``,
    ``"bfloat16"`` or ``"float16"`` for the written tensors (default: the state dict's
    own, float32 for the engine's weights); config.json says it, so
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads them as written. An occupied
    ``out_dir`` is replaced only with ``overwrite=True``; the input checkpoint's folder
    never. Returns the folder.
    """
    import torch
    from safetensors.torch import save_file

    spec, cfg, kept = _spec_and_config(model)
    out = Path(out_dir).expanduser()
    _check_out_dir(out, spec, overwrite)
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: one of {_DTYPES} (or None: the state dict's)")
    tensors = hf_state_dict(state, spec)
    n = _depth({k: v for k, v in state.items() if not k.endswith("._extra_state")}, spec)
    if kept is not None and kept != n:
        raise ValueError(f"model: num_layers={kept}, but the state dict holds {n} layers; "
                         "pass the model the weights were trained with")
    if dtype is None:
        kinds = {v.dtype for v in tensors.values()}
        if len(kinds) != 1:
            raise ValueError(f"state dict: mixed dtypes {sorted(map(str, kinds))}; pass dtype=")
        dtype = str(kinds.pop()).removeprefix("torch.")
    else:
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(
            json.dumps(_config_json(cfg, spec, n, dtype), indent=2) + "\n")
        for name in COPIED_FILES:
            if (spec.path / name).is_file():
                shutil.copyfile(spec.path / name, tmp / name)
        if out.exists():
            trash = out.parent / f".trash-{out.name}-{os.getpid()}"
            os.replace(out, trash)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
