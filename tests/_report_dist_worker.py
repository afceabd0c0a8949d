"""Worker body for the multi-process (gloo) report tests (not collected by pytest).

One process per rank of a DP x CP world. For every (dp, cp) factorisation of the
world size, rank ``r`` is DP rank ``r // cp`` and CP rank ``r % cp``; the DP x CP
group is the whole world. Each rank computes only its own share and the
numbers meet through real ``torch.distributed`` collectives. Results go to
``outdir/rank{r}.pt`` for the parent test to check.
"""

from __future__ import annotations

import datetime
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from _report_cases import (
    Case,
    cp_local_values,
    ddp_finish,
    four_rollouts_cp,
    four_samples_two_rollouts,
    make_mlp,
    mixed_case,
    normalizers_for,
    rank_backward,
    round_robin_layout,
    token_features,
    unit_weight_backward,
)

from varbatch_kit.compat.slime import metrics as slime_metrics
from varbatch_kit.report import get_report_mode, reduce_train_step_metrics
from varbatch_kit.report.objective import masked_whiten

SPLITS_OF_FOUR = {  # extra splits of the 4-sample case (layout[dp_rank][micro_batch]), per dp
    1: [[[[0, 2], [1, 3]]], [[[3], [0, 1, 2]]]],
    2: [[[[0, 1, 2]], [[3]]], [[[3, 0], []], [[2], [1]]]],
    4: [[[[3]], [[1]], [[0]], [[2]]]],
}


def _step_report(name: str, case: Case, layout, dp_rank: int, cp_rank: int, cp: int, group):
    """Core and compat train-step reports of this rank's micro-batches, all-reduced."""
    mode = get_report_mode(name)
    norm = normalizers_for(mode, case, layout, cp)
    vectors, slime_entries = [], []
    for mb in layout[dp_rank]:
        masks = [case.loss_masks[i] for i in mb]
        loss_sum = mode.microbatch_loss_sum(
            cp_local_values(case, mb, cp_rank, cp),
            total_lengths=[case.total_lengths[i] for i in mb],
            response_lengths=[case.response_lengths[i] for i in mb],
            loss_masks=masks,
            sample_denominators=norm.denominators_for(mb),
            cp_rank=cp_rank,
            cp_size=cp,
        )
        vec = torch.stack([loss_sum.new_tensor(float(mode.count_slot(masks))), loss_sum])
        vectors.append(vec)
        slime_entries.append({"keys": ["x"], "values": vec})
    core = reduce_train_step_metrics(
        vectors, keys=["x"], divisor=norm.report_divisor, cp_size=cp, group=group
    )["x"]
    compat = slime_metrics.reduce_train_step_metrics(
        slime_entries,
        calculate_per_token_loss=mode.megatron_per_token_loss,
        step_global_batch_size=len(set(case.rollout_ids)),
        cp_size=cp,
        dp_with_cp_group=group,
    )["x"]
    return core, compat


def _unit_weight_gradient(name: str, dp_rank: int, cp_rank: int, dp: int, cp: int, group):
    """d loss / d w for x * w (w = 1) through prescale, Megatron scaling and all_reduce."""
    case = four_rollouts_cp()
    mode = get_report_mode(name)
    layout = round_robin_layout(4, dp, 1)
    norm = normalizers_for(mode, case, layout, cp)
    grad, count = unit_weight_backward(mode, case, norm, layout[dp_rank][0], cp_rank=cp_rank,
                                       dp=dp, cp=cp)
    grad_and_tokens = torch.tensor([grad, float(count)], dtype=torch.float64)
    dist.all_reduce(grad_and_tokens, group=group)
    return float(ddp_finish(mode, grad_and_tokens[:1], int(grad_and_tokens[1]), dp * cp))


def _mlp_gradient(name: str, dp_rank: int, cp_rank: int, dp: int, cp: int, group):
    case = mixed_case()
    mode = get_report_mode(name)
    layout = round_robin_layout(case.n, dp, 2)
    norm = normalizers_for(mode, case, layout, cp)
    grad, tokens = rank_backward(
        make_mlp(), mode, norm, case, token_features(case), layout[dp_rank],
        cp_rank=cp_rank, cp_size=cp, dp_size=dp,
    )  # fmt: skip
    token_sum = torch.tensor([float(tokens)], dtype=torch.float64)
    dist.all_reduce(grad, group=group)  # DDP bucket all-reduce (sum)
    dist.all_reduce(token_sum, group=group)  # finalize_model_grads' token all-reduce
    return ddp_finish(mode, grad, int(token_sum.item()), dp * cp)


