"""Which slime flags to run: :func:`recommend` searches slime's own scheduling knobs on a trace.

Keeping the user's world size (``dp``, ``cp``, ``pp``, ``tp``, ``vpp`` from
their flags) and model, :func:`recommend` tries the knobs slime really has,
builds each candidate's schedule exactly as slime's flags describe it
(:func:`~varbatch_kit.compat.slime.flags.schedule_config_from_slime_args` +
:func:`~varbatch_kit.core.build.build_schedule`), simulates it
(:func:`~varbatch_kit.analysis.simulate.simulate`, the step-time model of the
hardware table, ``tp`` from the flags) and ranks it
(:func:`~varbatch_kit.analysis.candidates.candidate_figures`):

- ``--max-tokens-per-gpu``: the user's cap, 0.5x and 0.75x of it, and, with
  headroom, three values between it and the **memory limit** and the limit
  itself (rounded down to multiples of 64). The limit is
  ``max_tokens_limit`` tokens when given, else ``max_tokens_headroom`` times
  the user's cap (default 1.0: without a statement about memory the cap is
  never raised). A user on static batching has no cap: the limit is then the
  headroom times the largest micro-batch their own run holds.
- dynamic vs static batching and ``--micro-batch-size`` (1, 2, 4, 8 and
  the user's);
- ``--balance-data`` and ``--balance-by-flops`` (slime's five policies,
  :data:`~varbatch_kit.compat.slime.flags.SLIME_FLAGS`; ``--balance-by-flops``
  at two caps only, the user's and the best first-fit one: its Karmarkar-Karp
  packing is the slow one);
- the global batch size only when asked (``vary_global_batch_size=True``,
  ``--vary-global-batch-size``): it changes the RL algorithm (more or fewer
  optimizer updates per rollout batch), so by default it and
  ``--num-steps-per-rollout`` are the user's. When asked: with
  ``--num-steps-per-rollout`` slime derives it as ``rollout_batch_size *
  n_samples_per_prompt // num_steps_per_rollout`` and the search changes
  ``--num-steps-per-rollout`` (1 to 32); with ``--global-batch-size`` its
  divisors of the trained rollouts. Only values that train exactly the user's
  rollouts are tried (the same work), at most five, nearest the user's first;
- ``--microbatch-group-size-per-vp-stage`` with ``vpp > 1``: ``pp`` to
  ``2 * pp`` (Megatron accepts values from ``pp`` up to the micro-batch count).

The search is staged to stay interactive: batching, cap and policy at the
user's batch size first; the three best settings then meet the other batch
sizes, and the two best meet the group sizes. A candidate is **safe** when
its predicted peak memory per GPU (:mod:`varbatch_kit.core.memory` on its schedule,
with the command line's tp, pp, sequence parallelism, precision, recomputation and
distributed optimizer: :mod:`~varbatch_kit.compat.slime.memory_flags`) fits the memory
budget: the hardware's memory, or the user's own flags' predicted peak where that is
higher (they run). The token caps searched stay within the token limit
(``max_tokens_headroom`` / ``max_tokens_limit``); ``over_limit`` still counts the
micro-batches of two or more samples above it. The recommendation is the
fastest safe candidate or the user's own settings, so it is never slower than
the user's. Its command
line is the user's: changed flags replaced where they stand, new ones
appended, every other flag kept verbatim and in order.

``Recommendation.balanced`` is what the project's ``balanced`` packing (not a
slime option) does with the user's cap, batch size and world size.
"""

from __future__ import annotations

import argparse
import math
import shlex
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from varbatch_kit.checks import number_in, positive_int
from varbatch_kit.compat.slime.flags import (
    SCHEDULE_FLAG_TABLE,
    parse_flag_table,
    schedule_config_from_slime_args,
)
from varbatch_kit.compat.slime.flags import positive_int as flag_int
from varbatch_kit.compat.slime.memory_flags import memory_layout_from_slime_args
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape, as_model_shape
from varbatch_kit.core.hardware import DEFAULT_HARDWARE
from varbatch_kit.core.memory import not_modelled
from varbatch_kit.core.rollouts import Rollouts

__all__ = ["Recommendation", "recommend", "recommended_config"]

