"""Your task in the RL loop: prompts, a reward function and a group filter with slime's signatures.

slime users bring a reward as ``--custom-rm-path module.func`` and a group filter as
``--dynamic-sampling-filter-path module.func``; the same functions plug in here unchanged:

Reward (slime's ``custom_rm``)
    ``async def rm(args, sample, **kwargs) -> float`` (a plain ``def`` works too), or with
    ``group=True`` (slime's ``--group-rm``) ``rm(args, samples, **kwargs) -> list[float]``
    over the samples of one prompt group. ``sample`` is a :class:`Sample` with the fields of
    slime's ``Sample`` such functions read (``prompt``, ``response``, ``label``,
    ``metadata``, ``index``, ``group_index``, ``tokens``, ``response_length``, ``status``,
    ``reward``, ``get_reward_value(args)``); ``args`` is the namespace of slime's
    arguments the loop was given (:func:`slime_args`).
Group filter (slime's ``dynamic_sampling_filter``)
    ``fn(args, samples, **kwargs)`` over one prompt group's samples (their rewards set),
    returning a bool or an object with ``keep``, ``reason`` and ``keep_when_insufficient``
    (slime's ``DynamicFilterOutput``; :class:`FilterOutput` here). ``"nonzero_std"`` is
    DAPO's: keep a group whose rewards are not all equal (:func:`nonzero_reward_std`,
    checked against slime's own on recorded groups); ``"nonzero_std_with_fallback"`` keeps
    a rejected group when the batch cannot spare it.
Prompts (slime's ``--prompt-data`` with ``--input-key`` / ``--label-key`` /
``--metadata-key``)
    :func:`read_prompts` reads a JSONL file into :class:`Problem` rows (question, label,
    metadata).

A function is given as a callable or as slime's dotted path (``"my_rm.score"``, imported with
:func:`load_function`). :func:`score` calls a reward function the way slime does (awaiting
it when it is a coroutine) and checks what it returns.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["FilterOutput", "Problem", "Sample", "filter_group", "load_function",
           "nonzero_reward_std", "nonzero_reward_std_with_fallback", "read_prompts",
           "resolve_function", "score", "slime_args"]


@dataclass(frozen=True)
class Problem:
    """One prompt: the user's question, its label (an arithmetic question's integer answer;
    any JSON value for your own reward) and metadata (the reward sees both)."""

    question: str
    answer: Any = None
    metadata: dict = field(default_factory=dict, compare=False)


@dataclass
class Sample:
    """One response as slime's reward functions and filters see it (slime's ``Sample``
    fields they read). ``index``: the rollout id; ``group_index``: the prompt's group;
    ``prompt``: the conversation so far as text (chat template applied); ``label``: the
    prompt's label (the answer of an arithmetic question)."""

    index: int
    group_index: int
    prompt: str
    response: str
    label: Any = None
    metadata: dict = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    reward: Any = None
    status: str = "completed"

    def get_reward_value(self, args) -> float:
        """The reward, or its ``args.reward_key`` entry (slime's ``--reward-key``)."""
        key = getattr(args, "reward_key", None)
        return self.reward if not key else self.reward[key]


