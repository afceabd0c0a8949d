"""The demo's summary says the library's warnings once each, under their section, instead of
a block per warning on stderr."""

import warnings

from varbatch_kit.cli import demo
from varbatch_kit.core.build import OversizeSampleWarning


def test_summary_warnings_end_their_section_once_each(monkeypatch):
    def policies(progress):
        for _ in range(3):  # a repeat is said once
            warnings.warn("in 13 of 39 schedules: too long", OversizeSampleWarning,
                          stacklevel=1)
        warnings.warn("first line\nsecond line", UserWarning, stacklevel=1)
        return "the table"

    def quiet(progress):
        return "no warning here"

    monkeypatch.setattr(demo, "SUMMARIES", (("02", "policies", policies),
                                            ("06", "invariance", quiet)))
    runs = [demo.NotebookRun("02_x", ok=True), demo.NotebookRun("06_y", ok=True)]
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        sections = demo._summary(runs, progress=False)
    assert sections == [
        ("policies", "the table\n  warning: in 13 of 39 schedules: too long\n"
                     "  warning: first line\n    second line"),
        ("invariance", "no warning here")]
    assert not shown  # nothing left for stderr