#: the rollout flags slime derives the global batch size from (arguments.py, num_steps_per_rollout)
ROLLOUT_FLAGS = ("--rollout-batch-size", "--n-samples-per-prompt", "--num-steps-per-rollout")
_MB_GROUP_FLAGS = ("--microbatch-group-size-per-vp-stage",
                   "--microbatch-group-size-per-virtual-pipeline-stage")
STATIC_SIZES = (1, 2, 4, 8)
MAX_NUM_STEPS = 32
MAX_BATCH_SIZES = 5


def _table() -> tuple:
    from varbatch_kit.compat.slime.memory_flags import MEMORY_FLAG_TABLE
    from varbatch_kit.compat.slime.model_flags import MODEL_FLAG_TABLE

    known = {flag for flag, _ in SCHEDULE_FLAG_TABLE}
    return (SCHEDULE_FLAG_TABLE + tuple((f, {"type": flag_int}) for f in ROLLOUT_FLAGS
                                        if f not in known) + MODEL_FLAG_TABLE
            + MEMORY_FLAG_TABLE)


def _the_model(model, ns: argparse.Namespace) -> ModelShape:
    """The model of the search: ``model`` (a shape, a preset name or a config.json path) or
    the slime command line's model flags; both given must be the same model."""
    from varbatch_kit.compat.slime.model_flags import model_shape_from_slime_args

    from_flags = model_shape_from_slime_args(ns)
    if model is None:
        if from_flags is None:
            raise ValueError("no model: give model= (a ModelShape, a preset name or a "
                             "config.json path) or slime's model flags (--num-layers "
                             "--hidden-size --num-attention-heads --vocab-size ...)")
        return from_flags
    shape = as_model_shape(model)
    if from_flags is not None and shape.flops_fields() != from_flags.flops_fields():
        raise ValueError(f"model={shape.name!r} and the slime command line's model flags "
                         "describe different models; give one of them")
    return shape


def _parse(argv: str | Sequence[str]) -> tuple[list[str], argparse.Namespace]:
    """The user's tokens and their namespace (one warning for the flags that shape nothing)."""
    if not isinstance(argv, (str, list, tuple)):
        raise ValueError(f"slime_args must be a command-line string or a list of strings, got "
                         f"{type(argv).__name__}")
    tokens = shlex.split(argv) if isinstance(argv, str) else list(argv)
    ns = parse_flag_table(tokens, _table(), ignored_because="do not affect the schedule",
                          stacklevel=3)
    return tokens, ns


def _derive_gbs(ns: argparse.Namespace) -> argparse.Namespace:
    """``ns`` with ``global_batch_size`` derived from the rollout flags as slime does."""
    steps = getattr(ns, "num_steps_per_rollout", None)
    if steps is None:
        return ns
    rbs = getattr(ns, "rollout_batch_size", None)
    if rbs is None:
        raise ValueError("--num-steps-per-rollout needs --rollout-batch-size (slime derives "
                         "the global batch size as rollout_batch_size * n_samples_per_prompt "
                         "// num_steps_per_rollout)")
    n = getattr(ns, "n_samples_per_prompt", None) or 1
    gbs = rbs * n // steps
    if gbs < 1:
        raise ValueError(f"--num-steps-per-rollout {steps} is more than rollout_batch_size * "
                         f"n_samples_per_prompt = {rbs * n}: the global batch size would be 0")
    given = getattr(ns, "global_batch_size", None)
    if given is not None and given != gbs:
        raise ValueError(f"--global-batch-size {given} is not rollout_batch_size {rbs} * "
                         f"n_samples_per_prompt {n} // num_steps_per_rollout {steps} = {gbs} "
                         "(slime asserts they agree); drop one of them")
    out = argparse.Namespace(**vars(ns))
    out.global_batch_size = gbs
    return out


