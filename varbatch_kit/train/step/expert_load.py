"""Expert load of a mixture-of-experts step: the tokens each expert received, per layer.

A forward hook on every megatron-core ``TopKRouter`` of the rank's model chunks reads the
router's routing map (``[tokens, experts]``, True where a token goes to an expert) during the
step's training forwards (grad enabled: not the log-prob pass) and adds up, per MoE layer,
the tokens per expert of each micro-batch. :meth:`ExpertLoadWatch.gathered` sums them over
the ranks that hold different tokens (the data-parallel ranks, one tensor-parallel rank
each), so the step log's figures are the whole step's, whatever the layout:

- ``expert_tokens``: per MoE layer, the tokens routed to each expert (a token counts once
  per expert of its top k);
- ``expert_load_max_over_mean``: the busiest expert's tokens over the mean, the worst layer
  (1.0: perfectly even; an expert-parallel rank holding it waits for the others);
- ``micro_batch_expert_max_over_mean``: per rank, per micro-batch, the same over the
  micro-batch's own tokens (its worst layer);
- ``expert_parallel_load_max_over_mean``: under expert parallelism (``ep`` ranks, each
  holding ``1/ep`` of the experts, consecutive), the tokens an expert-parallel rank's experts
  received, busiest rank over the mean, the worst layer (1.0 at ``ep = 1``).

Dense models have no router: the watch records nothing.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from varbatch_kit.train.step.router_losses import current_row_tokens

__all__ = ["ExpertLoadWatch", "expert_load_watch", "routers_of"]


def routers_of(chunks) -> list:
    """The megatron-core ``TopKRouter`` modules of ``chunks``, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]


def _max_over_mean(counts: torch.Tensor) -> float:
    """The worst row's max / mean (rows: layers); 1.0 for no token."""
    counts = counts.to(torch.float64)
    mean = counts.mean(dim=-1)
    ratio = torch.where(mean > 0, counts.max(dim=-1).values / mean.clamp(min=1e-300),
                        torch.ones_like(mean))
    return float(ratio.max()) if ratio.numel() else 1.0


def _row(router, index: int) -> int:
    """The router's layer in the whole model (megatron's global 1-based ``layer_number``;
    ``index`` for a stand-in without one)."""
    number = getattr(router, "layer_number", None)
    return index if number is None else int(number) - 1


class ExpertLoadWatch:
    """Tokens per expert of one step on this rank (see the module docstring)."""

    def __init__(self, routers: list, ep: int = 1, num_moe_layers: int = 0,
                 copies: int = 1) -> None:
        self.routers = routers
        self.ep = ep
        self.copies = copies  # emulated CP: every CP rank routes the whole micro-batch
        experts = routers[0].config.num_moe_experts if routers else 0
        # one row per MoE layer of the whole model (a pipeline stage fills its own layers')
        layers = max(num_moe_layers, len(routers))
        self.rows = [_row(r, i) for i, r in enumerate(routers)]
        self.counts = torch.zeros(layers, experts, dtype=torch.int64)
        self.micro_batches: list[float] = []
        self._current: torch.Tensor | None = None
        self._seen: set[int] = set()

    def _hook(self, index: int):
        def hook(_module, _args, output) -> None:
            if not torch.is_grad_enabled():
                return  # a forward-only pass (log-probs), not the step's training
            routing_map = output[1]
            if getattr(getattr(_module, "config", None), "sequence_parallel", False):
                # this TP rank's slice of the padded row: its real rows only
                real = current_row_tokens()
                if real is not None:
                    first = _module.tp_group.rank() * routing_map.shape[0]
                    routing_map = routing_map[:max(0, min(routing_map.shape[0], real - first))]
            tokens = routing_map.sum(dim=0).to("cpu", torch.int64)
            if index == 0 or self._current is None:  # the first layer: a new micro-batch
                self._close_micro_batch()
                self._current = torch.zeros_like(self.counts)
                self._seen = set()
            row = self.rows[index]
            self._seen.add(row)
            self._current[row] += tokens
            self.counts[row] += tokens
        return hook

    def _close_micro_batch(self) -> None:
        if self._current is not None:
            seen = sorted(self._seen)
            self.micro_batches.append(_max_over_mean(self._current[seen]))
        self._current = None

    def gathered(self, group=None) -> dict:
        """The step's figures, summed over ``group``'s ranks (a collective over the group;
        None: every rank: a mixture-of-experts model trains under data (and expert)
        parallelism only, so every rank routes other tokens); {} for a dense model (no
        collective)."""
        import torch.distributed as dist

        if not self.routers:
            return {}
        self._close_micro_batch()
        total = self.counts.clone()
        if dist.is_initialized():
            dist.all_reduce(total, group=group)
        total //= self.copies
        per_rank = total.reshape(total.shape[0], self.ep, -1).sum(dim=-1)
        return {"expert_tokens": total.tolist(),
                "expert_load_max_over_mean": _max_over_mean(total),
                "expert_parallel_load_max_over_mean": _max_over_mean(per_rank),
                "micro_batch_expert_max_over_mean": list(self.micro_batches)}


@contextmanager
def expert_load_watch(chunks, ep: int = 1, num_moe_layers: int = 0, copies: int = 1):
    """Within the block, count the tokens the routers of ``chunks`` (the rank's model
    chunks) send to each expert (``ep``: the run's expert-parallel size; ``num_moe_layers``:
    the whole model's, of which a pipeline stage holds some; ``copies``: how many ranks route
    each token, the CP size under emulated CP, else 1); yields the :class:`ExpertLoadWatch`."""
    routers = routers_of(chunks)
    watch = ExpertLoadWatch(routers, ep, num_moe_layers, copies)
    handles = [r.register_forward_hook(watch._hook(i)) for i, r in enumerate(routers)]
    try:
        yield watch
    finally:
        for h in handles:
            h.remove()
