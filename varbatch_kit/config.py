"""`ScheduleConfig`: the parallel layout and the two scheduling knobs.

slime's flags map onto two knobs: ``packing`` (how a step becomes
micro-batches) and ``distribution`` (how micro-batches go to DP ranks):

========================================  ===========  ============
slime flags                               packing      distribution
========================================  ===========  ============
(none)                                    static       strided
--balance-data                            static       flops_kk
--use-dynamic-batch-size                  first_fit    strided
--use-dynamic-batch-size --balance-data   first_fit    flops_kk
--use-dynamic-batch-size                  flops_kk     flops_kk
--balance-by-flops
========================================  ===========  ============
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["ScheduleConfig"]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class ScheduleConfig:
    """How rollout steps are cut into micro-batches and spread over ranks.

    Parameters
    ----------
    dp, cp, vpp, mb_group:
        Data-parallel size, context-parallel size, virtual-pipeline size and
        micro-batches grouped per virtual-pipeline stage (only used when
        ``vpp > 1``: the micro-batch count per rank is then a multiple of it).
    global_batch_size:
        Rollouts per training step (not samples).
    micro_batch_size:
        Static path: samples per micro-batch. Exactly one of this and
        ``max_tokens_per_gpu`` is set.
    max_tokens_per_gpu:
        Dynamic path: token cap per GPU; a micro-batch holds up to
        ``max_tokens_per_gpu * cp`` tokens (it is split over CP ranks).
    packing:
        Name of a registered packer (``static``, ``first_fit``, ``flops_kk``,
        and more; see :data:`varbatch_kit.packing.PACKERS`). Defaults to
        ``static`` or ``first_fit`` from the path.
    distribution:
        Name of a registered distribution (``strided``, ``flops_kk``,
        ``balanced``, ...). Defaults to ``strided``, or to the distribution a
        packing requires: ``packing="balanced"`` places samples on ranks
        itself and needs ``distribution="balanced"`` (the default for it);
        any other distribution with it is a ``ValueError``.
    """

    dp: int = 1
    global_batch_size: int = 1
    micro_batch_size: int | None = None
    max_tokens_per_gpu: int | None = None
    cp: int = 1
    vpp: int = 1
    mb_group: int = 1
    packing: str | None = None
    distribution: str | None = None

    def __post_init__(self) -> None:
        from varbatch_kit.distribution import get_distribution
        from varbatch_kit.packing import get_packer

        for name in ("dp", "cp", "vpp", "mb_group", "global_batch_size"):
            _positive_int(name, getattr(self, name))
        if (self.micro_batch_size is None) == (self.max_tokens_per_gpu is None):
            raise ValueError(
                "set exactly one of micro_batch_size (static batching) and max_tokens_per_gpu "
                f"(dynamic batching); got micro_batch_size={self.micro_batch_size!r}, "
                f"max_tokens_per_gpu={self.max_tokens_per_gpu!r}"
            )
        if self.micro_batch_size is not None:
            _positive_int("micro_batch_size", self.micro_batch_size)
        else:
            _positive_int("max_tokens_per_gpu", self.max_tokens_per_gpu)
        if self.packing is None:
            object.__setattr__(self, "packing", "first_fit" if self.dynamic else "static")
        spec = get_packer(self.packing)
        if spec.dynamic and not self.dynamic:
            raise ValueError(
                f"packing={self.packing!r} packs under a token cap: set max_tokens_per_gpu "
                "(dynamic batching) instead of micro_batch_size"
            )
        if not spec.dynamic and self.dynamic:
            raise ValueError(
                f"packing={self.packing!r} needs micro_batch_size (static batching); with "
                "max_tokens_per_gpu use a dynamic packing such as 'first_fit'"
            )
        if self.distribution is None:
            object.__setattr__(self, "distribution", spec.requires_distribution or "strided")
        get_distribution(self.distribution)
        if spec.requires_distribution and self.distribution != spec.requires_distribution:
            raise ValueError(
                f"packing={self.packing!r} decides which rank trains each sample, so it needs "
                f"distribution={spec.requires_distribution!r} (or leave distribution unset); got "
                f"distribution={self.distribution!r}. To keep distribution="
                f"{self.distribution!r}, pick another packing such as 'ffd' or 'first_fit'"
            )

    # ------------------------------------------------------------- derived
    @property
    def dynamic(self) -> bool:
        """True on the dynamic (token-capped) path."""
        return self.max_tokens_per_gpu is not None

    @property
    def cap(self) -> int | None:
        """Token cap per micro-batch: ``max_tokens_per_gpu * cp`` (None when static)."""
        return None if self.max_tokens_per_gpu is None else self.max_tokens_per_gpu * self.cp

    @property
    def align(self) -> int:
        """The bin count of a step is a multiple of this: dp (times mb_group under VPP)."""
        return self.dp * (self.mb_group if self.vpp > 1 else 1)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp

    def with_(self, **changes: Any) -> ScheduleConfig:
        """A copy with some fields changed (re-validated)."""
        if "micro_batch_size" in changes and changes["micro_batch_size"] is not None:
            changes.setdefault("max_tokens_per_gpu", None)
        if "max_tokens_per_gpu" in changes and changes["max_tokens_per_gpu"] is not None:
            changes.setdefault("micro_batch_size", None)
        if ("micro_batch_size" in changes or "max_tokens_per_gpu" in changes) and \
                "packing" not in changes:
            new_dynamic = changes.get("max_tokens_per_gpu") is not None
            if get_packer_dynamic(self.packing) != new_dynamic:
                changes["packing"] = None
        return replace(self, **changes)

    # ------------------------------------------------------------ from slime
    @classmethod
    def from_slime_args(cls, args: Any, *, dp: int | None = None) -> ScheduleConfig:
        """Map slime's command-line flags onto a config.

        ``args`` is an ``argparse.Namespace`` (or any object with slime's
        attribute names) or a command-line string such as
        ``"--global-batch-size 64 --use-dynamic-batch-size --max-tokens-per-gpu 16384"``.
        ``dp`` defaults to ``actor_num_nodes * actor_num_gpus_per_node /
        (tensor * pipeline * context parallel size)``.
        """
        if isinstance(args, str):
            args = _parse_slime_cmdline(args)

        def get(name: str, default: Any = None) -> Any:
            v = getattr(args, name, default)
            return default if v is None else v

        gbs = get("global_batch_size")
        if gbs is None:
            raise ValueError("slime args lack --global-batch-size (rollouts per step)")
        cp = int(get("context_parallel_size", 1))
        if dp is None:
            if get("dp_size") is not None:
                dp = int(get("dp_size"))
            else:
                world = int(get("actor_num_nodes", 1)) * int(get("actor_num_gpus_per_node", 1))
                per_replica = int(get("tensor_model_parallel_size", 1)) * int(
                    get("pipeline_model_parallel_size", 1)) * cp
                if world % per_replica:
                    raise ValueError(
                        f"{world} GPUs (actor_num_nodes*actor_num_gpus_per_node) are not "
                        f"divisible by tp*pp*cp = {per_replica}"
                    )
                dp = world // per_replica
        dynamic = bool(get("use_dynamic_batch_size", False))
        by_flops = bool(get("balance_by_flops", False))
        if by_flops and not dynamic:
            raise ValueError("--balance-by-flops requires --use-dynamic-batch-size")
        balance = bool(get("balance_data", False)) or by_flops
        if dynamic:
            mtpg = get("max_tokens_per_gpu")
            if mtpg is None:
                raise ValueError(
                    "--use-dynamic-batch-size needs --max-tokens-per-gpu (the token cap)")
            sizes = dict(max_tokens_per_gpu=int(mtpg))
        else:
            sizes = dict(micro_batch_size=int(get("micro_batch_size", 1)))
        return cls(
            dp=int(dp),
            cp=cp,
            vpp=int(get("virtual_pipeline_model_parallel_size", 1)),
            mb_group=int(get("microbatch_group_size_per_vp_stage")
                         or get("pipeline_model_parallel_size", 1)),
            global_batch_size=int(gbs),
            packing="flops_kk" if by_flops else ("first_fit" if dynamic else "static"),
            distribution="flops_kk" if balance else "strided",
            **sizes,
        )


def get_packer_dynamic(name: str | None) -> bool:
    from varbatch_kit.packing import get_packer

    return get_packer(name).dynamic if name is not None else False


def _parse_slime_cmdline(cmdline: str) -> argparse.Namespace:
    """Parse the scheduling-relevant subset of slime's flags; other flags are ignored."""
    p = argparse.ArgumentParser(add_help=False)
    for flag in ("--global-batch-size", "--micro-batch-size", "--max-tokens-per-gpu",
                 "--context-parallel-size", "--tensor-model-parallel-size",
                 "--pipeline-model-parallel-size", "--virtual-pipeline-model-parallel-size",
                 "--microbatch-group-size-per-vp-stage", "--actor-num-nodes",
                 "--actor-num-gpus-per-node", "--dp-size"):
        p.add_argument(flag, type=int)
    p.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int,
                   dest="microbatch_group_size_per_vp_stage")
    for flag in ("--use-dynamic-batch-size", "--balance-data", "--balance-by-flops"):
        p.add_argument(flag, action="store_true")
    ns, _unknown = p.parse_known_args(shlex.split(cmdline))
    return ns