def recommended_config(slime_args: str | Sequence[str]) -> ScheduleConfig:
    """The :class:`ScheduleConfig` of a slime command line, the global batch size derived.

    :func:`schedule_config_from_slime_args` with ``--num-steps-per-rollout``,
    ``--rollout-batch-size`` and ``--n-samples-per-prompt`` read as slime
    reads them: what :func:`recommend`'s command line means.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, ns = _parse(slime_args)
    return schedule_config_from_slime_args(_derive_gbs(ns))


# ------------------------------------------------------------------ knobs
@dataclass(frozen=True)
class _Knobs:
    """One point of the search: the values of slime's scheduling flags."""

    dynamic: bool
    size: int  # the cap (dynamic) or the micro-batch size (static)
    distribution: str  # "strided" | "flops_kk" (balance) ...
    by_flops: bool
    gbs: int
    num_steps: int | None
    mb_group: int | None

    @property
    def policy(self) -> str:
        if self.by_flops:
            return "--balance-by-flops"
        return "--balance-data" if self.distribution == "flops_kk" else "(none)"


def _user_knobs(ns: argparse.Namespace, cfg: ScheduleConfig) -> _Knobs:
    return _Knobs(dynamic=cfg.dynamic,
                  size=cfg.max_tokens_per_gpu if cfg.dynamic else cfg.micro_batch_size,
                  distribution=cfg.distribution, by_flops=cfg.packing == "flops_kk",
                  gbs=cfg.global_batch_size, num_steps=getattr(ns, "num_steps_per_rollout", None),
                  mb_group=getattr(ns, "microbatch_group_size_per_vp_stage", None))


def _namespace(ns: argparse.Namespace, k: _Knobs) -> argparse.Namespace:
    out = argparse.Namespace(**vars(ns))
    out.use_dynamic_batch_size = k.dynamic
    out.balance_by_flops = k.by_flops
    if not k.by_flops:
        out.balance_data = k.distribution == "flops_kk"
    if k.dynamic:
        out.max_tokens_per_gpu = k.size
    else:
        out.micro_batch_size = k.size
    out.global_batch_size = k.gbs
    out.num_steps_per_rollout = k.num_steps
    out.microbatch_group_size_per_vp_stage = k.mb_group
    return out


def _changes(ns: argparse.Namespace, user: _Knobs, k: _Knobs) -> dict[str, Any]:
    """Flag -> new value (an int, True to add a switch, False to drop one), in flag order.

    ``ns`` holds the flags as the user gave them (no derived global batch size).
    """
    ch: dict[str, Any] = {}
    if k.dynamic != user.dynamic:
        ch["--use-dynamic-batch-size"] = k.dynamic
    if k.dynamic and (not user.dynamic or k.size != user.size) and \
            getattr(ns, "max_tokens_per_gpu", None) != k.size:
        ch["--max-tokens-per-gpu"] = k.size
    if not k.dynamic and (user.dynamic or k.size != user.size) and \
            (getattr(ns, "micro_batch_size", None) or 1) != k.size:
        ch["--micro-batch-size"] = k.size
    want_balance = k.distribution == "flops_kk" and not k.by_flops
    if not k.by_flops and bool(getattr(ns, "balance_data", False)) != want_balance:
        ch["--balance-data"] = want_balance
    if k.by_flops != bool(getattr(ns, "balance_by_flops", False)):
        ch["--balance-by-flops"] = k.by_flops
    if k.gbs != user.gbs:
        if user.num_steps is not None:
            ch["--num-steps-per-rollout"] = k.num_steps
        if user.num_steps is None or getattr(ns, "global_batch_size", None) is not None:
            ch["--global-batch-size"] = k.gbs
    if k.mb_group != user.mb_group:
        ch["--microbatch-group-size-per-vp-stage"] = k.mb_group
    return ch


def _rewrite(tokens: list[str], changes: dict[str, Any]) -> list[str]:
    """``tokens`` with ``changes`` applied: values replaced in place, new flags appended."""
    names = {f: (f,) for f in changes}
    if "--microbatch-group-size-per-vp-stage" in changes:
        names["--microbatch-group-size-per-vp-stage"] = _MB_GROUP_FLAGS
    out: list[str] = []
    done: set[str] = set()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        flag = next((f for f, ns in names.items() if tok.split("=", 1)[0] in ns), None)
        if flag is None:
            out.append(tok)
            i += 1
            continue
        value = changes[flag]
        has_value = not isinstance(value, bool)
        inline = "=" in tok
        i += 1 if (inline or not has_value) else 2
        if has_value:
            out += [tok.split("=", 1)[0], str(value)]
        elif value:
            out.append(tok)
        done.add(flag)
    for flag, value in changes.items():
        if flag in done or value is False:
            continue
        out += [flag] if value is True else [flag, str(value)]
    return out


