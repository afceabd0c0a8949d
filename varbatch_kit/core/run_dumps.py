"""A whole slime run: every rollout step's debug dump, read as one object.

slime's ``--save-debug-rollout-data TEMPLATE`` writes one dump per rollout step
to ``TEMPLATE.format(rollout_id=k)`` (e.g. ``run/rollout_{rollout_id}.pt`` ->
``run/rollout_0.pt``, ``run/rollout_1.pt``, ...) and its evaluation rollouts to
``TEMPLATE.format(rollout_id="eval_" + str(k))`` (``run/rollout_eval_0.pt``).
:func:`read_run` takes that template, or the directory the dumps are in, and
returns a :class:`RunDumps`: the training rollout steps in ``rollout_id``
order, each a :class:`RolloutStep` holding the :class:`Rollouts` of its dump
(read by :func:`~varbatch_kit.core.slime_dumps.read_slime_dump`, so with the
same columns as one dump) and its rollout id. Evaluation dumps are not
trained on: they are listed in :attr:`RunDumps.eval_paths` and not read.

One file is one rollout batch (:func:`~varbatch_kit.core.traces.read_trace`,
which returns :class:`Rollouts`); a run is several (:func:`read_run`, which
returns :class:`RunDumps`): one function per return type.
:func:`is_run_path` says which of the two a path is; :func:`bundled_runs`
lists the runs shipped with the package (``data/runs``: eight small rollout
steps written by slime's own ``save_debug_rollout_data``).

Errors are :class:`~varbatch_kit.core.trace_errors.TraceError`: no dump found
(naming the pattern looked for), a file that is not a dump (the dump's own
error, naming the file), a directory mixing several templates or slime dumps
with trace tables, two dumps of one rollout id, a dump whose ``rollout_id``
disagrees with its file name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.core.slime_dumps import read_slime_dump_with_id
from varbatch_kit.core.trace_errors import TraceError
from varbatch_kit.resources import data_dir

__all__ = ["RUNS_DIR", "RUN_TEMPLATE_FIELD", "RolloutStep", "RunDumps", "bundled_runs",
           "is_run_path", "read_run"]

#: the slime runs shipped with the package (``data/runs``: one folder of dumps each)
RUNS_DIR = Path(str(data_dir("runs")))

#: the placeholder slime's ``--save-debug-rollout-data`` template holds
RUN_TEMPLATE_FIELD = "{rollout_id}"
DUMP_SUFFIXES = (".pt", ".pth")
#: trace tables: a directory holding them and dumps is not one run
TABLE_SUFFIXES = (".jsonl", ".parquet", ".pq")
# a dump's file name: <prefix><id or eval_id><suffix>
_NAME = re.compile(r"^(?P<prefix>.*?)(?P<eval>eval_)?(?P<id>\d+)(?P<suffix>\.pth?)$",
                   re.IGNORECASE)


@dataclass(frozen=True)
class RolloutStep:
    """One rollout step of a run: its ``rollout_id``, its samples and the dump read."""

    rollout_id: int
    rollouts: Rollouts
    path: Path

    def __repr__(self) -> str:
        return (f"RolloutStep(rollout_id={self.rollout_id}, {self.rollouts!r}, "
                f"path={self.path.name!r})")


@dataclass(frozen=True)
class RunDumps:
    """The rollout steps of one slime run, in ``rollout_id`` order.

    Attributes
    ----------
    pattern:
        The template the dumps were found by (``.../rollout_{rollout_id}.pt``).
    steps:
        One :class:`RolloutStep` per training dump, by increasing rollout id.
    eval_paths:
        The evaluation dumps the template also matched (``rollout_eval_K.pt``),
        not read.
    """

    pattern: str
    steps: tuple[RolloutStep, ...]
    eval_paths: tuple[Path, ...] = ()

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[RolloutStep]:
        return iter(self.steps)

    @property
    def rollout_ids(self) -> list[int]:
        """The rollout ids of the steps, increasing."""
        return [s.rollout_id for s in self.steps]

    @property
    def num_samples(self) -> int:
        """Samples over every step."""
        return sum(len(s.rollouts) for s in self.steps)

    def step(self, rollout_id: int) -> Rollouts:
        """The rollouts of rollout step ``rollout_id``; a ``ValueError`` names the ids there are."""
        for s in self.steps:
            if s.rollout_id == rollout_id:
                return s.rollouts
        raise ValueError(f"rollout_id={rollout_id!r} is not a step of this run; its rollout ids "
                         f"are {self.rollout_ids}")

    def __repr__(self) -> str:
        ids = self.rollout_ids
        span = f"{ids[0]}..{ids[-1]}" if len(ids) > 1 else str(ids[0])
        return (f"RunDumps({len(self)} rollout steps (rollout_id {span}), {self.num_samples} "
                f"samples, pattern={self.pattern!r})")


def bundled_runs() -> dict[str, Path]:
    """Name → template (``.../rollout_{rollout_id}.pt``) of the runs shipped with the package."""
    return {p.name: p / f"rollout_{RUN_TEMPLATE_FIELD}.pt"
            for p in sorted(RUNS_DIR.iterdir()) if p.is_dir() and any(p.glob("*.pt"))}


def is_run_path(path: str | Path) -> bool:
    """True for what :func:`read_run` reads: a directory, or a path holding ``{rollout_id}``."""
    return RUN_TEMPLATE_FIELD in str(path) or Path(path).is_dir()


def _template_regex(template: str) -> re.Pattern:
    head, tail = Path(template).name.split(RUN_TEMPLATE_FIELD, 1)
    return re.compile("^" + re.escape(head) + r"(?P<eval>eval_)?(?P<id>\d+)" + re.escape(tail)
                      + "$")


def _from_template(template: str) -> tuple[str, list[tuple[int, Path]], list[Path]]:
    if str(template).count(RUN_TEMPLATE_FIELD) != 1:
        raise TraceError(f"run template {template!r} must hold {RUN_TEMPLATE_FIELD} exactly "
                         "once, as slime's --save-debug-rollout-data does (e.g. "
                         "run/rollout_{rollout_id}.pt)")
    if RUN_TEMPLATE_FIELD in str(Path(template).parent):
        raise TraceError(f"run template {template!r}: {RUN_TEMPLATE_FIELD} must be in the file "
                         "name, not in a folder of the path")
    folder, regex = Path(template).parent, _template_regex(template)
    train: list[tuple[int, Path]] = []
    evals: list[Path] = []
    if folder.is_dir():
        for p in sorted(folder.iterdir()):
            m = regex.match(p.name)
            if m and p.is_file():
                (evals.append(p) if m["eval"] else train.append((int(m["id"]), p)))
    return str(template), train, evals


def _from_directory(folder: Path) -> tuple[str, list[tuple[int, Path]], list[Path]]:
    files = [p for p in sorted(folder.iterdir()) if p.is_file()]
    dumps = [p for p in files if p.suffix.lower() in DUMP_SUFFIXES]
    tables = [p.name for p in files if p.suffix.lower() in TABLE_SUFFIXES]
    looked = str(folder / ("*" + RUN_TEMPLATE_FIELD + ".pt"))
    if not dumps:
        found = f"; it holds trace tables {tables}: read each with read_trace" if tables else ""
        raise TraceError(f"no slime dump found in {str(folder)!r}: looked for {looked} (the "
                         f"files slime's --save-debug-rollout-data writes){found}")
    if tables:
        raise TraceError(
            f"{str(folder)!r} mixes formats: slime dumps ({len(dumps)} .pt files) and trace "
            f"tables ({', '.join(tables)}); a run is a folder of slime dumps only: pass the "
            f"dumps' template instead, e.g. {str(folder / dumps[0].name)!r} with its rollout "
            f"id replaced by {RUN_TEMPLATE_FIELD}")
    groups: dict[tuple[str, str], list[Path]] = {}
    unnumbered = []
    for p in dumps:
        m = _NAME.match(p.name)
        if m is None:
            unnumbered.append(p.name)
        else:
            groups.setdefault((m["prefix"], m["suffix"]), []).append(p)
    if unnumbered:
        raise TraceError(
            f"{str(folder)!r}: {unnumbered} do not end in a rollout id, so they are not dumps of "
            f"a run (slime names them by {looked}); move them out or pass the template of "
            "the run's dumps")
    if len(groups) > 1:
        names = ", ".join(f"{prefix}{RUN_TEMPLATE_FIELD}{suffix} ({len(ps)} files)"
                          for (prefix, suffix), ps in sorted(groups.items()))
        raise TraceError(
            f"{str(folder)!r} holds the dumps of several templates: {names}; pass the template "
            f"of one run, e.g. {str(folder / next(iter(sorted(groups)))[0])}"
            f"{RUN_TEMPLATE_FIELD}.pt")
    (prefix, suffix), = groups
    return _from_template(str(folder / f"{prefix}{RUN_TEMPLATE_FIELD}{suffix}"))


def read_run(path: str | Path) -> RunDumps:
    """Read every rollout step of a slime run: a directory of dumps or slime's template.

    ``path`` is the value of slime's ``--save-debug-rollout-data`` (a path
    whose file name holds ``{rollout_id}``, e.g. ``run/rollout_{rollout_id}.pt``)
    or the directory the dumps are in (it must hold the dumps of one template,
    and no trace tables). Each dump is read with
    :func:`~varbatch_kit.core.slime_dumps.read_slime_dump` (columns as
    :func:`~varbatch_kit.core.traces.read_trace` lists them, including
    ``rollout_log_probs``, ``teacher_log_probs`` and ``weight_versions``);
    the steps come in increasing ``rollout_id`` (``rollout_10`` after
    ``rollout_9``). Evaluation dumps (``rollout_eval_K.pt``) are listed in
    ``eval_paths``, not read. Raises
    :class:`~varbatch_kit.core.trace_errors.TraceError` (see the module doc).
    """
    if RUN_TEMPLATE_FIELD in str(path):
        pattern, found, evals = _from_template(str(path))
    elif Path(path).is_dir():
        pattern, found, evals = _from_directory(Path(path))
    elif Path(path).is_file():
        raise TraceError(f"{str(path)!r} is one dump, not a run: read it with read_trace, or "
                         f"pass its folder or the run's template (e.g. "
                         f"{str(Path(path).parent / ('rollout_' + RUN_TEMPLATE_FIELD + '.pt'))})")
    else:
        raise TraceError(f"run {str(path)!r} does not exist: pass a folder of slime dumps or "
                         f"slime's --save-debug-rollout-data template (with "
                         f"{RUN_TEMPLATE_FIELD})")
    if not found:
        only = f" (only evaluation dumps: {[p.name for p in evals]})" if evals else ""
        raise TraceError(f"no slime dump found for run {pattern!r}: looked for files named "
                         f"{Path(pattern).name} ({RUN_TEMPLATE_FIELD} an integer) in "
                         f"{str(Path(pattern).parent)!r}{only}")
    by_id: dict[int, Path] = {}
    for rid, p in found:
        if rid in by_id:
            raise TraceError(f"run {pattern!r}: {by_id[rid].name} and {p.name} are both dumps "
                             f"of rollout_id {rid}; keep one")
        by_id[rid] = p
    steps = []
    for rid in sorted(by_id):
        p = by_id[rid]
        rollouts, saved = read_slime_dump_with_id(p)  # not a dump: raises, naming the file
        if saved is not None and saved != rid:
            raise TraceError(f"slime dump {str(p)!r} says rollout_id {saved} but its name says "
                             f"{rid}; slime writes both from the same rollout id")
        steps.append(RolloutStep(rid, rollouts, p))
    return RunDumps(pattern, tuple(steps), tuple(evals))
