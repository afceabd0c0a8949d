"""The router's auxiliary losses of a mixture-of-experts model, per sample (layout-free).

megatron-core attaches its load-balancing loss to each micro-batch: ``aux_loss`` over the
micro-batch's tokens, ``seq_aux_loss`` over each sequence of it. A packed micro-batch is one
sequence of several samples, so both balance the *packed row*: which samples share a row
changes the loss and its gradient (Megatron-LM #5996), and so does the token cap, the number
of data-parallel ranks and anything else that re-packs a step. Here each loss is a per-sample
quantity, reduced over the step by the report mode like every other metric
(docs/objective.md, "Router losses"):

- **load balancing**, for sample ``s`` of ``T_s`` tokens (prompt and response: the router
  routes every token) and MoE layer ``l`` with ``E`` experts and top ``k``::

      aux_{s,l} = E * sum_e f_{s,l,e} * P_{s,l,e}
      f_{s,l,e} = (tokens of s routed to e) / (k * T_s)        (no gradient)
      P_{s,l,e} = (1 / T_s) * sum_{t in s} softmax(x_t)_e

  megatron's ``switch_load_balancing_loss_func`` on the sample's tokens alone, with the
  routing map of its ``compute_routing_scores_for_aux_loss`` (the top k of the softmax);
- **z-loss** (ST-MoE): ``z_{s,l} = (1 / T_s) * sum_{t in s} logsumexp(x_t)^2``.

The reported ``moe_aux_loss`` / ``moe_z_loss`` of a sample is the mean over its MoE layers
(megatron logs the layers' mean); the trained term is the sum over layers times the
coefficient (megatron adds each layer's). The step reduces a sample's value as a per-token
metric that is the same at each of its loss tokens (:func:`per_token_values`), so under
``per_rollout_mean`` a rollout's samples are weighted by their loss tokens and the rollouts
averaged, under ``per_token`` every loss token counts once: nothing depends on the packing.

:class:`RouterLosses` computes them in each training forward, layer by layer (a hook on
every megatron-core ``TopKRouter``: the router's own ``gating`` applied again to its input,
differentiable) and trains them as megatron trains its own: attached to the router's output,
so that the backward differentiates them where the router runs, on whichever pipeline stage
holds the layer. Under all-gather context parallelism a rank's router sees its share of the
row: the whole row's logits are all-gathered over the micro-batch's CP group first (a
reduce-scatter in the backward), every CP rank computes each sample's losses whole and the
report mode's sum keeps its slice, as for the policy loss. ``FaultConfig.moe_aux_per_row``
(an injected bug) computes both over the packed row instead: megatron's per-micro-batch loss.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager

import torch

from varbatch_kit.train.parallel.cp_attention import all_gather_rows, current_share

__all__ = ["ROUTER_LOSS_KEYS", "RouterLosses", "per_token_values", "sample_router_losses"]

#: the reported keys of a mixture-of-experts run, after the policy loss's
ROUTER_LOSS_KEYS = ("moe_aux_loss", "moe_z_loss")


def sample_router_losses(layers: list[torch.Tensor], lengths, topk: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's load-balancing loss and z-loss, the mean over the MoE layers (float64,
    ``[S]`` each, differentiable through the logits).

    ``layers``: one ``[T, E]`` tensor of router logits per MoE layer, the packed row's tokens
    in order; ``lengths``: the ``S`` samples' token counts in the row (summing to ``T``);
    ``topk``: the router's k.
    """
    lengths = [int(n) for n in lengths]
    if not layers:
        raise ValueError("no router logits: the model has no MoE layer")
    total = sum(lengths)
    segment = torch.repeat_interleave(torch.arange(len(lengths)),
                                      torch.tensor(lengths)).to(layers[0].device)
    size = torch.tensor(lengths, dtype=torch.float64, device=layers[0].device)
    aux = torch.zeros(len(lengths), dtype=torch.float64, device=layers[0].device)
    z = torch.zeros_like(aux)
    for logits in layers:
        if logits.shape[0] != total:
            raise ValueError(f"router logits of {logits.shape[0]} tokens for samples of "
                             f"{total} tokens")
        experts = logits.shape[-1]
        # the routing decision in the router's dtype (as megatron ranks its scores); the sums
        # in float64
        scores = torch.softmax(logits.double(), dim=-1)
        chosen = torch.topk(torch.softmax(logits.detach(), dim=-1), k=topk, dim=-1).indices
        routed = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
        routed.scatter_(1, chosen, 1.0)
        counts = torch.zeros(len(lengths), experts, dtype=torch.float64,
                             device=logits.device).index_add_(0, segment, routed)
        prob_sums = torch.zeros(len(lengths), experts, dtype=torch.float64,
                                device=logits.device).index_add_(0, segment, scores)
        aux = aux + experts * (counts * prob_sums).sum(-1) / (topk * size * size)
        lse2 = torch.logsumexp(logits.double(), dim=-1).square()
        z = z + torch.zeros_like(aux).index_add_(0, segment, lse2) / size
    return aux / len(layers), z / len(layers)


def _row_tokens(lengths, share) -> int:
    """The real tokens of the row a router runs on: the micro-batch's, or under all-gather CP
    this rank's share of it (the rest of a sequence-parallel row is padding)."""
    return sum(share.local_lengths()) if share is not None else sum(lengths)


#: the real tokens of the row the current forward runs on (RouterLosses.micro_batch sets it),
#: for the expert-load count, which must skip a sequence-parallel row's padding
_row_length: contextvars.ContextVar[int | None] = contextvars.ContextVar("moe_row_tokens",
                                                                         default=None)