# ----------------------------------------------------------------- result
@dataclass(frozen=True, eq=False)
class Recommendation:
    """What :func:`recommend` returns.

    ``table``: one row per candidate tried (pandas), sorted by ``time_s``
    (the rollout batch's simulated seconds; every candidate trains the same
    rollouts), with ``policy, batching, max_tokens_per_gpu, micro_batch_size,
    global_batch_size, num_steps_per_rollout`` (``<NA>`` where it does not
    apply), ``mb_group`` (the flag's value, ``pp`` when unset), the figures of
    :data:`~varbatch_kit.analysis.candidates.CANDIDATE_COLUMNS`, ``safe``,
    ``user`` and ``best`` (bool), ``changed`` (the flags it changes) and
    ``error`` (a layout slime cannot run; its figures NaN). ``user`` and
    ``best`` are those rows (dicts); ``command`` is the best slime command
    line (``user_command`` the user's), ``changes`` its changed flags,
    ``config`` its :class:`ScheduleConfig`. ``balanced``: the ``balanced``
    packing's figures with the user's cap, batch size and world size (None
    on static batching: it needs a cap), ``memory_limit`` the tokens a
    micro-batch may hold (the caps searched), ``memory_budget`` the bytes a GPU may hold (a
    candidate is ``safe`` when its predicted peak, ``peak_gpu_bytes``, fits), ``search_s``
    the wall time of the search.
    """

    table: Any
    user: dict
    best: dict
    command: str
    user_command: str
    changes: dict
    config: ScheduleConfig
    user_config: ScheduleConfig
    balanced: dict | None
    memory_limit: int
    hardware: str
    search_s: float
    notes: tuple[str, ...] = field(default=())
    memory_budget: float = math.nan

    @property
    def speedup(self) -> float:
        """The user's simulated time / the recommended one (>= 1)."""
        return self.user["time_s"] / self.best["time_s"]

    def explain(self) -> str:
        """A few lines: what changes, what it gains, its safety, what ``balanced`` would add."""
        u, b = self.user, self.best
        lines = [f"your flags: {u['time_s']:.2f} s per rollout batch ({u['steps']} steps of "
                 f"{u['step_s']:.2f} s), {u['above_bound']:.3f}x the bound; "
                 f"{u['mb_per_rank']:.1f} micro-batches per rank"]
        if not self.changes:
            lines.append("recommended: keep your flags (no safe candidate is faster)")
        else:
            lines.append(f"recommended: {b['changed']}: {b['time_s']:.2f} s "
                         f"({100 * (1 - b['time_s'] / u['time_s']):.1f} % less, "
                         f"{b['above_bound']:.3f}x the bound), peak micro-batch "
                         f"{b['peak_gpu_tokens']} tokens per GPU (token limit "
                         f"{self.memory_limit})")
        lines.append(f"memory: predicted peak {u['peak_gpu_bytes'] / 2**30:.1f} GiB per GPU with "
                     f"your flags, {b['peak_gpu_bytes'] / 2**30:.1f} GiB recommended; budget "
                     f"{self.memory_budget / 2**30:.1f} GiB ({self.hardware}'s memory, or your "
                     "flags' peak where higher)")
        if b["oversize"]:
            lines.append(f"warning: {b['oversize']} sample(s) longer than the cap; each "
                         "trains alone in its micro-batch")
        if self.balanced is not None:
            bt = self.balanced["time_s"]
            gain = 100 * (1 - bt / b["time_s"])
            lines.append(f"beyond slime: varbatch_kit's 'balanced' packing at your cap and batch "
                         f"size: {bt:.2f} s, " + (
                             f"{gain:.1f} % less than the recommendation (not a slime flag: "
                             "see varbatch_kit.compat.slime.build_dp_schedule)" if gain > 0 else
                             f"{-gain:.1f} % more than the recommendation (its changed flags "
                             "gain more than balancing at your settings)"))
        lines += list(self.notes)
        return "\n".join(lines)


