"""Per-rank memory of a training schedule: what each rank holds, its peak per step, and why.

Pure (numpy): no torch import. For a :class:`~varbatch_kit.core.schedule.Schedule`, a
:class:`~varbatch_kit.core.flops.ModelShape` and a :class:`MemoryLayout` (dp, cp and its
implementation, tp with or without sequence parallelism, pp / vpp with the schedule's
micro-batch order, precision, recomputation, distributed optimizer, log-prob chunking),
:func:`predict_memory` gives, per step and world rank, the bytes of each kind and the peak:

- **static** (held all step): parameters, the gradient buffer (megatron's DDP ``main_grad``),
  the optimizer's fp32 main parameters (bf16 only) and Adam's two moments, all of this
  rank's model shard (``/ tp``; its pipeline stage's layers), the optimizer's part divided
  over the ``dp * cp`` pool under the distributed optimizer. Adam's moments exist from the
  first optimizer step on, so step 1 is predicted without them until its update.
- **activations** of the micro-batches in flight: the tensors autograd keeps for the
  backward, listed tensor by tensor below; with pipelining a stage keeps those of every
  micro-batch it has run forward and not yet backward (1F1B: up to ``pp - stage`` of them,
  in the schedule's order; interleaved: megatron's warm-up count per stage).
- **logits** of the last stage, while a micro-batch's loss runs: the output layer runs on
  the response rows only (the engine's ``response_logits``), ``[R, V / tp]`` in the activation
  dtype (plus megatron's fp32 copy under bf16), and the token statistics' float32 work:
  three ``[chunk, V / tp]`` tensors (``chunked``) or a full log-softmax and its gradient.
- **CP's gathered K/V** (all-gather context parallelism): each layer keeps the K/V of the
  whole row (the group's longest share times the degree) for its backward.
- **backward**: the working set on top of everything saved where a micro-batch's backward
  peaks: the output layer's (logits' gradient, dense ``[V / tp, h]`` weight gradient), the
  last layer's MLP (fc2's input gradient and weight gradient; gated: the two factors'
  gradients), or, on the first stage, the word embedding's dense ``[V / tp, h]`` gradient
  (not on the engine's fp32 / fp64 CPU runs, which add its rows into ``main_grad``);
  sequence parallelism's all-gather buffer (megatron's global memory buffer) on top.

Activations, per layer and per token this rank holds (``T / cp`` under all-gather CP;
``s = tp`` under sequence parallelism, else 1; ``q = heads * kv_channels``, ``kv = groups *
kv_channels``; elements of the activation dtype unless said), as autograd saves them in the
engine's megatron-core local layer (listed with ``torch.autograd.graph.saved_tensors_hooks``
on the toy GPT and on Llama, Qwen2 and Qwen3 checkpoints; flash attention on CPU and GPU, so
no ``L^2`` term; no dropout, so no masks; cf. Korthikanti et al. 2022, Table 2, whose
``34 sbh`` is a list of the same kind at ``f = 4h`` in fp16 with dropout masks and the
``5 a s^2 b`` attention scores):

===========================================  ==========================  ==================
tensor                                        elements / token             kept by
===========================================  ==========================  ==================
each norm's input (the residual stream)       ``h / s``                    the norm
RMSNorm's normalised input (fp32 at least)    ``h / s``                    the norm's weight
each norm's output                            ``h / s``                    the next linear
norm statistics (fp32)                        ``(2 or 1) / s`` per norm    the norm
query, key, value (copies per sample)         ``(q + 2 kv) / tp``          core attention
attention output; projection input            ``q / tp`` each              attention; proj
flash attention's log-sum-exp (fp32)          ``heads / tp``               core attention
rotary cos and sin (query, key)               ``4 kv_channels``            the rotation
fc1 output; GeLU output                       ``f / tp`` each              GeLU; fc2
SwiGLU: fc1 (2f), activation, up, product     ``5 f / tp``                 SiLU, x; fc2
===========================================  ==========================  ==================

A micro-batch of one sample attends through views of the QKV output, so a rotary model
keeps the rotated query and key beside it (``+ (q + kv) / tp``); QK-norm keeps the QKV
output, the query norm's input and normalised copy and the key's normalised copy. Each
stage also keeps its last layer's output (the final norm's input, or what it sends on).
A mixture-of-experts layer (every layer, no shared experts, tp 1: Qwen3-MoE, Mixtral) keeps
instead of the MLP's list: per token the router's top-k indices and probabilities and its
``[E]`` routing map and probabilities, the dispatcher's permutation, the engine's router
losses' float64 softmax; per routed copy (``k`` per token) the permuted token and its
expert's gated MLP (:func:`_moe_bytes_per_token`); its parameters are the router and this
rank's ``E / ep`` experts. Under expert parallelism a rank's experts hold the copies of its
group's micro-batches of the round, predicted for balanced routing (a random router sends one
rank ~10 % more: ``tests/integration/test_train_memory.py`` judges each step's busiest rank
there).
Recomputation: ``full`` keeps only each layer's input and one layer's list at a time;
``selective`` drops the attention's terms, recomputed in the backward (neither is run by
the engine, so neither is checked against it). :func:`activation_bytes_per_token` is the
one place the list is counted; ``tests/integration/test_train_memory.py`` checks the whole
prediction against the peaks the engine measures, every rank of every step, within 10 %.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd

from varbatch_kit.checks import positive_int
from varbatch_kit.core.flops import ModelShape

__all__ = ["MemoryLayout", "PRECISION_BYTES", "activation_bytes_per_token", "check_modelled",
           "micro_batch_memory", "not_modelled", "parameter_count", "predict_memory",
           "static_memory"]

#: bytes per element: parameters, gradient buffer, optimizer main copy, Adam state, activations
PRECISION_BYTES = {
    "fp32": {"param": 4, "grad": 4, "main": 0, "state": 4, "act": 4},
    "bf16": {"param": 2, "grad": 4, "main": 4, "state": 4, "act": 2},
    "fp64": {"param": 8, "grad": 8, "main": 0, "state": 8, "act": 8},
}
RECOMPUTE = ("none", "selective", "full")
CP_IMPLS = ("allgather", "emulated")
LOGPROBS = ("chunked", "full")
#: float32 logits per chunk of the token statistics (report.objective.token_stats)
CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class MemoryLayout:
    """The settings memory depends on besides the model and the schedule.

    ``sequence_parallel`` None: on when ``tp > 1`` (the engine's default). ``cp_impl``:
    ``allgather`` (each CP rank holds its share of the row and the gathered K/V) or
    ``emulated`` (every CP rank runs the whole row). ``logprobs``: the token statistics in
    float32 chunks (``chunked``, the engine) or a full-vocabulary log-softmax kept for the
    backward (``full``). ``mb_group``: the interleaved schedule's micro-batches per group
    (default ``pp``). ``embedding_grad_rows``: the word embedding's gradient goes row by row
    into the gradient buffer (the engine's CPU runs in fp32 / fp64), not through a dense
    ``[V / tp, h]`` table (torch's embedding backward: GPUs, bf16).
    """

    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    sequence_parallel: bool | None = None
    cp_impl: str = "allgather"
    precision: str = "fp32"
    recompute: str = "none"
    distributed_optimizer: bool = False
    logprobs: str = "chunked"
    mb_group: int | None = None
    embedding_grad_rows: bool = False
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tp", "pp", "vpp", "ep"):
            positive_int(f"MemoryLayout.{name}", getattr(self, name))
        if self.pool % self.ep:
            raise ValueError(f"MemoryLayout.ep={self.ep} does not divide dp * cp = {self.pool}")
        for name, allowed in (("precision", tuple(PRECISION_BYTES)), ("recompute", RECOMPUTE),
                              ("cp_impl", CP_IMPLS), ("logprobs", LOGPROBS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"MemoryLayout.{name}={getattr(self, name)!r}: choose one of "
                                 f"{', '.join(allowed)}")
        if self.sequence_parallel is None:
            object.__setattr__(self, "sequence_parallel", self.tp > 1)
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"MemoryLayout.vpp={self.vpp} needs pp > 1")

    @property
    def pool(self) -> int:
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def bytes(self) -> dict[str, int]:
        return PRECISION_BYTES[self.precision]

    def stage_layers(self, model: ModelShape) -> list[int]:
        """Layers per pipeline stage (megatron's even split over ``pp * vpp`` chunks)."""
        chunks = self.pp * self.vpp
        if model.num_layers % chunks:
            raise ValueError(f"{model.num_layers} layers do not split evenly over pp * vpp = "
                             f"{chunks} model chunks")
        return [model.num_layers // self.pp] * self.pp


# ------------------------------------------------------------------------------ coverage
def _is_moe(model: ModelShape) -> bool:
    return bool(model.num_experts)


def not_modelled(model: ModelShape, layout: MemoryLayout | None = None) -> str | None:
    """Why this model's memory cannot be predicted here, or None. The terms above are a
    transformer's with grouped-query attention and either dense MLPs or, in every layer, a
    mixture of experts without shared experts (Qwen3-MoE, Mixtral: the router, the routed
    experts, the dispatched tokens; below). Multi-latent attention (its low-rank projections),
    shared experts, layers that mix dense and MoE MLPs, and a mixture of experts under tensor
    parallelism (megatron's dispatcher gathers the tokens over the TP ranks) would be
    mis-counted (DeepSeek-V3 as a dense model: 39 billion parameters instead of 671), so they
    are refused rather than under-predicted."""
    kinds = []
    if _is_moe(model):
        freq = model.moe_layer_freq
        if model.moe_shared_expert_intermediate_size:
            kinds.append("shared experts")
        if freq not in (None, 1) and not (isinstance(freq, tuple) and all(freq)):
            kinds.append("layers mixing dense and mixture-of-experts MLPs")
        if layout is not None and layout.tp > 1:
            kinds.append(f"a mixture of experts under tensor parallelism (tp={layout.tp})")
    if model.multi_latent_attention:
        kinds.append("multi-latent attention")
    if not kinds:
        return None
    return (f"the memory model covers dense transformers and mixtures of experts in every "
            f"layer without shared experts; {model.name!r} has {' and '.join(kinds)}, which it "
            "would mis-count: no memory prediction for it yet")


def check_modelled(model: ModelShape, layout: MemoryLayout | None = None) -> None:
    """``ValueError`` when :func:`not_modelled` gives a reason."""
    why = not_modelled(model, layout)
    if why is not None:
        raise ValueError(why)


# ------------------------------------------------------------------------------ static
def _expert_params(m: ModelShape, ep: int) -> float:
    """One MoE layer's routed experts on an expert-parallel rank: ``E / ep`` MLPs of
    ``moe_ffn_hidden_size`` (gated: ``[gate; up]`` and down)."""
    if not _is_moe(m):
        return 0.0
    up = 2 if m.gated_mlp else 1
    f = m.moe_ffn_hidden_size
    return m.num_experts / ep * (m.hidden_size * up * f + f * m.hidden_size)


def _layer_params(m: ModelShape, tp: int, ep: int = 1) -> float:
    h, q, kv, f = m.hidden_size, m.num_attention_heads * m.kv_channels, \
        m.num_query_groups * m.kv_channels, m.ffn_hidden_size
    up = 2 if m.gated_mlp else 1
    norm = 2 * h if m.norm == "layernorm" else h  # weight (and bias)
    # the MLP: dense, or (a mixture of experts) the router's [E, h] and this rank's experts
    mlp = (m.num_experts * h + _expert_params(m, ep)) if _is_moe(m) else h * up * f + f * h
    n = (h * (q + 2 * kv) + q * h + mlp) / tp
    if m.linear_bias or m.qkv_bias:
        n += (q + 2 * kv) / tp
    if m.linear_bias:
        n += h + up * f / tp + h  # proj and fc2 biases are whole on every TP rank
    n += 2 * norm
    if m.qk_norm:
        n += 2 * m.kv_channels
    return n


def parameter_count(model: ModelShape, layout: MemoryLayout, pp_rank: int = 0) -> int:
    """Parameters one rank of pipeline stage ``pp_rank`` holds (its tensor-parallel shard)."""
    check_modelled(model, layout)
    m, tp = model, layout.tp
    n = _layer_params(m, tp, layout.ep) * layout.stage_layers(m)[pp_rank]
    h, v = m.hidden_size, m.vocab_size / tp
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    if first:
        n += v * h + (m.learned_positions if m.position_embedding == "learned" else 0) * h
    if last:
        n += 2 * h if m.norm == "layernorm" else h  # the final norm
        if not m.tied_embeddings or not first:  # tied under pp: the last stage keeps a copy
            n += v * h
    return int(round(n))


def static_memory(model: ModelShape, layout: MemoryLayout, pp_rank: int = 0) -> dict[str, int]:
    """Bytes a rank holds all step: ``params``, ``grads`` (the gradient buffer) and
    ``optimizer`` (fp32 main parameters under bf16 and Adam's two moments; divided over
    the ``dp * cp`` pool under the distributed optimizer)."""
    n = parameter_count(model, layout, pp_rank)
    b = layout.bytes
    return {"params": n * b["param"], "grads": n * b["grad"],
            "optimizer": _optimizer_elements(model, layout, pp_rank) * (b["main"] + 2 * b["state"])}


def _optimizer_elements(model: ModelShape, layout: MemoryLayout, pp_rank: int) -> int:
    """The parameters whose optimizer state a rank holds: all of its own, or under the
    distributed optimizer its shard, the dense ones over the ``dp * cp`` pool and the experts
    over their ``dp * cp / ep`` replicas (megatron's expert-data-parallel group)."""
    n = parameter_count(model, layout, pp_rank)
    if not layout.distributed_optimizer:
        return n
    experts = int(round(_expert_params(model, layout.ep) / layout.tp
                        * layout.stage_layers(model)[pp_rank]))
    return (int(np.ceil((n - experts) / layout.pool))
            + int(np.ceil(experts / (layout.pool // layout.ep))))


# ------------------------------------------------------------------------- activations
def activation_bytes_per_token(model: ModelShape, layout: MemoryLayout, *,
                               one_sample: bool = False) -> dict[str, float]:
    """Bytes one layer keeps for its backward per token this rank holds, as ``residual``
    (the two norms: their input, RMSNorm's normalised copy, their output; divided by tp
    under sequence parallelism), ``attention`` and ``mlp``. ``one_sample``: the micro-batch
    is one sample (core attention then reads views of the QKV output instead of per-sample
    copies, and a rotary model keeps the rotated query and key beside it). The terms are
    those autograd saves in the engine's layer (the module docstring's table)."""
    check_modelled(model, layout)
    m = model
    act = layout.bytes["act"]
    s = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
    tp = layout.tp
    h, heads, groups, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.kv_channels
    q, kv, f = heads * d, groups * d, m.ffn_hidden_size
    if m.norm == "layernorm":  # input and output (mean, rstd in fp32)
        norm = 2 * h / s * act + 2 * 4 / s
    else:  # RMSNorm as torch composes it: input and normalised input, in float32 at least
        # (bf16 is upcast), the output in the activation dtype, rstd in float32
        norm = (2 * max(act, 4) + act) * h / s + 4 / s
    rope = m.position_embedding == "rope"
    qkv = q + 2 * kv  # per-sample copies, or views of the QKV output
    extra_f32 = heads  # flash attention's log-sum-exp
    if rope and one_sample:
        qkv += q + kv  # the rotated query and key
    if rope and m.qk_norm:
        # the QKV output (the key norm's input views it), the query norm's input and
        # normalised copy, the key's normalised copy; their rstd in fp32
        qkv += (q + 2 * kv) + 2 * q + kv
        extra_f32 += heads + groups
        if one_sample:
            qkv -= q + 2 * kv  # the value then views the QKV output already counted
    attention = (qkv + 2 * q) / tp * act + extra_f32 / tp * 4  # + output, projection input
    if rope:
        attention += 4 * d * act  # cos and sin of the positions, for the query and the key
    mlp = (5 if m.gated_mlp else 2) * f / tp * act
    if _is_moe(m):
        mlp = _moe_bytes_per_token(m, layout)
    return {"residual": 2 * norm, "attention": attention, "mlp": mlp}


def _moe_bytes_per_token(m: ModelShape, layout: MemoryLayout) -> float:
    """A mixture-of-experts MLP's saved bytes per token (tp 1; listed with
    ``saved_tensors_hooks`` on a Qwen3-MoE layer of the engine, megatron's top-k router,
    all-to-all dispatcher and SequentialMLP). Each token goes to ``k`` experts: its ``k``
    copies, permuted, are kept by the experts' first linear (``k h``); each copy's gated
    MLP keeps ``[gate; up]`` (2 f), the activation, the up half, their product and the
    product scaled by the routing probability (6 f; 3 f ungated). The router keeps the
    top-k indices (int64) and probabilities, the ``[E]`` routing map (bool) and
    probabilities; the dispatcher the permutation (int64) and the permuted probabilities.
    The engine's router losses (train/step/router_losses.py) recompute the logits and keep
    their float64 softmax, a float64 copy for the log-sum-exp and its result, and each
    token's sample index. The routed copies are :func:`_routed_bytes_per_token` (under
    expert parallelism held per token of the expert-parallel group's round)."""
    act = layout.bytes["act"]
    router = 4 if layout.precision == "bf16" else act  # megatron's fp32 router under bf16
    k, e = m.moe_router_topk, m.num_experts
    routing = k * (8 + router + 8 + router) + e * (1 + router)
    losses = e * 16 + 8 + 8 + 8
    return _routed_bytes_per_token(m, layout) + routing + losses


def _routed_bytes_per_token(m: ModelShape, layout: MemoryLayout) -> float:
    """The experts' share of :func:`_moe_bytes_per_token`: ``k`` routed copies of a token,
    each kept by its expert's first linear and gated MLP. Under expert parallelism these are
    held by whichever rank holds the expert: a rank's experts receive the copies of its
    expert-parallel group's micro-batches of the same round, ``k`` per token of their mean
    (:func:`micro_batch_memory`'s ``routed_tokens``)."""
    if not _is_moe(m):
        return 0.0
    k, h, f = m.moe_router_topk, m.hidden_size, m.moe_ffn_hidden_size
    return k * (h + (6 if m.gated_mlp else 3) * f) * layout.bytes["act"]


@dataclass(frozen=True)
class MicroBatchShare:
    """What one rank holds of one micro-batch: its ``tokens`` (the CP share of the row),
    the ``row_tokens`` whose K/V all-gather CP gathers (the group's longest share times
    the degree), its ``response_rows`` (logit rows it computes), whether the row is
    ``one_sample``, and the micro-batch's ``cp_size``."""

    tokens: int
    row_tokens: int
    response_rows: int
    one_sample: bool
    cp_size: int = 1


def _zigzag_shares(total: np.ndarray, prompt: np.ndarray, size: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Per CP rank of ``size``: (tokens, response rows) it holds of these samples: two chunks
    of ``ceil(L / 2 size)`` each (chunks ``rank`` and ``2 size - 1 - rank``), its response
    rows those at positions ``prompt - 1 .. L - 2`` inside them."""
    chunk = -(-total // (2 * size))  # [n]
    ranks = np.arange(size)[:, None]
    tokens = np.zeros(size, dtype=np.int64)
    rows = np.zeros(size, dtype=np.int64)
    for k in (ranks, 2 * size - 1 - ranks):  # [size, 1] chunk ids
        a, b = np.minimum(k * chunk, total), np.minimum((k + 1) * chunk, total)
        tokens += (b - a).sum(axis=1)
        rows += np.maximum(np.minimum(b, total - 1) - np.maximum(a, prompt - 1), 0).sum(axis=1)
    return tokens, rows


def micro_batch_share(total_len, prompt_len, *, cp_size: int = 1, cp_rank: int = 0,
                      cp_impl: str = "allgather") -> MicroBatchShare:
    """:class:`MicroBatchShare` of the samples with these total and prompt lengths on CP
    rank ``cp_rank`` of ``cp_size`` (``cp_impl="emulated"``: every CP rank holds the row)."""
    total = np.asarray(total_len, dtype=np.int64)
    prompt = np.asarray(prompt_len, dtype=np.int64)
    row = int(total.sum())
    if cp_size == 1 or cp_impl == "emulated":
        return MicroBatchShare(row, row, row - int(prompt.sum()), total.size == 1, cp_size)
    tokens, rows = _zigzag_shares(total, prompt, cp_size)
    return MicroBatchShare(int(tokens[cp_rank]), int(tokens.max()) * cp_size,
                           int(rows[cp_rank]), total.size == 1, cp_size)


def _cp_shares(total: np.ndarray, prompt: np.ndarray, cp_size: int, cp_impl: str
               ) -> list[MicroBatchShare]:
    """:func:`micro_batch_share` of one micro-batch for each of its ``cp_size`` CP ranks."""
    total = np.asarray(total, dtype=np.int64)
    prompt = np.asarray(prompt, dtype=np.int64)
    if cp_size == 1 or cp_impl == "emulated":
        return [micro_batch_share(total, prompt, cp_size=cp_size, cp_impl=cp_impl)] * cp_size
    tokens, rows = _zigzag_shares(total, prompt, cp_size)
    gathered = int(tokens.max()) * cp_size
    return [MicroBatchShare(int(tokens[r]), gathered, int(rows[r]), total.size == 1, cp_size)
            for r in range(cp_size)]


def micro_batch_memory(model: ModelShape, layout: MemoryLayout, mb: MicroBatchShare, *,
                       layers: int, last: bool, first: bool = False,
                       routed_tokens: float | None = None) -> dict[str, float]:
    """Bytes of one micro-batch on one rank of a pipeline stage with ``layers`` layers
    (``routed_tokens``: a mixture of experts under expert parallelism, the mean tokens of the
    expert-parallel group's micro-batches of this round, whose routed copies this rank's
    experts hold; default this micro-batch's own):

    - ``activations``: kept from its forward to its backward (:func:`activation_bytes_per_token`
      per layer, and the last layer's output: the final norm's input or the tensor sent to
      the next stage; the final norm's statistics);
    - ``cp_kv``: the K/V all-gather CP gathered, per layer;
    - ``logits`` (last stage): live while the loss runs: the response rows' hidden states
      and logits (``[R, V / tp]``; under bf16 also megatron's float32 copy) and the token
      statistics' float32 work: three ``[chunk, V / tp]`` tensors (``chunked``) or the
      log-softmax and its gradient (``full``);
    - ``backward``: the backward's working set at its peak, in the last layer's MLP: the
      gradient of ``linear_fc2``'s input ``[T, f / tp]``, its weight gradient (gated: the
      two factors' gradients), under sequence parallelism the gathered ``[T, h]`` input it
      re-gathers, and on a stage before the last the received output gradient;
    - ``output`` (last stage): the output layer's backward: the logits' gradient, the dense
      ``[V / tp, h]`` weight gradient and the rows' input gradient;
    - ``embedding`` (first stage, without ``embedding_grad_rows``): the word embedding's
      dense ``[V / tp, h]`` gradient and the gradient of its output;
    - ``gather_buffer``: sequence parallelism's all-gather buffer (megatron's global memory
      buffer, ``[T, h]``, kept by the process at its largest size).
    """
    c = _coefficients(model, layout, layers, last, first, mb.one_sample)
    t, r = mb.tokens, mb.response_rows
    gathered = mb.cp_size > 1 and layout.cp_impl == "allgather"
    logits = 0.0
    if last:
        logits = c["logits_r"] * r + c["logits_chunk"] * min(r, c["chunk"])
    routed = t if routed_tokens is None else routed_tokens
    return {"activations": c["acts_t"] * t + c["routed_t"] * routed,
            "cp_kv": c["kv_row"] * mb.row_tokens if gathered else 0.0,
            "logits": logits,
            "backward": max(c["mlp_t"] * t + c["mlp_0"], c["glu_t"] * t) + c["bw_t"] * t,
            "output": c["output_r"] * r + c["output_0"],
            "embedding": c["embedding_0"] + c["embedding_t"] * t,
            "gather_buffer": c["buffer_t"] * t}


@lru_cache(maxsize=1024)
def _coefficients(m: ModelShape, layout: MemoryLayout, layers: int, last: bool, first: bool,
                  one_sample: bool) -> dict[str, float]:
    """:func:`micro_batch_memory`'s bytes as coefficients of the tokens ``t``, response rows
    ``r`` and gathered rows (each term's derivation beside it)."""
    act = layout.bytes["act"]
    sp = layout.sequence_parallel and layout.tp > 1
    s = layout.tp if sp else 1
    tp = layout.tp
    h = m.hidden_size
    per = activation_bytes_per_token(m, layout, one_sample=one_sample)
    full_layer = sum(per.values())
    if layout.recompute == "full":
        acts = layers * h / s * act + full_layer
    elif layout.recompute == "selective":
        acts = layers * (per["residual"] + per["mlp"])
    else:
        acts = layers * full_layer
    acts += h / s * act  # the last layer's output: the final norm's input, or sent on
    # a mixture of experts: the experts' part, held per routed token (micro_batch_memory)
    routed_t = (1 if layout.recompute == "full" else layers) * _routed_bytes_per_token(m, layout)
    acts -= routed_t
    kv = m.num_query_groups * m.kv_channels
    kv_row = (1 if layout.recompute == "full" else layers) * 2 * kv / tp * act
    v = m.vocab_size / tp
    logits_r = logits_chunk = output_r = output_0 = 0.0
    chunk = 0
    if last:
        # the final norm's statistics (RMSNorm: and its normalised copy)
        acts += 2 * 4 / s if m.norm == "layernorm" else h / s * max(act, 4) + 4 / s
        # the response rows' hidden states and logits (bf16: and megatron's float32 copy)
        logits_r = h * act + v * act + (v * 4 if layout.precision == "bf16" else 0)
        work = max(act, 4)  # the statistics run in float32, or the logits' dtype if wider
        if layout.logprobs == "full":
            logits_r += 2 * v * work  # the log-softmax kept and its gradient
        else:  # three [chunk, V] tensors of the chunked kernel
            chunk = max(1, CHUNK_ELEMENTS // max(int(v), 1))
            logits_chunk = 3 * v * work
        # the output layer's backward: the logits' gradient, the dense weight gradient
        # [V / tp, h] and the rows' input gradient
        output_r, output_0 = (v + 2 * h) * act, v * h * act
    # the last layer's MLP backward: linear_fc2's input gradient [T, f] with its weight
    # gradient, then (gated) the two gradients of the product's factors while the first
    # is still live (the product itself freed); under sequence parallelism the re-gathered
    # [T, h] input; a stage before the last one also holds the received output gradient
    # (_mlp_backward)
    # the word embedding's backward (first stage, without embedding_grad_rows): its dense
    # [V / tp, h] gradient in the parameters' dtype beside the gradient of its output
    dense = first and not layout.embedding_grad_rows
    return {"acts_t": acts, "routed_t": routed_t, "kv_row": kv_row, "logits_r": logits_r,
            "logits_chunk": logits_chunk, "chunk": chunk,
            **_mlp_backward(m, layout),
            "bw_t": ((h if sp else 0) + (0 if last else h / s)) * act,
            "output_r": output_r, "output_0": output_0,
            "embedding_0": v * h * layout.bytes["param"] if dense else 0.0,
            "embedding_t": h / s * act if dense else 0.0,
            "buffer_t": h * act if sp else 0.0}


def _mlp_backward(m: ModelShape, layout: MemoryLayout) -> dict[str, float]:
    """The last layer's MLP backward working set as coefficients: ``mlp_t`` per token and
    ``mlp_0`` fixed (``linear_fc2``'s input gradient and its weight gradient), ``glu_t`` per
    token (gated: the two factors' gradients). A mixture of experts: the gradient of the
    ``k`` permuted copies ``[T k, h]`` beside one expert's at a time (its fc2 input gradient,
    on average ``T k / E`` rows, and its weight gradient)."""
    act, tp = layout.bytes["act"], layout.tp
    up = 2 if m.gated_mlp else 1
    if _is_moe(m):
        k, e, f, h = m.moe_router_topk, m.num_experts, m.moe_ffn_hidden_size, m.hidden_size
        return {"mlp_t": (k * h + k * f / e) * act, "mlp_0": up * f * h * act,
                "glu_t": (k * h + 2 * k * f / e) * act if m.gated_mlp else 0.0}
    f, h = m.ffn_hidden_size, m.hidden_size
    return {"mlp_t": f / tp * act, "mlp_0": up * f * h / tp * act,
            "glu_t": 2 * f / tp * act if m.gated_mlp else 0.0}


# ------------------------------------------------------------------------ the schedule
@lru_cache(maxsize=256)
def _windows(n_mb: int, layout: MemoryLayout, pp_rank: int) -> tuple:
    return tuple(tuple(w) for w in pipeline_in_flight(n_mb, layout, pp_rank))


def pipeline_in_flight(n_mb: int, layout: MemoryLayout, pp_rank: int
                       ) -> list[list[tuple[int, int]]]:
    """Before each backward of a stage, the ``(micro_batch, model_chunk)`` forwards whose
    activations it holds, in megatron's order.

    Without pipelining one micro-batch at a time. With ``pp > 1`` megatron's schedule runs
    ``warm`` forwards, then one forward before each backward: 1F1B has ``warm = pp - 1 -
    pp_rank``; the interleaved schedule (``vpp`` model chunks per stage, micro-batches in
    groups of ``G = mb_group`` per chunk) ``warm = 2 (pp - 1 - pp_rank) + (vpp - 1) G``
    chunk forwards, forward ``k`` being chunk ``(k mod G vpp) // G`` of micro-batch
    ``(k // G vpp) G + k mod G`` and backwards taking the chunks in reverse.
    """
    if layout.pp == 1:
        return [[(b, 0)] for b in range(n_mb)]
    vpp, g = layout.vpp, layout.mb_group or layout.pp
    total = n_mb * vpp

    def order(forward: bool) -> list[tuple[int, int]]:
        out = []
        for k in range(total):
            chunk = (k % (g * vpp)) // g
            out.append(((k // (g * vpp)) * g + k % g, chunk if forward else vpp - 1 - chunk))
        return out

    fwd, bwd = order(True), order(False)
    warm = (layout.pp - 1 - pp_rank) if vpp == 1 else 2 * (layout.pp - 1 - pp_rank) + (vpp - 1) * g
    warm = min(warm, total)
    windows = []
    for j in range(total):
        done = set(fwd[:min(warm + 1 + j, total)]) - set(bwd[:j])
        windows.append(sorted(done))
    return windows


def _routed_tokens(held_by: list, pool_rank: int, ep: int) -> list:
    """Per micro-batch of ``pool_rank``: the tokens whose routed copies its experts hold (the
    mean over its expert-parallel group's micro-batches of the same round, balanced
    routing); None (its own) without expert parallelism."""
    shares = held_by[pool_rank][0]
    if ep == 1:
        return [None] * len(shares)
    first = pool_rank - pool_rank % ep
    group = [held_by[r][0] for r in range(first, first + ep)]
    return [float(np.mean([g[i].tokens for g in group if i < len(g)]))
            for i in range(len(shares))]


def predict_memory(schedule, model: ModelShape, layout: MemoryLayout, *,
                   hardware_memory_gib: float | None = None,
                   steps: Sequence[int] | None = None) -> pd.DataFrame:
    """Per step and world rank: the bytes of each kind at the rank's peak, the peak, what
    sets it, and (``hardware_memory_gib``) the headroom.

    ``schedule``: a :class:`~varbatch_kit.core.schedule.Schedule` (its rollouts give the
    lengths; its ``dp`` and ``cp`` must be the layout's); ``steps``: the step indices to
    predict (default all). Columns: ``step``, ``rank`` (world rank ``tp_rank + tp *
    (pool_rank + dp * cp * pp_rank)``, the engine's numbering), ``pool_rank``, ``tp_rank``,
    ``pp_rank``, the bytes ``params``, ``grads``, ``optimizer``, ``activations``, ``cp_kv``,
    ``logits``, ``backward``, ``buffers`` at the peak, ``peak_bytes``, ``peak_phase`` (``loss``:
    while a micro-batch's loss runs; ``output``: its output layer's backward; ``backward``: its
    last layer's MLP backward; ``embedding``: its word embedding's backward; ``update``: the
    optimizer step), ``peak_micro_batches`` (the step's micro-batch indices whose
    activations are held there) and, with ``hardware_memory_gib``, ``headroom_bytes`` and
    ``over_memory``.

    The optimizer's Adam moments are created by the first update: step 0 is predicted
    without them before its update (bf16's fp32 main parameters exist from the start).
    """
    if not isinstance(model, ModelShape):
        raise ValueError(f"model must be a ModelShape, got {type(model).__name__}")
    if not isinstance(layout, MemoryLayout):
        raise ValueError(f"layout must be a MemoryLayout, got {type(layout).__name__}")
    check_modelled(model, layout)
    cfg = schedule.config
    if (cfg.dp, cfg.cp) != (layout.dp, layout.cp):
        raise ValueError(f"the schedule is dp {cfg.dp} x cp {cfg.cp}, the layout dp "
                         f"{layout.dp} x cp {layout.cp}: give the layout the schedule was "
                         "built for")
    ro = schedule.rollouts
    total_len = np.asarray(ro.total_len, dtype=np.int64)
    prompt_len = np.asarray(ro.prompt_len, dtype=np.int64)
    limit = None if hardware_memory_gib is None else hardware_memory_gib * 2**30
    wanted = None if steps is None else {int(k) for k in steps}
    chunk_layers = [n // layout.vpp for n in layout.stage_layers(model)]
    rows = []
    for k, step in enumerate(schedule.steps):
        if wanted is not None and k not in wanted:
            continue
        bins = step.rank_bins
        held_by = []  # per pool rank: its micro-batches' shares and indices in the step
        per_bin: dict[int, list[MicroBatchShare]] = {}  # every CP rank's share, made once
        for pool_rank in range(layout.pool):
            work = [p for p in step.rank_program(pool_rank) if len(p.samples)]
            if work:
                mine = list(bins[pool_rank])  # the same rounds, in the same order
                for b, p in zip(mine, work):
                    if b not in per_bin:
                        per_bin[b] = _cp_shares(total_len[p.samples], prompt_len[p.samples],
                                                p.cp_size, layout.cp_impl)
                held_by.append(([per_bin[b][p.cp_rank] for b, p in zip(mine, work)], mine))
            else:  # an idle rank trains the step's shortest sample at zero weight
                i = step.sample_indices[np.argmin(total_len[step.sample_indices])]
                held_by.append(([micro_batch_share(total_len[[i]], prompt_len[[i]])], [None]))
        for pp_rank in range(layout.pp):
            static = static_memory(model, layout, pp_rank)
            # before the first update only bf16's fp32 main parameters exist
            main = _optimizer_elements(model, layout, pp_rank) * layout.bytes["main"]
            for pool_rank, (shares, ids) in enumerate(held_by):
                routed = _routed_tokens(held_by, pool_rank, layout.ep if _is_moe(model) else 1)
                # per model chunk and micro-batch (the loss on the last stage's last chunk)
                per = [[micro_batch_memory(model, layout, sh, layers=chunk_layers[pp_rank],
                                           last=pp_rank == layout.pp - 1
                                           and c == layout.vpp - 1,
                                           first=pp_rank == 0 and c == 0, routed_tokens=rt)
                        for sh, rt in zip(shares, routed)]
                       for c in range(layout.vpp)]
                buffers = max(x["gather_buffer"] for x in per[0])
                best = None
                for window in _windows(len(shares), layout, pp_rank):
                    # the head's backward runs next: its loss, its last layer's MLP and
                    # output layer with everything held; its embedding's backward at the
                    # end, the head's own activations then freed
                    (i0, c0), rest = window[0], window[1:]
                    head = per[c0][i0]
                    others = sum(per[c][i]["activations"] + per[c][i]["cp_kv"]
                                 for i, c in rest)
                    held = others + head["activations"] + head["cp_kv"]
                    for phase, kind, base, kept in (("loss", "logits", held, window),
                                                    ("backward", "backward", held, window),
                                                    ("output", "output", held, window),
                                                    ("embedding", "embedding", others, rest)):
                        if best is None or base + head[kind] > best[0]:
                            best = (base + head[kind], phase, kind, head[kind], kept)
                _, phase, kind, extra, window = best
                kinds = {"params": static["params"], "grads": static["grads"],
                         "optimizer": static["optimizer"] if k > 0 else main,
                         "activations": sum(per[c][i]["activations"] for i, c in window),
                         "cp_kv": sum(per[c][i]["cp_kv"] for i, c in window),
                         "logits": extra if kind in ("logits", "output") else 0.0,
                         "backward": extra if kind in ("backward", "embedding") else 0.0,
                         "buffers": buffers}
                update = static["params"] + static["grads"] + static["optimizer"] + buffers
                if update > sum(kinds.values()):  # the update, all activations freed
                    phase, window = "update", []
                    kinds.update(optimizer=static["optimizer"], activations=0.0, cp_kv=0.0,
                                 logits=0.0, backward=0.0)
                peak = sum(kinds.values())
                held_ids = tuple(sorted({ids[i] for i, _ in window} - {None}))
                for tp_rank in range(layout.tp):
                    row = {"step": k,
                           "rank": tp_rank + layout.tp * (pool_rank + layout.pool * pp_rank),
                           "pool_rank": pool_rank, "tp_rank": tp_rank, "pp_rank": pp_rank,
                           **{key: int(round(v)) for key, v in kinds.items()},
                           "peak_bytes": int(round(peak)), "peak_phase": phase,
                           "peak_micro_batches": held_ids}
                    if limit is not None:
                        row["headroom_bytes"] = int(limit - peak)
                        row["over_memory"] = bool(peak > limit)
                    rows.append(row)
    return pd.DataFrame(rows).sort_values(["step", "rank"], ignore_index=True)
