"""`ModelShape`: the fields a forward-FLOPs estimate needs, and the estimate.

The estimate follows slime's ``calculate_fwd_flops`` (docs/reference_semantics.md §4):
per layer QKV, causal attention, output projection and a gated MLP, plus the
LM head once per sample. Dense, GQA, MoE and multi-latent attention (MLA).
All arithmetic is vectorised float64 (no int64 overflow at long lengths).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from varbatch_kit.checks import positive_int
from varbatch_kit.resources import data_dir

__all__ = ["ModelShape", "MODELS_DIR", "as_model_shape", "available_presets"]

#: ModelShape fields the FLOPs estimate does not read (the name, the layer's make-up)
_MEMORY_ONLY = frozenset({"name", "gated_mlp", "norm", "linear_bias", "qkv_bias", "qk_norm",
                          "tied_embeddings", "position_embedding", "learned_positions"})

#: the model presets shipped with the package (``data/models``)
MODELS_DIR = Path(str(data_dir("models")))


@dataclass(frozen=True)
class ModelShape:
    """Shape of a transformer for FLOPs estimation (Megatron field names).

    ``num_query_groups`` defaults to ``num_attention_heads`` (plain MHA) and
    ``kv_channels`` to ``hidden_size // num_attention_heads``.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    # mixture of experts
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int = 1
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | tuple[int, ...] | None = None
    # multi-latent attention
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    name: str = "custom"
    # the layer's make-up, for the memory model (varbatch_kit.core.memory); the FLOPs estimate
    # reads none of it: a gated (SwiGLU) MLP, RMSNorm, no biases, untied embeddings and rotary
    # positions (every preset), or the engine's toy GPT (GeLU, LayerNorm, biases, a learned
    # position table of ``learned_positions`` rows: ``position_embedding="learned"``)
    gated_mlp: bool = True
    norm: str = "rmsnorm"
    linear_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    tied_embeddings: bool = False
    position_embedding: str = "rope"
    learned_positions: int = 0

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "vocab_size"):
            positive_int(f"ModelShape.{f}", getattr(self, f))
        if self.norm not in ("rmsnorm", "layernorm"):
            raise ValueError(f"ModelShape.norm={self.norm!r}: choose 'rmsnorm' or 'layernorm'")
        if self.position_embedding not in ("rope", "learned"):
            raise ValueError(f"ModelShape.position_embedding={self.position_embedding!r}: "
                             "choose 'rope' or 'learned'")
        if not isinstance(self.learned_positions, int) or self.learned_positions < 0:
            raise ValueError(f"ModelShape.learned_positions={self.learned_positions!r}: give "
                             "the rows of the learned position table (0 without one)")
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels is None:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if isinstance(self.moe_layer_freq, list):
            object.__setattr__(self, "moe_layer_freq", tuple(self.moe_layer_freq))
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            raise ValueError(
                f"ModelShape(num_experts={self.num_experts}) needs moe_ffn_hidden_size"
            )
        if isinstance(self.moe_layer_freq, tuple) and len(self.moe_layer_freq) != self.num_layers:
            raise ValueError(
                f"moe_layer_freq has {len(self.moe_layer_freq)} entries but num_layers = "
                f"{self.num_layers}: give one 0/1 entry per layer, or an int frequency"
            )
        if self.multi_latent_attention:
            for f in ("qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                if getattr(self, f) is None:
                    raise ValueError(f"multi_latent_attention=True needs ModelShape.{f}")

    # ------------------------------------------------------------- layer mix
    def moe_layers(self) -> np.ndarray:
        """Boolean per layer: True where the layer is a mixture-of-experts layer."""
        if self.num_experts is None:
            return np.zeros(self.num_layers, dtype=bool)
        freq = self.moe_layer_freq
        if freq is None:
            return np.ones(self.num_layers, dtype=bool)
        if isinstance(freq, tuple):
            return np.asarray(freq, dtype=int) > 0
        return np.arange(self.num_layers) % int(freq) == 0

    # --------------------------------------------------------------- FLOPs
    def _attention_flops(self, L: np.ndarray) -> np.ndarray:
        """QKV projections plus attention (QK^T causal and A.V) for one layer."""
        h, a = float(self.hidden_size), float(self.num_attention_heads)
        if self.multi_latent_attention:
            qd = float(self.qk_head_dim + self.qk_pos_emb_head_dim)
            vd = float(self.v_head_dim)
            if self.q_lora_rank is not None:
                q = 2 * L * self.q_lora_rank * (h + a * qd)
            else:
                q = 2 * L * h * a * qd
            if self.kv_lora_rank is not None:
                kv = 2 * L * (
                    self.kv_lora_rank * (h + a * (self.qk_head_dim + vd))
                    + h * self.qk_pos_emb_head_dim
                )
            else:
                kv = 2 * 2 * L * h * float(self.num_query_groups) * float(self.kv_channels)
            attn = 2 * a * L * L * qd / 2 + a * L * L * vd
            return q + kv + attn
        d, g = float(self.kv_channels), float(self.num_query_groups)
        qkv = 2 * L * h * a * d + 2 * 2 * L * h * g * d
        attn = 2 * a * L * L * d / 2 + a * L * L * d
        return qkv + attn

    def _layer_flops(self, L: np.ndarray, ffn: int) -> np.ndarray:
        h = float(self.hidden_size)
        proj = 2 * L * h * h
        mlp = 2 * L * h * float(ffn) * 3
        return self._attention_flops(L) + proj + mlp

    def moe_ffn_width(self) -> int:
        """FFN width a token sees in an MoE layer: routed top-k plus shared experts."""
        shared = self.moe_shared_expert_intermediate_size or 0
        return int(self.moe_ffn_hidden_size) * int(self.moe_router_topk) + int(shared)

    def forward_flops_terms(self, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dense layers, MoE layers, LM head)`` forward FLOPs per sample, float64.

        :meth:`forward_flops` adds them in this order, the order slime's
        estimate accumulates them in.
        """
        L = np.asarray(lengths, dtype=np.float64)
        moe = self.moe_layers()
        n_moe = int(moe.sum())
        n_dense = self.num_layers - n_moe
        zero = np.zeros_like(L)
        dense = self._layer_flops(L, self.ffn_hidden_size) * n_dense if n_dense else zero
        moe_part = self._layer_flops(L, self.moe_ffn_width()) * n_moe if n_moe else zero
        return dense, moe_part, 2 * L * float(self.hidden_size) * float(self.vocab_size)

    def forward_flops(self, lengths) -> np.ndarray:
        """Forward FLOPs per sample of the given token lengths (float64 array).

        Accepts a scalar or any array-like; returns the same shape.
        """
        dense, moe, head = self.forward_flops_terms(lengths)
        return dense + moe + head

    def flops_coefficients(self) -> tuple[float, float]:
        """``(c1, c2)`` with ``forward_flops(L) == c1*L + c2*L**2`` (the model is quadratic)."""
        f1, f2 = self.forward_flops(np.array([1.0, 2.0]))
        c2 = (f2 - 2 * f1) / 2
        return float(f1 - c2), float(c2)

    # ---------------------------------------------------------- constructors
    @classmethod
    def preset(cls, name: str) -> ModelShape:
        """A shape preset shipped with the package (a Hugging Face ``config.json``); see
        :func:`available_presets`."""
        path = MODELS_DIR / f"{name}.json"
        if not path.is_file():
            raise ValueError(
                f"unknown model preset {name!r}; available: {', '.join(available_presets())}"
            )
        return replace(cls.from_hf_config(path), name=name)

    @classmethod
    def from_hf_config(cls, path_or_dict: str | Path | Mapping[str, Any]) -> ModelShape:
        """Read a Hugging Face ``config.json`` (Qwen2/Qwen3/Llama/Mistral/DeepSeek-V3 names)."""
        if isinstance(path_or_dict, Mapping):
            cfg = dict(path_or_dict)
            src = "config dict"
        else:
            src = str(path_or_dict)
            try:
                cfg = json.loads(Path(path_or_dict).read_text())
            except FileNotFoundError:
                raise ValueError(f"model config {src!r} does not exist") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"model config {src!r} is not valid JSON: {e}") from None

        def need(key: str):
            if key not in cfg:
                raise ValueError(f"{src} lacks {key!r}, needed for the FLOPs model")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kw: dict[str, Any] = dict(
            num_layers=int(need("num_hidden_layers")),
            hidden_size=hidden,
            num_attention_heads=heads,
            ffn_hidden_size=int(need("intermediate_size")),
            vocab_size=int(need("vocab_size")),
            num_query_groups=int(cfg.get("num_key_value_heads") or heads),
            kv_channels=int(cfg.get("head_dim") or hidden // heads),
            name=str(cfg.get("_name_or_path") or cfg.get("model_type") or "custom"),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias") or cfg.get("model_type") == "qwen2"),
            qk_norm=cfg.get("model_type") in ("qwen3", "qwen3_moe"),
        )
        n_experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get(
            "num_local_experts")
        if n_experts:
            kw["num_experts"] = int(n_experts)
            kw["moe_ffn_hidden_size"] = int(
                cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
            kw["moe_router_topk"] = int(
                cfg.get("num_experts_per_tok") or cfg.get("moe_router_topk") or 1)
            n_shared = cfg.get("n_shared_experts")
            if n_shared:
                kw["moe_shared_expert_intermediate_size"] = int(n_shared) * kw[
                    "moe_ffn_hidden_size"]
            elif cfg.get("shared_expert_intermediate_size"):
                kw["moe_shared_expert_intermediate_size"] = int(
                    cfg["shared_expert_intermediate_size"])
            first_dense = int(cfg.get("first_k_dense_replace") or 0)
            step = int(cfg.get("moe_layer_freq") or cfg.get("decoder_sparse_step") or 1)
            n = kw["num_layers"]
            if first_dense or step != 1:
                kw["moe_layer_freq"] = tuple(
                    int(i >= first_dense and (i - first_dense) % step == 0) for i in range(n)
                )
        if cfg.get("kv_lora_rank") is not None or cfg.get("qk_rope_head_dim") is not None:
            kw.update(
                multi_latent_attention=True,
                q_lora_rank=cfg.get("q_lora_rank"),
                kv_lora_rank=cfg.get("kv_lora_rank"),
                qk_head_dim=int(need("qk_nope_head_dim")),
                qk_pos_emb_head_dim=int(need("qk_rope_head_dim")),
                v_head_dim=int(need("v_head_dim")),
            )
        return cls(**kw)

    @classmethod
    def from_args(cls, args: Any) -> ModelShape:
        """From a Megatron/slime argument namespace (``args.num_layers``, ...)."""

        def get(key, default=None):
            return getattr(args, key, default)

        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        if heads is None or hidden is None or get("num_layers") is None:
            raise ValueError(
                "args needs num_layers, hidden_size and num_attention_heads for the FLOPs model"
            )
        groups = get("num_query_groups") if get("group_query_attention", True) else None
        freq = get("moe_layer_freq")
        vocab = get("vocab_size") or get("padded_vocab_size")
        if vocab is None:
            raise ValueError("args needs vocab_size (or padded_vocab_size) for the FLOPs model")
        return cls(
            num_layers=int(get("num_layers")),
            hidden_size=int(hidden),
            num_attention_heads=int(heads),
            ffn_hidden_size=int(get("ffn_hidden_size") or 4 * hidden),
            vocab_size=int(vocab),
            num_query_groups=groups,
            kv_channels=get("kv_channels"),
            num_experts=get("num_experts"),
            moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
            moe_router_topk=int(get("moe_router_topk") or 1),
            moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size"),
            moe_layer_freq=tuple(freq) if isinstance(freq, (list, tuple)) else freq,
            multi_latent_attention=bool(get("multi_latent_attention", False)),
            q_lora_rank=get("q_lora_rank"),
            kv_lora_rank=get("kv_lora_rank"),
            qk_head_dim=get("qk_head_dim"),
            qk_pos_emb_head_dim=get("qk_pos_emb_head_dim"),
            v_head_dim=get("v_head_dim"),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def flops_fields(self) -> dict[str, Any]:
        """The fields the FLOPs estimate reads (the shape without its name and the layer's
        make-up the memory model adds): equal for two descriptions of the same model."""
        return {k: v for k, v in asdict(self).items() if k not in _MEMORY_ONLY}


def available_presets() -> list[str]:
    """Names accepted by :meth:`ModelShape.preset`."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def as_model_shape(model: ModelShape | str | Path, *, name: str = "model") -> ModelShape:
    """``model`` as a :class:`ModelShape`: itself, a preset by name
    (:func:`available_presets`), or the path of a Hugging Face ``config.json``. ``name``: the
    argument's name in the error (``"--model"`` on the command line)."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, (str, Path)):
        if str(model) in available_presets():
            return ModelShape.preset(str(model))
        if Path(model).suffix == ".json" or Path(model).exists():
            return ModelShape.from_hf_config(model)
        raise ValueError(f"{name} {str(model)!r} is neither a preset "
                         f"({', '.join(available_presets())}) nor a config.json path")
    raise ValueError(f"{name} must be a ModelShape, a preset name or a config.json path, got "
                     f"{type(model).__name__}")