def _rollout_log(dp_rank: int, cp_rank: int, dp: int, cp: int, group, world: int):
    case = four_rollouts_cp()
    mode = get_report_mode("per_rollout_mean")
    layout = round_robin_layout(4, dp, 1)
    norm = normalizers_for(mode, case, layout, cp)
    mb = layout[dp_rank][0]
    reducer = slime_metrics.get_sum_of_sample_mean(
        [12] * len(mb),
        [8] * len(mb),
        [case.loss_masks[i] for i in mb],
        norm.denominators_for(mb),
        cp_rank=cp_rank,
        cp_size=cp,
    )
    entry = slime_metrics.rollout_log_metric_contribution(
        reducer(cp_local_values(case, mb, cp_rank, cp)),
        cp_size=cp,
        num_rollouts_in_rollout=4,
        dp_size=dp,
    )
    rank = dist.get_rank()
    log = {"log_probs": entry, "rank_id": float(rank)}
    reduced = slime_metrics.gather_and_reduce_log_dict(
        log, dp_size=world, dp_src_rank=0, dp_group=group
    )
    # inconsistent entries: a pair on rank 0, a scalar elsewhere -> ValueError on every rank
    bad = {"kl": (1.0, 1.0) if rank == 0 else 0.5}
    try:
        slime_metrics.gather_and_reduce_log_dict(bad, dp_size=world, dp_src_rank=0, dp_group=group)
        error = None
    except ValueError as exc:
        error = str(exc)
    return reduced, error


def whiten_share(case: Case, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of ``case`` for whitening: the values and masks of samples
    ``rank, rank + world, ...``, concatenated (the parent test slices its reference alike)."""
    pieces = case.values.split(case.response_lengths)
    mine = range(rank, case.n, world)
    return (torch.cat([pieces[i] for i in mine]),
            torch.cat([case.loss_masks[i] for i in mine]))


def run(rank: int, world: int, port: int, outdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    results: dict = {}
    try:
        group = dist.group.WORLD
        for dp in [d for d in (1, 2, 4) if world % d == 0]:
            cp = world // dp
            dp_rank, cp_rank = divmod(rank, cp)
            out = results[(dp, cp)] = {}
            worked = four_rollouts_cp()
            for name in ("per_rollout_mean", "per_token"):
                out[("1249.875", name)] = [
                    _step_report(
                        name, worked, round_robin_layout(4, dp, m), dp_rank, cp_rank, cp, group
                    )
                    for m in sorted({1, 4 // dp})
                ]
            small = four_samples_two_rollouts()
            layouts = [round_robin_layout(4, dp, 1), *SPLITS_OF_FOUR[dp]]
            for name in ("per_rollout_mean", "per_token"):
                out[("small", name)] = [
                    _step_report(name, small, lay, dp_rank, cp_rank, cp, group) for lay in layouts
                ]
            for name in ("per_rollout_mean", "per_token"):
                out[("unit_grad", name)] = _unit_weight_gradient(
                    name, dp_rank, cp_rank, dp, cp, group
                )
                out[("mlp_grad", name)] = _mlp_gradient(name, dp_rank, cp_rank, dp, cp, group)
            out["rollout_log"] = _rollout_log(dp_rank, cp_rank, dp, cp, group, world)
        # advantages whitened over the group: with a group given, statistics are all-reduced
        # by default (all_reduce=None), so every rank's share matches one process's
        results["whiten"] = masked_whiten(*whiten_share(mixed_case(), rank, world), group=group)
    except Exception:  # report, then let the parent see a non-zero exit
        results["error"] = traceback.format_exc()
        raise
    finally:
        Path(outdir, f"rank{rank}.pt").write_bytes(b"")  # marker even if saving fails
        torch.save(results, Path(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()
