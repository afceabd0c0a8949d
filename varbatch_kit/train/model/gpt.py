"""The GPT: megatron-core ``GPTModel`` with the local (non-TransformerEngine) layer spec.

Two kinds, chosen by the run's model (a
:class:`~varbatch_kit.train.config.model_config.ResolvedModel`, read once by
:func:`~varbatch_kit.train.config.model_config.resolve_model`):

- the tiny toy GPT (``ModelConfig(path=None)``): LayerNorm, GeLU MLP, learned absolute
  positions, random initial weights from the torch CPU RNG;
- a Hugging Face checkpoint (``ModelConfig(path=DIR)``, Llama / Qwen2 / Qwen3 / Mistral):
  RMSNorm, SwiGLU, rotary embeddings with the config's ``rope_theta``,
  grouped-query attention, tied or untied embeddings, Qwen2's q/k/v biases,
  Qwen3's QK-norm, and the checkpoint's weights (the first ``num_layers``
  layers), see :mod:`varbatch_kit.train.config.hf_checkpoint`.

Both take their layer spec from :func:`layer_spec`. Requires megatron-core's
parallel state to be initialised (the training loop does it). On CPU,
activate :mod:`varbatch_kit.train.parallel.cpu_shim` first.
"""

from __future__ import annotations

import importlib.util

import torch

from varbatch_kit.train.config.model_config import ResolvedModel

__all__ = ["block_spec", "build_gpt", "layer_spec", "transformer_config", "unwrap_model",
           "wrap_precision"]


def layer_spec(*, normalization: str = "LayerNorm", qk_layernorm: bool = False,
               num_experts: int | None = None):
    """The transformer layer spec of every model built here (the one place that picks it).

    ``varbatch_kit.train.model.attention.local_layer_spec`` (per-sample core
    attention) when that module exists, else megatron-core's
    ``get_gpt_layer_local_spec``; both without TransformerEngine. ``num_experts``: a
    mixture-of-experts MLP (megatron's router and ``SequentialMLP`` experts).
    """
    if importlib.util.find_spec("varbatch_kit.train.model.attention") is not None:
        from varbatch_kit.train.model.attention import local_layer_spec
    else:  # pragma: no cover - the plain megatron spec, dense-mask attention
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec as local_layer_spec,
        )
    experts = dict(num_experts=num_experts, moe_grouped_gemm=False) if num_experts else {}
    return local_layer_spec(normalization=normalization, qk_layernorm=qk_layernorm, **experts)


def block_spec(layer, config, vp_stage: int | None = None):
    """The transformer block of one model chunk: ``layer`` (:func:`layer_spec`) for each layer
    this pipeline stage builds (megatron's count), and the final norm as
    :class:`~varbatch_kit.train.model.norms.TorchNorm` (megatron would pick
    ``WrappedTorchNorm``, which refuses sequence parallelism)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from varbatch_kit.train.model.norms import TorchNorm

    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=TorchNorm)


def _check(model) -> None:
    if not isinstance(model, ResolvedModel):
        raise ValueError(  # noqa: TRY004 - user errors are ValueError (docs/architecture.md)
            f"model={type(model).__name__}: give a ResolvedModel "
            "(varbatch_kit.train.config.model_config.resolve_model(ModelConfig(...)))")


def _common(per_token_loss: bool, precision: str, layout) -> dict:
    """TransformerConfig settings shared by both kinds: deterministic, built in float32 on
    CPU too (``precision="bf16"`` sets megatron's ``bf16``: :func:`wrap_precision` then
    casts the built model, whose weights were made or loaded in float32); the
    tensor-parallel size and sequence parallelism of the run's layout (None: neither)."""
    return dict(
        bf16=precision == "bf16",
        tensor_model_parallel_size=1 if layout is None else layout.tp,
        sequence_parallel=False if layout is None else layout.sp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        calculate_per_token_loss=per_token_loss,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cuda_graph_scope=[],  # megatron's own default "full" warns that it is deprecated
    )


