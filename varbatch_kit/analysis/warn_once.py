"""Each warning once per call, with the number of schedules that raised it.

A table or a sweep builds many schedules, and :func:`~varbatch_kit.core.build.build_schedule`
warns once per call: :class:`~varbatch_kit.core.build.OversizeSampleWarning` for samples
longer than the token cap, and the ``varbatch_kit`` logger's "dropping N trailing rollouts"
(and the alignment fallback's) messages. A table of 13 policies said the same thing 13
times. :func:`warn_once` wraps such a call: each schedule is built inside ``tally.case()``;
the warnings and log records raised there are held back and, when the call returns, each
kind is said once with its count::

    in 13 of 13 policies: 224 of 1024 samples (21.9 %) are longer than the token cap ...

A *kind* is a warning category or a log message's template (``record.msg``); cases that
said different things (other counts, another cap) give one line each in the same
message. A warning is re-issued at the first caller outside this package (as
``build_schedule``'s points at its caller), so the user's filters (``ignore``,
``error``) apply to it as to the original; a log record is re-logged on the same logger at
its level. A case that raised (a layout the policy cannot run) is not counted and its
records are dropped: the table says why in its ``error`` column.

A :func:`warn_once` inside another one in the same thread (``policy_table_by_trace``
calls ``policy_table``) joins it: its cases count in the outer call, which speaks once.
Warnings and records from other threads, and warnings of other categories, pass through
untouched.

Pure: the standard library's ``warnings`` and ``logging`` only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Collection, Iterator
from pathlib import Path

from varbatch_kit.core.build import OversizeSampleWarning

__all__ = ["SCHEDULE_LOGGER", "WarningTally", "warn_once"]

#: the logger :func:`~varbatch_kit.core.build.build_schedule` writes its warnings to
SCHEDULE_LOGGER = "varbatch_kit"
#: the warning categories held back by default
SCHEDULE_WARNINGS: tuple[type[Warning], ...] = (OversizeSampleWarning,)
#: how many distinct messages of one kind are spelled out (the rest are counted)
MAX_LINES = 4

_PACKAGE_DIR = os.path.join(str(Path(__file__).resolve().parents[1]), "")
_local = threading.local()


class WarningTally:
    """What one :func:`warn_once` call holds back: per kind, per message, the cases."""

    def __init__(self, unit: str, categories: tuple[type[Warning], ...],
                 hold_back: bool | Collection) -> None:
        self.unit = unit
        self.categories = categories
        self.hold_back = hold_back
        #: schedules built (cases that returned)
        self.cases = 0
        self._started = 0
        self._running: int | None = None
        self._thread = threading.get_ident()
        # kind -> [level, {message: set of cases}], in the order first said
        self._said: dict[object, list] = {}

    # ------------------------------------------------------------------ recording
    @contextlib.contextmanager
    def case(self) -> Iterator[None]:
        """One schedule: its warnings and records are held back; counted when it returns."""
        if self._running is not None or threading.get_ident() != self._thread:
            yield  # inside a case already (or another thread): part of that one
            return
        index = self._started
        self._started += 1
        pending: list[tuple[object, int, str]] = []
        live = [True]  # False once the case is over
        log = logging.getLogger(SCHEDULE_LOGGER)
        hold = _HoldRecords(self._thread, pending)
        with warnings.catch_warnings():
            for category in self.categories:
                warnings.simplefilter("always", category)
            shown = warnings.showwarning
            warnings.showwarning = self._shower(shown, pending, live)
            log.addFilter(hold)
            self._running = index
            try:
                yield
            finally:
                self._running = None
                live[0] = False
                log.removeFilter(hold)
        self.cases += 1  # not reached when the case raised: its records are dropped
        for kind, level, text in pending:
            entry = self._said.setdefault(kind, [level, {}])
            entry[1].setdefault(text, set()).add(index)

    def _shower(self, shown, pending: list, live: list):
        """A ``warnings.showwarning`` that keeps the case's warnings and passes on the rest.

        ``catch_warnings`` is process-wide: when another thread's one restores this shower
        after the case ended (``live[0]`` false), it only passes warnings on.
        """
        categories, thread = self.categories, self._thread

        def show(message, category, filename, lineno, file=None, line=None):
            if (live[0] and threading.get_ident() == thread
                    and issubclass(category, categories)):
                pending.append((category, logging.WARNING, str(message)))
            else:
                shown(message, category, filename, lineno, file, line)
        return show

    # ------------------------------------------------------------------ speaking
    def messages(self) -> list[tuple[object, int, str]]:
        """``(kind, level, text)`` of every kind said and not held back, in order."""
        out = []
        for kind, (level, texts) in self._said.items():
            if self.hold_back is True or (self.hold_back and kind in self.hold_back):
                continue
            out.append((kind, level, self._text(texts)))
        return out

    def _text(self, texts: dict[str, set[int]]) -> str:
        items = list(texts.items())
        if self.cases == 1 and len(items) == 1:
            return items[0][0]  # one schedule: its own words
        lines = [f"in {len(cases)} of {self.cases} {self.unit}: {text}"
                 for text, cases in items[:MAX_LINES]]
        rest = items[MAX_LINES:]
        if rest:
            n = len(set().union(*(cases for _, cases in rest)))
            lines.append(f"(and {len(rest)} other variants of this message, in {n} of the "
                         f"{self.cases} {self.unit})")
        return "\n".join(lines)

    def speak(self) -> None:
        """Say each kind once: a warning at the caller, a record on the logger."""
        for kind, level, text in self.messages():
            if isinstance(kind, type) and issubclass(kind, Warning):
                _warn_at_caller(text, kind)
            else:
                logging.getLogger(SCHEDULE_LOGGER).log(level, text)


class _HoldRecords(logging.Filter):
    """A logger filter that keeps the warnings of one thread for the tally."""

    def __init__(self, thread: int, pending: list) -> None:
        super().__init__()
        self.thread, self.pending = thread, pending

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.thread != self.thread:
            return True
        self.pending.append((str(record.msg), record.levelno, record.getMessage()))
        return False


def _warn_at_caller(text: str, category: type[Warning]) -> None:
    """``warnings.warn`` from the first frame outside this package (and ``contextlib``)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE_DIR)
                                 or frame.f_code.co_filename == contextlib.__file__):
        frame = frame.f_back
    if frame is None:
        warnings.warn(text, category, stacklevel=2)
        return
    g = frame.f_globals
    warnings.warn_explicit(text, category, frame.f_code.co_filename, frame.f_lineno,
                           module=g.get("__name__", "<string>"),
                           registry=g.setdefault("__warningregistry__", {}))


@contextlib.contextmanager
def warn_once(unit: str, *, categories: tuple[type[Warning], ...] = SCHEDULE_WARNINGS,
              hold_back: bool | Collection = ()) -> Iterator[WarningTally]:
    """Hold back the schedules' warnings of a call; say each kind once when it returns.

    Parameters
    ----------
    unit:
        What a case is, plural, for the count (``"policies"``, ``"layouts"``).
    categories:
        The warning categories held back (default: ``OversizeSampleWarning``); the
        ``varbatch_kit`` logger's records of level WARNING and above always are.
    hold_back:
        Kinds not said at all (a column of the result counts them): warning categories
        or log templates (e.g. :data:`varbatch_kit.core.build.DROPPED_ROLLOUTS_MESSAGE`);
        ``True``: none is said.

    Yields the :class:`WarningTally`; build each schedule inside ``tally.case()``.
    Nothing is said when the call raises.
    """
    outer = getattr(_local, "tally", None)
    if outer is not None:
        yield outer  # joins the call already holding back (same thread)
        return
    tally = WarningTally(unit, tuple(categories), hold_back)
    _local.tally = tally
    try:
        yield tally
    finally:
        _local.tally = None
    tally.speak()
