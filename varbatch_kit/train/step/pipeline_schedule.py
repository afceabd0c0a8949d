"""Pipeline parallelism, the schedule side: megatron-core's pipelined schedule over a rank's
model chunks (:func:`forward_backward`), timed per stage
(:class:`~varbatch_kit.train.step.microbatch_timer.MicroBatchTimer`, as every schedule).

:func:`forward_backward` calls ``get_forward_backward_func()``: megatron's
``forward_backward_pipelining_without_interleaving`` (1F1B) or, with several chunks per
stage, ``..._with_interleaving`` (micro-batches in groups of ``mb_group`` per virtual
stage, :func:`varbatch_kit.train.config.pipeline_checks.interleaved_count_problem`). The interleaved
schedule gets a communicator that keeps messages between one pair of ranks in order
(:func:`_ordered_p2p`). The timer times every forward and backward of every chunk
around megatron's ``forward_step`` / ``backward_step``; the rest of the schedule's span is
the stage's idle time (p2p waits: the bubble), which :mod:`benchmarks.pp_measured` reports.
The chunks themselves are built by :mod:`varbatch_kit.train.model.pipeline_stages`.
"""

from __future__ import annotations

from varbatch_kit.train.config.pipeline_checks import interleaved_count_problem

__all__ = ["forward_backward", "is_post_process"]


def forward_backward(models: list, batches: list, forward_step, *, forward_only: bool = False,
                     timer=None) -> list:
    """megatron's pipelined schedule over ``batches`` (the rank's micro-batches, in training
    order) on this rank's model chunks ``models``; the loss outputs (last stage only).

    ``forward_step(data_iterator, model)`` is megatron's ``forward_step_func``; with several
    chunks each reads the micro-batches from its own iterator over ``batches``. ``timer``: a
    :class:`~varbatch_kit.train.step.microbatch_timer.MicroBatchTimer` to time it with.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    config = get_model_config(models[0])
    if len(models) > 1:
        problem = interleaved_count_problem(len(batches),
                                            config.microbatch_group_size_per_vp_stage,
                                            config.pipeline_model_parallel_size,
                                            vpp=len(models), forward_only=forward_only)
        if problem:
            raise ValueError(problem)
    data = [iter(batches) for _ in models] if len(models) > 1 else iter(batches)
    kwargs = dict(forward_step_func=forward_step, data_iterator=data, model=models,
                  num_microbatches=len(batches), seq_length=max(_tokens(b) for b in batches),
                  micro_batch_size=1, forward_only=forward_only)
    if len(models) > 1:  # interleaved: activations and gradients may share a pair of ranks
        kwargs.update(_ordered_p2p(config))
    if timer is None:
        return get_forward_backward_func()(**kwargs)
    with timer.around(config, list(models)):
        return get_forward_backward_func()(**kwargs)


def _ordered_p2p(config) -> dict:
    """``p2p_communicator`` and ``pg_collection`` for the interleaved schedule.

    With variable sequence lengths megatron first exchanges every tensor's shape, in one
    ``batch_isend_irecv`` of ``[send_prev, recv_prev, send_next, recv_next]`` on the pipeline
    group. The interleaved schedule sends activations forward and gradients backward in the
    same call, and with two stages a rank's previous and next stage are the same rank: the
    two messages between one pair of ranks then meet the receives in the opposite order (the
    shapes swap, and the tensors after them). :class:`_PairOrderedP2P` posts the shape
    messages in the even/odd order megatron's own ``_p2p_ops`` uses for the tensors
    (``batch_p2p_comm=False``), one direction on the world group: every message meets its
    own receive.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    config.batch_p2p_comm = False  # the tensors: megatron's even/odd _p2p_ops
    pg = ProcessGroupCollection()
    pg.tp = parallel_state.get_tensor_model_parallel_group()
    pg.cp = parallel_state.get_context_parallel_group()
    pg.embd = parallel_state.get_embedding_group(check_initialized=False)
    pg.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pg.pp = parallel_state.get_pipeline_model_parallel_group()
    pg.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                      partial_data_parallel=False)
    return {"p2p_communicator": _pair_ordered_class()(pp_group=pg.pp, config=config),
            "pg_collection": pg}


def _pair_ordered_class():
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    class _PairOrderedP2P(P2PCommunicator):
        """megatron's communicator, shapes exchanged in the even/odd order (see
        :func:`_ordered_p2p`)."""

        def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev,
                                recv_next):
            group = self.pp_group
            other = dist.group.WORLD if group.size() == 2 else group
            even = group.rank() % 2 == 0

            def shape(t):
                return torch.tensor(t.size(), dtype=torch.int64)

            recv_p = torch.empty((3,), dtype=torch.int64) if recv_prev else None
            recv_n = torch.empty((3,), dtype=torch.int64) if recv_next else None
            ops = []  # (function, tensor, peer, group), in megatron's _p2p_ops order
            sn = (dist.isend, shape(tensor_send_next), self.next_rank) \
                if tensor_send_next is not None else None
            sp = (dist.isend, shape(tensor_send_prev), self.prev_rank) \
                if tensor_send_prev is not None else None
            rp = (dist.irecv, recv_p, self.prev_rank) if recv_p is not None else None
            rn = (dist.irecv, recv_n, self.next_rank) if recv_n is not None else None
            if even:  # sends on the pipeline group, receives on the other
                order = [(sn, group), (rp, other), (sp, group), (rn, other)]
            else:
                order = [(rp, group), (sn, other), (rn, group), (sp, other)]
            for op, g in order:
                if op is not None:
                    fn, t, peer = op
                    ops.append(fn(t, peer, group=g))
            for req in ops:
                req.wait()
            return (recv_p.tolist() if recv_p is not None else [0, 0, 0],
                    recv_n.tolist() if recv_n is not None else [0, 0, 0])

    return _PairOrderedP2P


def _tokens(item) -> int:
    """The tokens of a micro-batch: a packed batch, or a tuple that holds one."""
    parts = item if isinstance(item, tuple) else (item,)
    return max(int(p.num_tokens) for p in parts if hasattr(p, "num_tokens"))


def is_post_process(model) -> bool:
    """Whether a chunk (or its DDP wrapper) ends the model: its output is the logits."""
    from varbatch_kit.train.model.gpt import unwrap_model

    return bool(getattr(unwrap_model(model), "post_process", True))