# ----------------------------------------------------------------- search
def _caps(user_cap: int | None, limit: int) -> list[int]:
    """Token caps to try: 0.5x, 0.75x, 1x the user's, and up to four values up to the limit."""
    base = user_cap if user_cap is not None else limit
    caps = {max(1, int(base * f) // 64 * 64) for f in (0.5, 0.75)} | {base, limit}
    if limit > base:
        for j in (1, 2, 3):
            caps.add(int(base * (limit / base) ** (j / 4)) // 64 * 64)
    return sorted(c for c in caps if 1 <= c <= limit)


def _batch_sizes(user: _Knobs, ns: argparse.Namespace, num_rollouts: int,
                 vary: bool) -> list[tuple[int, int | None]]:
    """``(global batch size, num_steps_per_rollout)`` pairs training exactly the user's rollouts."""
    trained = num_rollouts // user.gbs * user.gbs
    if not vary:
        return [(user.gbs, user.num_steps)]
    if user.num_steps is not None:
        total = ns.rollout_batch_size * (getattr(ns, "n_samples_per_prompt", None) or 1)
        pairs = {total // s: s for s in range(MAX_NUM_STEPS, 0, -1) if total // s >= 1}
    else:
        pairs = {g: None for g in range(1, trained + 1) if trained % g == 0}
    pairs[user.gbs] = user.num_steps
    ok = [(g, s) for g, s in pairs.items() if num_rollouts // g * g == trained]
    ok.sort(key=lambda p: (abs(math.log(p[0] / user.gbs)), p[0]))
    return sorted(ok[:MAX_BATCH_SIZES])


def _evaluate(rollouts, model, ns, user, k, limit, hardware, tp, sim_kwargs, budget=None):
    from varbatch_kit.analysis.candidates import CANDIDATE_COLUMNS, candidate_figures
    from varbatch_kit.core.build import build_schedule

    row: dict[str, Any] = {"policy": k.policy, "batching": "dynamic" if k.dynamic else "static",
                           "max_tokens_per_gpu": k.size if k.dynamic else None,
                           "micro_batch_size": None if k.dynamic else k.size,
                           "global_batch_size": k.gbs, "num_steps_per_rollout": k.num_steps,
                           "mb_group": k.mb_group if k.mb_group is not None else
                           int(getattr(ns, "pipeline_model_parallel_size", None) or 1),
                           "error": ""}
    try:
        with warnings.catch_warnings():  # the user's line was warned about once
            warnings.simplefilter("ignore")
            cfg = schedule_config_from_slime_args(_namespace(ns, k))
            sched = build_schedule(rollouts, cfg, model)
        memory = (memory_layout_from_slime_args(_namespace(ns, k), cfg)
                  if not_modelled(model) is None else None)
        row.update(candidate_figures(sched, memory_limit=limit, hardware=hardware, tp=tp,
                                     memory=memory, memory_budget=budget, **sim_kwargs))
        # by predicted bytes; for a model the memory model does not cover, by the tokens a
        # GPU holds against the limit (the user's own flags' peak unless raised)
        row["safe"] = (row["over_limit"] == 0 if memory is None
                       else budget is not None and row["peak_gpu_bytes"] <= budget)
    except ValueError as e:
        row.update({c: math.nan for c in CANDIDATE_COLUMNS}, safe=False, error=str(e))
    return row


def recommend(rollouts: Rollouts, slime_args: str | Sequence[str],
              model: ModelShape | str | None = None, *,
              max_tokens_headroom: float = 1.0, max_tokens_limit: int | None = None,
              vary_global_batch_size: bool | None = None, hardware: str = DEFAULT_HARDWARE,
              **simulate_kwargs: Any) -> Recommendation:
    """The fastest safe slime flags for ``rollouts``, keeping the world size and the model.

    Parameters
    ----------
    rollouts:
        One rollout batch (a trace or a slime dump, :func:`varbatch_kit.read_trace`).
    slime_args:
        The user's slime command line (a string or a list of arguments), read
        strictly (a bad value or an abbreviated flag is a ``ValueError`` naming it).
    model:
        The model shape (FLOPs drive the simulated times): a ``ModelShape``, a preset name
        (``"qwen2.5-0.5b"``, :func:`~varbatch_kit.available_presets`, as ``--model`` takes)
        or a Hugging Face ``config.json`` path; None: the model flags of ``slime_args``
        (``--num-layers --hidden-size ...``, as slime computes FLOPs from them:
        :func:`~varbatch_kit.compat.slime.model_flags.model_shape_from_slime_args`).
        Both given must describe the same model.
    max_tokens_headroom:
        How far ``--max-tokens-per-gpu`` may grow, as a multiple of the user's
        (>= 1; default 1.0: not at all).
    max_tokens_limit:
        Instead, the most tokens per GPU a micro-batch may hold (>= the user's cap).
    vary_global_batch_size:
        True: also search the global batch size (through
        ``--num-steps-per-rollout`` when the user gives it, else
        ``--global-batch-size``); None or False (default): keep the user's
        (changing it changes the RL algorithm: optimizer updates per rollout
        batch).
    hardware, simulate_kwargs:
        The step-time model's (:func:`varbatch_kit.analysis.simulate.simulate`).

    See the module docstring for the search space and the safety rule.
    """
    from varbatch_kit.core.build import build_schedule

    t0 = time.perf_counter()
    if not isinstance(rollouts, Rollouts):
        raise ValueError(f"rollouts must be a Rollouts, got {type(rollouts).__name__}")
    headroom = number_in("max_tokens_headroom", max_tokens_headroom, 1.0,
                         note=" (a multiple of the user's --max-tokens-per-gpu)")
    if vary_global_batch_size not in (None, True, False):
        raise ValueError(f"vary_global_batch_size must be None, True or False, got "
                         f"{vary_global_batch_size!r}")
    tokens, raw = _parse(slime_args)
    model = _the_model(model, raw)
    gap = not_modelled(model)
    if gap is not None:
        warnings.warn(f"recommend: {gap}; safety is judged by the tokens a GPU holds against "
                      "the limit (your own flags' peak unless max_tokens_headroom or "
                      "max_tokens_limit raise it)", UserWarning, stacklevel=2)
    ns = _derive_gbs(raw)
    user_cfg = schedule_config_from_slime_args(ns)
    user = _user_knobs(ns, user_cfg)
    tp = int(getattr(ns, "tensor_model_parallel_size", None) or 1)
    if user.dynamic:
        base_limit = user.size
    else:  # the largest micro-batch the user's static run holds
        from varbatch_kit.analysis.quality import step_quality

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            user_sched = build_schedule(rollouts, user_cfg, model)
        # per GPU: a micro-batch is split over the cp GPUs of its CP group
        base_limit = -(-int(step_quality(user_sched)["max_mb_tokens"].max()) // user_cfg.cp)
    if max_tokens_limit is not None:
        limit = positive_int("max_tokens_limit", max_tokens_limit)
        if user.dynamic and limit < user.size:
            raise ValueError(f"max_tokens_limit={limit} is below your --max-tokens-per-gpu "
                             f"{user.size}: give a limit >= {user.size}")
    else:
        limit = int(base_limit * headroom)
    vary = bool(vary_global_batch_size)  # the RL algorithm's: the user's unless asked
    args = (rollouts, model, ns, user)
    seen: dict[_Knobs, dict] = {}

    # the memory budget: the device's memory, or more where the user's own flags are
    # predicted to need more (they run; the model is of the engine's kernels, not slime's);
    # a measured cost model knows no memory: the user's flags' peak
    own = _evaluate(*args, user, limit, hardware, tp, simulate_kwargs)
    if own["error"]:  # the user's own layout cannot run: say why
        raise ValueError(own["error"])
    from varbatch_kit.analysis.candidates import device_bytes

    budget = max(device_bytes(hardware) or 0.0, float(own["peak_gpu_bytes"]))
    seen[user] = {**own, "safe": True}

    def run(k: _Knobs) -> dict:
        if k not in seen:
            seen[k] = _evaluate(*args, k, limit, hardware, tp, simulate_kwargs, budget)
        return seen[k]

    same = {"gbs": user.gbs, "num_steps": user.num_steps, "mb_group": user.mb_group}
    caps = _caps(user.size if user.dynamic else None, limit)
    for cap in caps:  # stage 1: cap and policy, the user's batch size
        for dist in ("strided", "flops_kk"):
            run(_Knobs(True, cap, dist, False, **same))
    sizes = sorted(set(STATIC_SIZES) | ({user.size} if not user.dynamic else set()))
    for mbs in sizes:
        for dist in ("strided", "flops_kk"):
            run(_Knobs(False, mbs, dist, False, **same))
    ranked = _ranked(seen)
    best_cap = next((k.size for k in ranked if k.dynamic), caps[-1])
    for cap in sorted({caps[-1] if not user.dynamic else user.size, best_cap}):
        run(_Knobs(True, cap, "flops_kk", True, **same))
    # stage 2: the best settings at the other batch and group sizes (--balance-by-flops, the
    # slow packing, only when it is the best)
    ranked = _ranked(seen)
    top = ranked[:1] + [k for k in ranked[1:] if not k.by_flops][:2]
    for gbs, steps in _batch_sizes(user, ns, rollouts.num_rollouts, vary):
        for k in top:
            run(_Knobs(k.dynamic, k.size, k.distribution, k.by_flops, gbs, steps, k.mb_group))
    if user_cfg.vpp > 1:
        for k in _ranked(seen)[:2]:
            for g in range(user_cfg.pp, 2 * user_cfg.pp + 1):
                if k.mb_group is None and g == user_cfg.mb_group:
                    continue  # the flag's default
                run(_Knobs(k.dynamic, k.size, k.distribution, k.by_flops, k.gbs, k.num_steps, g))
    best = next((k for k in _ranked(seen) if seen[k]["time_s"] <= seen[user]["time_s"]), user)
    if not seen[best]["time_s"] < seen[user]["time_s"]:
        best = user
    return _result(tokens, raw, user, best, seen, user_cfg, rollouts, model, limit, hardware,
                   tp, simulate_kwargs, t0, budget)


def _ranked(seen: dict) -> list[_Knobs]:
    """Safe candidates that ran, fastest first."""
    ok = [k for k, r in seen.items() if r["safe"] and not r["error"]]
    return sorted(ok, key=lambda k: seen[k]["time_s"])


def _result(tokens, raw, user, best, seen, user_cfg, rollouts, model, limit, hardware, tp,
            sim_kwargs, t0, budget) -> Recommendation:
    import pandas as pd

    from varbatch_kit.analysis.candidates import candidate_figures
    from varbatch_kit.core.build import build_schedule

    rows = []
    for k, r in seen.items():
        ch = _changes(raw, user, k)
        rows.append({**r, "user": k == user, "best": k == best,
                     "changed": " ".join(_flag_text(f, v) for f, v in ch.items()) or "(yours)"})
    table = pd.DataFrame(rows).sort_values("time_s", kind="stable", na_position="last")
    table = table.reset_index(drop=True)
    for col in ("max_tokens_per_gpu", "micro_batch_size", "num_steps_per_rollout", "steps",
                "peak_mb_tokens", "peak_gpu_tokens", "oversize", "over_limit",
                "peak_gpu_bytes", "over_memory"):
        table[col] = pd.array([None if v is None or v != v else int(v) for v in table[col]],
                              dtype="Int64")
    changes = _changes(raw, user, best)
    command = shlex.join(_rewrite(tokens, changes))
    config = recommended_config(command)
    balanced = None
    notes = []
    if user_cfg.dynamic:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sched = build_schedule(rollouts, user_cfg.with_(packing="balanced",
                                                            distribution="balanced"), model)
        memory = (memory_layout_from_slime_args(raw, sched.config)
                  if not_modelled(model) is None else None)
        balanced = candidate_figures(sched, memory_limit=limit, hardware=hardware, tp=tp,
                                     memory=memory, memory_budget=budget, **sim_kwargs)
    else:
        notes.append("'balanced' needs a token cap (dynamic batching): not compared")
    return Recommendation(
        table=table, user=dict(seen[user]), best={**seen[best], "changed": " ".join(
            _flag_text(f, v) for f, v in changes.items()) or "(yours)"},
        command=command, user_command=shlex.join(tokens), changes=changes, config=config,
        user_config=user_cfg, balanced=balanced, memory_limit=int(limit), hardware=str(hardware),
        search_s=time.perf_counter() - t0, notes=tuple(notes), memory_budget=float(budget))


def _flag_text(flag: str, value: Any) -> str:
    if value is True:
        return flag
    if value is False:
        return f"(no {flag})"
    return f"{flag} {value}"
