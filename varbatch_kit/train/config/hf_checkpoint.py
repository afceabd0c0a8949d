"""A Hugging Face checkpoint read and checked, without torch: its ``config.json`` (Llama,
Qwen2, Qwen3, Mistral, Qwen3-MoE or Mixtral family; rope scaling), the safetensors headers
(tensor -> file, shape) and the tensor names and shapes the family's config implies, as one
:class:`HFModelSpec`. :mod:`~varbatch_kit.train.model.hf_import` maps the weights themselves
into megatron-core.

This module imports only the standard library (reading and validating a checkpoint needs
neither torch nor safetensors).
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "SUPPORTED_FAMILIES",
    "HFModelSpec",
    "checkpoint_tensors",
    "hf_tensor_names",
    "read_config_json",
    "read_hf_model",
    "spec_from_config",
]

#: ``model_type`` of config.json -> family name used in messages
SUPPORTED_FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
                      "qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral"}
#: the mixture-of-experts families (every layer's MLP a top-k routed set of SwiGLU experts):
#: a layer's router tensor, then expert ``{e}``'s gate, up and down projections (the names
#: transformers writes to disk)
MOE_FAMILIES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                  "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
}
ROPE_TYPES = ("default", "linear", "llama3")
_SUPPORTED = ", ".join(f"{v} (model_type={k!r})" for k, v in SUPPORTED_FAMILIES.items())


@dataclass(frozen=True)
class HFModelSpec:
    """What a checkpoint directory holds, read from its ``config.json`` and safetensors headers.

    ``num_layers`` is the checkpoint's own layer count (a config may keep fewer).
    ``tensors`` maps every stored tensor name to ``(file name, shape)``.
    """

    path: Path
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_parameters: Mapping[str, Any]
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    max_position_embeddings: int | None
    sliding_window: int | None
    prefix: str
    tensors: Mapping[str, tuple[str, tuple[int, ...]]] = field(repr=False)
    # a mixture-of-experts model (Qwen3-MoE): experts per layer (0: dense MLPs), experts per
    # token, an expert's SwiGLU width, and whether the top-k router weights are renormalised
    # to sum to 1 (``norm_topk_prob``; else the softmax over every expert, cut to the top k)
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def moe_tensor(self, i: int, which: str, e: int = 0) -> str:
        """Layer ``i``'s checkpoint tensor ``which`` (``"router"``, ``"gate"``, ``"up"``,
        ``"down"``) of expert ``e``, by the family's names (:data:`MOE_FAMILIES`)."""
        names = dict(zip(("router", "gate", "up", "down"), MOE_FAMILIES[self.model_type]))
        return f"{self.prefix}layers.{i}." + names[which].format(e=e)

    @property
    def family(self) -> str:
        return SUPPORTED_FAMILIES[self.model_type]

    @property
    def name(self) -> str:
        return self.path.name


# --------------------------------------------------------------------------- reading
def _fail(path: Path, what: str) -> ValueError:
    return ValueError(f"model={str(path)!r}: {what}")


def _safetensors_header(file: Path) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file (8-byte little-endian length, then JSON)."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError(f"{file} is not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is not a safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return header


def checkpoint_tensors(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint directory: name -> (safetensors file name, shape).

    Reads only the files' headers. A sharded checkpoint
    (``model.safetensors.index.json``) lists its shards; otherwise every
    ``*.safetensors`` file of the directory is read.
    """
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise _fail(path, "holds no *.safetensors weights (a Hugging Face checkpoint directory "
                          "has config.json and model.safetensors or safetensors shards)")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise _fail(path, f"the index names the shard {name!r}, which is missing")
        for tensor, meta in _safetensors_header(file).items():
            out[tensor] = (name, tuple(int(s) for s in meta["shape"]))
    return out


def _rope(cfg: Mapping[str, Any], path: Path) -> tuple[float, str, dict[str, Any]]:
    """``(theta, rope_type, parameters)`` of a transformers 5 (``rope_parameters``) or 4 config."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise _fail(path, f"rope_type={rope_type!r} is not supported; supported: {ROPE_TYPES}")
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise _fail(path, f"partial_rotary_factor={partial}: only full rotary embeddings "
                          "(1.0) are supported")
    need = {"linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings")}.get(rope_type, ())
    missing = [k for k in need if k not in params]
    if missing:
        raise _fail(path, f"rope_type={rope_type!r} needs {missing} in rope_parameters")
    return float(theta), rope_type, params