def transformer_config(model: ResolvedModel, *, layout=None, per_token_loss: bool = False,
                       precision: str = "fp32"):
    """The megatron-core ``TransformerConfig`` of ``model``.

    No dropout (training must be deterministic and layout-independent), float32,
    CPU initialisation (so the initial weights are the same on CPU and GPU for a
    given seed, and under every tensor-parallel size: megatron draws the full
    master weight and keeps this rank's shard, :mod:`~varbatch_kit.train.parallel.tensor_parallel`);
    the tensor-parallel size is ``layout.tp`` and sequence parallelism ``layout.sp`` (a
    :class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`; None: 1, off).
    ``per_token_loss`` sets ``calculate_per_token_loss`` (Megatron's per-token
    path, used by the ``per_token`` report mode). For a checkpoint
    the shape, norms, MLP and attention options come from its ``config.json``
    (``model.hf``, read once); no random initialisation (the weights are loaded)
    unless tp > 1, where megatron marks its split parameters only when it
    initialises them.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    _check(model)
    tp = 1 if layout is None else layout.tp
    if model.is_toy:
        return TransformerConfig(
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            num_attention_heads=model.num_attention_heads,
            ffn_hidden_size=model.ffn_hidden_size,
            **_common(per_token_loss, precision, layout),
        )
    import torch.nn.functional as F

    spec = model.hf
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        # every parameter is overwritten by the checkpoint; under tensor parallelism megatron
        # marks its split parameters (tensor_model_parallel, partition_dim / stride: the grad
        # norm, the loader's and the gather's splits) only when it initialises them
        perform_initialization=tp > 1,
        **_moe(spec, precision, 1 if layout is None else layout.ep),
        **_common(per_token_loss, precision, layout),
    )


def _moe(spec, precision: str, ep: int = 1) -> dict:
    """The TransformerConfig fields of a mixture-of-experts checkpoint (none for a dense one):
    megatron's top-k router as transformers' Qwen3-MoE routes (softmax over the experts,
    the top k, renormalised to sum to 1 with ``norm_topk_prob``: megatron's softmax over the
    top-k logits is the same; without it the softmax over every expert, cut), in the
    model's dtype (float32, float64) and in float32 under bf16 (slime's
    ``--moe-router-dtype fp32``),
    SwiGLU experts of ``moe_intermediate_size``, tokens dispatched by all-to-all (megatron's
    default dispatcher refuses variable lengths). megatron's own load-balancing loss stays
    off: the engine computes the router's losses per sample from the router's logits
    (:mod:`~varbatch_kit.train.step.router_losses`), so that packing cannot move them."""
    if not spec.is_moe:
        return {}
    return dict(num_moe_experts=spec.num_experts, moe_router_topk=spec.moe_router_topk,
                expert_model_parallel_size=ep,
                moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
                moe_router_pre_softmax=not spec.moe_norm_topk_prob,
                moe_router_score_function="softmax",
                moe_router_dtype="fp32" if precision == "bf16" else None,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)


def build_gpt(model: ResolvedModel, *, max_seq_len: int, layout=None, world_rank: int = 0,
              per_token_loss: bool = False, precision: str = "fp32", config=None,
              stage: dict | None = None):
    """A ``GPTModel`` for ``model``, on the CPU.

    ``layout`` (the run's :class:`~varbatch_kit.train.config.parallel_layout.ParallelLayout`;
    None: no parallelism) and ``world_rank``: the tensor-parallel size the model is split
    into and the shard of the checkpoint's weights this rank holds.

    ``config`` replaces :func:`transformer_config`'s; ``stage`` (``pre_process``,
    ``post_process``, ``vp_stage``): one pipeline model chunk, built without
    weights of its own (:mod:`varbatch_kit.train.model.pipeline_stages` loads them).

    The toy model is initialised from the current torch CPU RNG state (call
    ``torch.manual_seed(seed)`` first for reproducible weights). A checkpoint
    model holds the checkpoint's weights of its first ``model.num_layers``
    layers; its rotary embeddings follow the forward's
    ``position_ids`` (restarting per packed sample).
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    if config is None:
        config = transformer_config(model, layout=layout, per_token_loss=per_token_loss,
                                    precision=precision)
    stage = dict(stage or {})
    vp_stage = stage.get("vp_stage")
    if model.is_toy:
        return GPTModel(
            config=config,  # per-sample attention (attention.py), torch norms (norms.py)
            transformer_layer_spec=block_spec(layer_spec(), config, vp_stage),
            vocab_size=model.vocab_size,
            max_sequence_length=max_seq_len,
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=False,
            parallel_output=True,
            **stage,
        )
    from varbatch_kit.train.model import hf_import, rope

    spec = model.hf
    if spec.is_moe:
        from varbatch_kit.train.parallel.megatron_import import moe_without_transformer_engine

        moe_without_transformer_engine()
    if spec.sliding_window is not None and max_seq_len > spec.sliding_window:
        raise ValueError(
            f"max_seq_len={max_seq_len} exceeds the sliding_window={spec.sliding_window} of "
            f"{spec.name}; sliding-window attention is not supported, keep sequences within "
            "the window (where it equals full causal attention)")
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(
            layer_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm,
                       num_experts=spec.num_experts or None), config, vp_stage),
        vocab_size=spec.vocab_size,
        max_sequence_length=max_seq_len,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        parallel_output=True,
        **stage,
    )
    rope.attach_position_ids_rope(gpt, spec)
    if not stage:
        tp_rank = 0 if layout is None else layout.coords(world_rank).tp_rank
        experts = None
        if spec.is_moe and layout is not None and layout.ep > 1:  # this rank's share
            from varbatch_kit.train.parallel.expert_parallel import local_experts

            experts = local_experts(spec.num_experts, layout, world_rank)
        hf_import.load_hf_weights(gpt, spec, model.num_layers, tp_rank=tp_rank,
                                  tp_size=1 if layout is None else layout.tp, experts=experts)
    return gpt


def wrap_precision(gpt, precision: str = "fp32"):
    """``gpt`` as the training step runs it: itself in fp32; under ``"fp64"`` itself cast to
    float64 in place (built and loaded in float32, so the cast is exact and every layout
    starts from the same weights; megatron's DDP buffers, the optimizer and its states
    then follow the parameters' dtype); under ``"bf16"`` megatron's ``Float16Module`` (the
    parameters cast to bfloat16, the forward's input in bf16 and the last stage's output
    back in float32), for megatron's mixed-precision optimizer, which keeps fp32 main
    parameters and gradients."""
    if precision == "fp32":
        return gpt
    if precision == "fp64":
        return gpt.double()
    if precision != "bf16":
        raise ValueError(f"precision={precision!r}: choose 'fp32', 'bf16' or 'fp64'")
    from megatron.core.transformer.module import Float16Module

    return Float16Module(gpt.config, gpt)


def unwrap_model(model):
    """The ``GPTModel`` inside megatron's DDP (or other ``.module``) wrappers."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    return model
