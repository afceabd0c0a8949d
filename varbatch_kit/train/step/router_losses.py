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

:class:`RouterLogits` records the router logits of each training forward (a hook on every
megatron-core ``TopKRouter``: the router's own ``gating`` applied again to its input,
differentiable, so the losses' gradients reach the router and the hidden states as
megatron's would). ``FaultConfig.moe_aux_per_row`` (an injected bug) computes both over the
packed row instead: megatron's per-micro-batch loss.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["ROUTER_LOSS_KEYS", "RouterLogits", "per_token_values", "sample_router_losses"]

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


def per_token_values(per_sample: torch.Tensor, response_lengths) -> torch.Tensor:
    """A per-sample value at each of the sample's response tokens, samples concatenated (the
    layout the report mode's sums take)."""
    return torch.repeat_interleave(
        per_sample, torch.tensor([int(n) for n in response_lengths], device=per_sample.device))


class RouterLogits:
    """The router logits of the training forwards since the last :meth:`take`, per MoE layer
    in order (a forward-only pass, no gradient, records nothing)."""

    def __init__(self, routers: list) -> None:
        self.routers = routers
        self.topk = routers[0].topk if routers else 0
        self._layers: list[torch.Tensor] = []

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def _hook(self, module, args, _output) -> None:
        if not torch.is_grad_enabled():
            return
        logits = module.gating(args[0])
        self._layers.append(logits.reshape(-1, logits.shape[-1]))

    @contextmanager
    def attached(self):
        """Within the block, the routers' training forwards are recorded."""
        handles = [r.register_forward_hook(self._hook) for r in self.routers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._layers = []

    def take(self) -> list[torch.Tensor]:
        """The recorded layers' logits (``[T, E]`` each), forgotten here."""
        layers, self._layers = self._layers, []
        return layers