@dataclass
class FilterOutput:
    """A group filter's verdict (slime's ``DynamicFilterOutput``): ``keep_when_insufficient``
    keeps a rejected group when dropping it would leave too few to fill the batch."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


def slime_args(**values: Any) -> SimpleNamespace:
    """The ``args`` namespace reward functions and filters receive: slime's attribute names
    (``n_samples_per_prompt``, ``rollout_batch_size``, ``over_sampling_batch_size``,
    ``reward_key``, ``group_rm``, ...), ``reward_key=None`` unless given."""
    return SimpleNamespace(**{"reward_key": None, **values})


def load_function(path: str) -> Callable:
    """``"package.module.func"`` imported (slime's ``load_function``), with an error that
    says what is missing."""
    if not isinstance(path, str) or "." not in path.strip("."):
        raise ValueError(f"{path!r}: give a function as 'module.function' (as slime's "
                         "--custom-rm-path takes it) or a callable")
    module_path, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ValueError(f"{path!r}: cannot import module {module_path!r} ({e}); is it on "
                         "sys.path?") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{path!r}: module {module_path!r} has no function {name!r}")
    return fn


def resolve_function(fn: Callable | str | None, what: str) -> Callable | None:
    """A callable, a dotted path (imported) or None, checked."""
    if fn is None or callable(fn):
        return fn
    if isinstance(fn, str):
        return load_function(fn)
    raise ValueError(f"{what}={fn!r}: give a callable or a 'module.function' path")


def _resolved(value):
    """``value``, awaited when the function returned a coroutine (an ``async def`` reward)."""
    if inspect.isawaitable(value):
        async def wait():
            return await value

        return asyncio.run(wait())
    return value


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            float(value)):
        raise ValueError(f"{where} returned {value!r}: a reward must be a finite number")
    return float(value)


def score(fn: Callable, args, samples: Sequence[Sample], *, group: bool = False) -> list[float]:
    """The rewards of ``samples`` (one prompt group) by ``fn``: one call per sample, or one
    call for the group with ``group=True`` (slime's ``--group-rm``). Sets each sample's
    ``reward`` and returns them."""
    name = getattr(fn, "__qualname__", repr(fn))
    if group:
        out = _resolved(fn(args, list(samples)))
        if not isinstance(out, (list, tuple)) or len(out) != len(samples):
            raise ValueError(f"the group reward {name} returned {out!r} for {len(samples)} "
                             "samples: give one reward per sample (a list)")
        rewards = [_number(v, f"the group reward {name}") for v in out]
    else:
        rewards = [_number(_resolved(fn(args, s)), f"the reward {name}") for s in samples]
    for s, r in zip(samples, rewards):
        s.reward = r
    return rewards


def nonzero_reward_std(args, samples: Sequence[Sample], **kwargs) -> FilterOutput:
    """DAPO's dynamic sampling filter (slime's ``check_reward_nonzero_std``): keep a group
    whose rewards are not all equal (standard deviation above 1e-6); a dropped group's
    reason names its common reward, ``zero_std_<reward>``."""
    rewards = [float(s.get_reward_value(args)) for s in samples]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1))
    keep = std > 1e-6
    return FilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def nonzero_reward_std_with_fallback(args, samples: Sequence[Sample], **kwargs) -> FilterOutput:
    """:func:`nonzero_reward_std` that keeps a rejected group rather than start another round
    of generation (``keep_when_insufficient``; slime's
    ``check_reward_nonzero_std_with_fallback``)."""
    out = nonzero_reward_std(args, samples)
    out.keep_when_insufficient = True
    return out


#: the group filters known by name
FILTERS = {"nonzero_std": nonzero_reward_std,
           "nonzero_std_with_fallback": nonzero_reward_std_with_fallback}


def filter_group(fn: Callable | None, args, samples: Sequence[Sample]) -> FilterOutput:
    """``fn``'s verdict on one group as a :class:`FilterOutput` (a bare bool, as older slime
    filters return, is ``keep``); no filter keeps everything."""
    if fn is None:
        return FilterOutput(keep=True)
    out = fn(args, list(samples))
    if isinstance(out, bool) or (hasattr(out, "item") and isinstance(out.item(), bool)):
        return FilterOutput(keep=bool(out))  # a bool, or a numpy / torch boolean scalar
    if not hasattr(out, "keep"):
        raise ValueError(f"the group filter {getattr(fn, '__qualname__', fn)} returned "
                         f"{out!r}: give a bool or an object with keep (and reason, "
                         "keep_when_insufficient), as slime's DynamicFilterOutput")
    return FilterOutput(keep=bool(out.keep), reason=getattr(out, "reason", None),
                        keep_when_insufficient=bool(getattr(out, "keep_when_insufficient",
                                                            False)))


def read_prompts(path: str | Path, *, input_key: str = "input", label_key: str | None = "label",
                 metadata_key: str = "metadata") -> list:
    """The prompts of a JSONL file (one object per line; slime's ``--prompt-data`` with its
    ``--input-key`` / ``--label-key`` / ``--metadata-key``) as ``Problem(question, label,
    metadata)`` rows. The input must be a string (a user message)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} does not exist")
    out = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get(input_key), str):
                raise ValueError(f"{path}:{line_no}: needs a string under input_key="
                                 f"{input_key!r} (slime's --input-key); keys: "
                                 f"{sorted(row) if isinstance(row, dict) else type(row).__name__}")
            meta = row.get(metadata_key) or {}
            out.append(Problem(row[input_key], row.get(label_key) if label_key else None,
                               dict(meta) if isinstance(meta, dict) else {"value": meta}))
    if not out:
        raise ValueError(f"prompt file {str(path)!r} holds no prompts")
    return out