def hf_tensor_names(spec: HFModelSpec, num_layers: int | None = None) -> list[str]:
    """The checkpoint tensors the first ``num_layers`` layers (default: all) are built from."""
    n = spec.num_layers if num_layers is None else num_layers
    p = spec.prefix
    names = [f"{p}embed_tokens.weight", f"{p}norm.weight"]
    if not spec.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(n):
        lp = f"{p}layers.{i}."
        names += [lp + s for s in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight")]
        if spec.is_moe:  # the router, then each expert's SwiGLU
            names.append(spec.moe_tensor(i, "router"))
            names += [spec.moe_tensor(i, w, e)
                      for e in range(spec.num_experts) for w in ("gate", "up", "down")]
        else:
            names += [lp + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")]
        if spec.qkv_bias:
            names += [lp + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if spec.qk_norm:
            names += [lp + "self_attn.q_norm.weight", lp + "self_attn.k_norm.weight"]
    return names


def _expected_shapes(spec: HFModelSpec) -> dict[str, tuple[int, ...]]:
    h, d = spec.hidden_size, spec.kv_channels
    q, kv, f = spec.num_attention_heads * d, spec.num_query_groups * d, spec.ffn_hidden_size
    return {
        "embed_tokens.weight": (spec.vocab_size, h), "lm_head.weight": (spec.vocab_size, h),
        "norm.weight": (h,), "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
        **_moe_shapes(spec),
    }


def _moe_shapes(spec: HFModelSpec) -> dict[str, tuple[int, ...]]:
    """The router's and an expert's tensors (expert number ``E``: :func:`_shape_key`)."""
    if not spec.is_moe:
        return {}
    h, f = spec.hidden_size, spec.moe_ffn_hidden_size
    router, gate, up, down = (n.format(e="E") for n in MOE_FAMILIES[spec.model_type])
    return {router: (spec.num_experts, h), gate: (f, h), up: (f, h), down: (h, f)}


def _shape_key(name: str) -> str:
    parts = name.split(".")
    if "layers" in parts:
        parts = parts[parts.index("layers") + 2:]
        if "experts" in parts[:2]:  # any expert: E (MOE_FAMILIES' names)
            k = parts.index("experts") + 1
            parts = [*parts[:k], "E", *parts[k + 1:]]
    elif parts[0] == "model":
        parts = parts[1:]
    return ".".join(parts)


@functools.lru_cache(maxsize=16)
def _read_cached(path: str, stamp: tuple) -> HFModelSpec:
    return _read(Path(path))


def read_hf_model(path: str | Path) -> HFModelSpec:
    """Read and validate a Hugging Face checkpoint directory (config.json + safetensors).

    Raises ``ValueError`` naming the problem and what is supported: a missing
    directory or ``config.json``, an unsupported family or feature (MoE,
    biases outside q/k/v, an activation other than SiLU, an unknown rope
    type), missing tensors or tensors of the wrong shape. Reads no weights.
    """
    p = Path(path).expanduser()
    if not p.is_dir():
        what = "is a file, not a directory" if p.exists() else "does not exist"
        raise _fail(p, f"{what}; pass a local Hugging Face checkpoint directory (config.json "
                       f"and *.safetensors) of a supported family: {_SUPPORTED}")
    p = p.resolve()
    stamp = tuple(sorted((f.name, f.stat().st_mtime_ns, f.stat().st_size)
                         for f in p.iterdir() if f.suffix == ".json" or f.suffix == ".safetensors"))
    return _read_cached(str(p), stamp)


def read_config_json(p: Path) -> dict[str, Any]:
    """The checkpoint directory's ``config.json`` as a dict (ValueError naming what is wrong)."""
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise _fail(p, "has no config.json; pass a Hugging Face checkpoint directory")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise _fail(p, f"config.json is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(p, "config.json does not hold a JSON object")
    return cfg


def _read(p: Path) -> HFModelSpec:
    return spec_from_config(p, read_config_json(p), checkpoint_tensors(p))


def spec_from_config(p: Path, cfg: Mapping[str, Any],
                     tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> HFModelSpec:
    """Validate a parsed ``config.json`` and the weights index (:func:`checkpoint_tensors`)
    of the checkpoint directory ``p``; reads no file."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_FAMILIES:
        arch = cfg.get("architectures")
        raise _fail(p, f"model_type={model_type!r} (architectures={arch}) is not supported; "
                       f"supported families: {_SUPPORTED}")

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise _fail(p, f"config.json lacks {key!r}")
        return cfg[key]

    moe = _moe_fields(p, cfg, model_type)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(p, f"hidden_act={act!r}: only SwiGLU ('silu') MLPs are supported")
    if cfg.get("mlp_bias"):
        raise _fail(p, "mlp_bias=true is not supported (MLPs without biases only)")
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias
    else:
        if cfg.get("attention_bias"):
            raise _fail(p, f"attention_bias=true ({SUPPORTED_FAMILIES[model_type]} then has an "
                           "o_proj bias too) is not supported; q/k/v biases are supported for "
                           "Qwen2")
        qkv_bias = False
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    groups = int(cfg.get("num_key_value_heads") or heads)
    if heads % groups:
        raise _fail(p, f"num_key_value_heads={groups} does not divide "
                       f"num_attention_heads={heads}")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, rope_type, rope_params = _rope(cfg, p)
    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if "model.embed_tokens.weight" in tensors:
        prefix = "model."
    elif "embed_tokens.weight" in tensors:
        prefix = ""
    else:
        raise _fail(p, "its safetensors hold no model.embed_tokens.weight; is it a "
                       f"*ForCausalLM checkpoint of a supported family ({_SUPPORTED})?")
    spec = HFModelSpec(
        path=p, model_type=model_type, num_layers=int(need("num_hidden_layers")),
        hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=head_dim, ffn_hidden_size=int(need("intermediate_size")),
        vocab_size=int(need("vocab_size")), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_type=rope_type, rope_parameters=rope_params,
        # transformers' Llama/Qwen2/Qwen3/Mistral configs default to untied embeddings
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias, qk_norm=model_type in ("qwen3", "qwen3_moe"),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        sliding_window=int(window) if window else None, prefix=prefix, tensors=tensors, **moe,
    )
    _check_tensors(spec)
    return spec


def _moe_fields(p: Path, cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The HFModelSpec fields of a mixture-of-experts config (none for a dense one); refuses
    the MoE features the engine does not build, naming them."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get(
        "n_routed_experts")
    if model_type not in MOE_FAMILIES:
        if experts:
            dense = ", ".join(v for k, v in SUPPORTED_FAMILIES.items() if k not in MOE_FAMILIES)
            raise _fail(p, f"a mixture-of-experts {model_type!r} checkpoint is not supported: "
                           "the engine builds Qwen3-MoE and Mixtral experts; "
                           f"dense {dense}")
        return {}
    width = cfg.get("moe_intermediate_size") if model_type == "qwen3_moe" else cfg.get(
        "intermediate_size")  # Mixtral: every MLP is an expert of intermediate_size
    if not experts or not cfg.get("num_experts_per_tok") or not width:
        raise _fail(p, f"a {model_type} config.json needs num_experts (or num_local_experts), "
                       "num_experts_per_tok and the experts' width (moe_intermediate_size; "
                       "Mixtral: intermediate_size)")
    if float(cfg.get("router_jitter_noise") or 0.0) > 0.0:
        raise _fail(p, f"router_jitter_noise={cfg['router_jitter_noise']}: the engine routes "
                       "without noise (set it to 0)")
    sparse_step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_layers = list(cfg.get("mlp_only_layers") or [])
    if sparse_step != 1 or dense_layers:
        raise _fail(p, f"decoder_sparse_step={sparse_step}, mlp_only_layers={dense_layers}: "
                       "only models whose every layer is a mixture of experts are supported "
                       "(decoder_sparse_step=1, no mlp_only_layers)")
    if int(cfg["num_experts_per_tok"]) > int(experts):
        raise _fail(p, f"num_experts_per_tok={cfg['num_experts_per_tok']} exceeds the "
                       f"{experts} experts")
    return {"num_experts": int(experts), "moe_router_topk": int(cfg["num_experts_per_tok"]),
            "moe_ffn_hidden_size": int(width),
            # Mixtral renormalises its top-k softmax weights, as Qwen3-MoE's norm_topk_prob
            "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", True))}


def _check_tensors(spec: HFModelSpec) -> None:
    names = hf_tensor_names(spec)
    missing = [n for n in names if n not in spec.tensors]
    if missing:
        shown = ", ".join(missing[:6]) + (f", ... ({len(missing)} in all)"
                                          if len(missing) > 6 else "")
        raise _fail(spec.path, f"its safetensors lack {len(missing)} tensor(s) that a "
                               f"{spec.family} model of this config.json needs: {shown}")
    shapes = _expected_shapes(spec)
    for n in names:
        want, got = shapes[_shape_key(n)], spec.tensors[n][1]
        if want != got:
            raise _fail(spec.path, f"tensor {n} has shape {list(got)}, config.json implies "
                                   f"{list(want)}")


# --------------------------------------------------------------------------- weights