def current_row_tokens() -> int | None:
    """The real tokens of the micro-batch row whose forward runs (None: none announced)."""
    return _row_length.get()


def per_token_values(per_sample: torch.Tensor, response_lengths) -> torch.Tensor:
    """A per-sample value at each of the sample's response tokens, samples concatenated (the
    layout the report mode's sums take)."""
    return torch.repeat_interleave(
        per_sample, torch.tensor([int(n) for n in response_lengths], device=per_sample.device))


class _AttachLoss(torch.autograd.Function):
    """Identity on ``output``; its backward also differentiates ``loss`` with the gradient
    ``scale`` (what megatron-core's schedule gives the micro-batch's main loss), so a loss
    computed inside a layer trains without passing through the loss function (megatron's
    ``MoEAuxLossAutoScaler``, with the scale a float64 number instead of a float32
    tensor)."""

    @staticmethod
    def forward(ctx, output, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


class RouterLosses:
    """The router losses of one rank's training forwards (see the module docstring).

    Before each micro-batch's forward, :meth:`micro_batch` says what it holds: the samples'
    token counts in the packed row, their response lengths, ``loss_sum`` (the report mode's
    sum of per-token values over the micro-batch, differentiable: the same function the
    policy loss goes through), ``weight`` (what the micro-batch's loss is multiplied by:
    the loss prescale, 0 for an idle round) and ``scale`` (the gradient megatron's schedule
    gives that loss: 1 / micro-batches, or 1 under its per-token path). A forward hook on each
    router then computes its layer's per-sample losses, reduces them with ``loss_sum``, adds
    the reduced values to :attr:`sums` (detached, for the report) and, when a coefficient is
    set, attaches ``weight * (aux_coeff * aux + z_coeff * z)`` to the router's output so
    that the backward trains it. Each pipeline stage's routers do this for their own layers;
    :meth:`report` divides by the model's MoE layer count.
    """

    def __init__(self, routers: list, *, num_moe_layers: int = 0, aux_coeff: float = 0.0,
                 z_coeff: float = 0.0, per_row: bool = False) -> None:
        self.routers = routers
        self.num_moe_layers = num_moe_layers or len(routers)
        self.topk = routers[0].topk if routers else 0
        self.aux_coeff, self.z_coeff, self.per_row = aux_coeff, z_coeff, per_row
        #: the reduced per-layer losses summed over layers and micro-batches (aux, z)
        self.sums = torch.zeros(2, dtype=torch.float64)
        self._current: dict | None = None

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def micro_batch(self, lengths, response_lengths, *, loss_sum, weight: float,
                    scale: float, counted: bool = True, share=None) -> None:
        """What the next forward holds (module docstring); ``counted=False``: an idle round
        (zero weight), not reported; ``share``: this rank's all-gather CP share of the row
        (None: the whole row)."""
        self._current = dict(lengths=[int(n) for n in lengths],
                             response=[int(n) for n in response_lengths], loss_sum=loss_sum,
                             weight=float(weight), scale=float(scale), counted=bool(counted))
        _row_length.set(_row_tokens(self._current["lengths"], share))

    def _hook(self, module, args, output):
        cur = self._current
        if not torch.is_grad_enabled() or cur is None:
            return None  # a forward-only pass (log-probs), or no micro-batch announced
        logits = module.gating(args[0])
        logits = logits.reshape(-1, logits.shape[-1])
        share = current_share()
        if module.config.sequence_parallel:  # this TP rank's slice of the (padded) row: the
            # row gathered over the TP group (backward: each rank keeps its slice's gradient,
            # every rank computing the same losses), the padding dropped
            from megatron.core.tensor_parallel.mappings import (
                gather_from_sequence_parallel_region,
            )

            logits = gather_from_sequence_parallel_region(
                logits, tensor_parallel_output_grad=False, group=module.tp_group)
            logits = logits[:_row_tokens(cur["lengths"], share)]
        if share is not None:  # all-gather CP: this rank's share of the row; the whole row's
            # logits gathered from the group (backward: each rank's gradient to its rows)
            logits = all_gather_rows(logits, share, share.max_local, share.kv_index)
        lengths = [sum(cur["lengths"])] if self.per_row else cur["lengths"]
        aux, z = sample_router_losses([logits], lengths, self.topk)
        if self.per_row:  # the injected bug: the row's value for each of its samples
            aux, z = aux.expand(len(cur["lengths"])), z.expand(len(cur["lengths"]))
        reduced = [cur["loss_sum"](per_token_values(v, cur["response"])) for v in (aux, z)]
        if cur["counted"]:
            self.sums += torch.stack([r.detach().to("cpu", torch.float64) for r in reduced])
        if not (self.aux_coeff or self.z_coeff) or not cur["weight"]:
            return None
        term = cur["weight"] * (self.aux_coeff * reduced[0] + self.z_coeff * reduced[1])
        probs, routing_map = output
        return _AttachLoss.apply(probs, term, cur["scale"]), routing_map

    @contextmanager
    def attached(self):
        """Within the block, the routers' training forwards compute and train the losses."""
        handles = [r.register_forward_hook(self._hook) for r in self.routers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._current = None
            _row_length.set(None)

    def report(self) -> torch.Tensor:
        """``(moe_aux_loss, moe_z_loss)`` sums of this rank, the mean over the model's MoE
        layers (to be summed over the ranks and divided like every reported sum)."""
        return self.sums / self.num_moe_layers
