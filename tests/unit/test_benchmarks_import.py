"""Every benchmark module imports: a moved package name fails here, not in ``make bench``.

Importing a benchmark runs nothing (each runs from its ``main``); the modules
import only the package and numpy/pandas at the top.
"""

from __future__ import annotations

import importlib

import pytest
from _paths import REPO

BENCHMARKS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_module_imports(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__name__ == f"benchmarks.{name}"


def test_every_section_of_make_bench_names_a_benchmark_module():
    run = importlib.import_module("benchmarks.run")
    source = (REPO / "benchmarks" / "run.py").read_text()
    for name in ("measured", "peers", "dynamic_cp", "pp_order", "checkpoint",
                 "logprob_memory", "cp_memory", "worker_import", "engine_speed"):
        assert f'"{name}"' in source and name in BENCHMARKS, name
    assert callable(run.main)
