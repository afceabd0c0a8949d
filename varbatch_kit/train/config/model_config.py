"""The model of a run: :class:`ModelConfig` (what the user asks for, TrainConfig's
``model``), resolved once into a :class:`ResolvedModel`.

For a Hugging Face checkpoint, :func:`resolve_model` reads its ``config.json``
and its weights index (the safetensors headers: tensor -> file, shape) once,
checks them against the config's shape fields and keeps them; the model
builder (:mod:`~varbatch_kit.train.model.gpt`), the FLOPs shape (:attr:`ResolvedModel.shape`) and
the training data check use the result, so nothing reads ``config.json``
again (the weights themselves are read when the model is built). The launcher
resolves every configuration's model before any worker starts and hands the
result to the workers. For the toy GPT the unset shape fields get
:data:`~varbatch_kit.train.config.model_config.TOY_DEFAULTS`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from varbatch_kit.core.flops import ModelShape
from varbatch_kit.train.config.field_checks import documented as _f
from varbatch_kit.train.config.field_checks import need_int

__all__ = ["TOY_DEFAULTS", "ModelConfig", "ResolvedModel", "resolve_model"]


#: the toy GPT's shape for the fields left unset when ``ModelConfig.path`` is None
TOY_DEFAULTS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 64}


@dataclass(frozen=True)
class ModelConfig:
    """The model (megatron-core ``GPTModel``, local layer spec).

    ``path=None`` (default): the tiny toy GPT (random init, learned absolute
    positions), shape fields default to :data:`TOY_DEFAULTS` and
    ``ffn_hidden_size`` to ``4 * hidden_size``. Or a local Hugging Face
    checkpoint directory (Llama, Qwen2, Qwen3, Mistral): the shape comes from
    its ``config.json`` (read once, by
    :func:`~varbatch_kit.train.config.model_config.resolve_model`),
    ``num_layers`` keeps the first N layers, the other shape fields may be
    left unset and must match the checkpoint when given. The path is stored
    absolute. Resolved shape values: ``resolve_model(ModelConfig(...))``.
    """

    path: str | None = _f(None, "a local Hugging Face checkpoint directory (Llama/Qwen2/Qwen3/"
                                "Mistral); default: the tiny toy GPT")
    num_layers: int | None = _f(None, "layers (toy GPT: 2; checkpoint: all of them, or keep the "
                                      "first N)")
    hidden_size: int | None = _f(None, "hidden width (toy GPT: 64; checkpoint: its own)")
    num_attention_heads: int | None = _f(None, "attention heads (toy GPT: 4; checkpoint: its own)")
    ffn_hidden_size: int | None = _f(None, "FFN width (toy GPT: 4 * hidden_size)")
    vocab_size: int | None = _f(None, "vocabulary size (toy GPT: 64; checkpoint: its own)")
    max_seq_len: int | None = _f(None, "longest sequence (default: the longest sample of the "
                                       "rollouts)")

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "vocab_size", "max_seq_len"):
            need_int("model", name, getattr(self, name), 1, optional=True)
        if self.path is not None:
            if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
                raise ValueError(f"model.path={self.path!r}: give a checkpoint directory path "
                                 "or None (the toy GPT)")
            object.__setattr__(self, "path", os.path.abspath(os.path.expanduser(self.path)))
            return
        hidden = self.hidden_size or TOY_DEFAULTS["hidden_size"]
        heads = self.num_attention_heads or TOY_DEFAULTS["num_attention_heads"]
        if hidden % heads:
            raise ValueError(f"model.hidden_size={hidden} is not divisible by "
                             f"model.num_attention_heads={heads}; pick a multiple")


@dataclass(frozen=True)
class ResolvedModel:
    """A :class:`ModelConfig` with every shape value known.

    ``hf_config``: the checkpoint's parsed ``config.json`` (None for the toy GPT);
    ``hf``: its validated :class:`~varbatch_kit.train.config.hf_checkpoint.HFModelSpec`, which
    holds the
    weights index (``hf.tensors``: name -> (safetensors file, shape)).
    """

    config: ModelConfig
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    hf_config: dict[str, Any] | None = field(default=None, repr=False)
    hf: Any = field(default=None, repr=False)

    @property
    def is_toy(self) -> bool:
        return self.hf is None

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts checkpoint (routers and experts in its MLPs)."""
        return self.hf is not None and self.hf.is_moe

    @property
    def path(self) -> str | None:
        return self.config.path

    @property
    def max_seq_len(self) -> int | None:
        return self.config.max_seq_len

    @property
    def weights_index(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """Tensor name -> (safetensors file name, shape); None for the toy GPT."""
        return None if self.hf is None else dict(self.hf.tensors)

    @property
    def shape(self) -> ModelShape:
        """The shape for FLOPs-balanced packings and distributions (the kept ``num_layers``)."""
        if self.hf is None:
            return ModelShape(num_layers=self.num_layers, hidden_size=self.hidden_size,
                              num_attention_heads=self.num_attention_heads,
                              ffn_hidden_size=self.ffn_hidden_size, vocab_size=self.vocab_size,
                              name="varbatch-tiny-gpt", gated_mlp=False, norm="layernorm",
                              linear_bias=True, position_embedding="learned",
                              learned_positions=self.max_seq_len or 0)
        shape = ModelShape.from_hf_config(self.hf_config)
        name = Path(self.path).name
        if self.num_layers != shape.num_layers:
            name += f" (first {self.num_layers} of {shape.num_layers} layers)"
        return replace(shape, num_layers=self.num_layers, name=name)


def resolve_model(config: ModelConfig) -> ResolvedModel:
    """Read ``config``'s checkpoint (``config.json`` and the weights index) once and fill in
    the shape; ValueError naming what is wrong (a missing or unsupported checkpoint, a shape
    field that conflicts with it, more layers than it has)."""
    if not isinstance(config, ModelConfig):
        raise ValueError(  # noqa: TRY004 - user errors are ValueError (docs/architecture.md)
            f"model={config!r}: give a ModelConfig")
    if config.path is None:
        values = {k: getattr(config, k) or v for k, v in TOY_DEFAULTS.items()}
        return ResolvedModel(config=config, ffn_hidden_size=config.ffn_hidden_size
                             or 4 * values["hidden_size"], **values)
    from varbatch_kit.train.config import hf_checkpoint as hf

    p = Path(config.path)
    if not p.is_dir():
        hf.read_hf_model(p)  # raises the message naming what is wrong and what is supported
    hf_config = hf.read_config_json(p)
    spec = hf.spec_from_config(p.resolve(), hf_config, hf.checkpoint_tensors(p))
    num_layers = config.num_layers
    if num_layers is None:
        num_layers = spec.num_layers
    elif num_layers > spec.num_layers:
        raise ValueError(
            f"model.num_layers={num_layers}, but {spec.name} has {spec.num_layers} layers; "
            f"keep at most {spec.num_layers} (num_layers=N keeps the first N)")
    for name in ("hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size"):
        given, value = getattr(config, name), getattr(spec, name)
        if given is not None and given != value:
            raise ValueError(
                f"model.{name}={given} conflicts with the checkpoint {spec.name} ({name}="
                f"{value}); leave it unset with model.path")
    return ResolvedModel(config=config, num_layers=num_layers, hidden_size=spec.hidden_size,
                         num_attention_heads=spec.num_attention_heads,
                         ffn_hidden_size=spec.ffn_hidden_size, vocab_size=spec.vocab_size,
                         hf_config=hf_config, hf=spec)
