"""Paired A/B figures of the worker benchmarks: medians of each side, the ratio A/B taken
pair by pair (each pair measured back to back, so a change of machine load moves both), and
the JSON file under ``build/bench``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def paired(a_name: str, a: list[float], b_name: str, b: list[float], unit: str) -> dict:
    """``{a}_{unit}_median``, ``{b}_{unit}_median``, ``ratio_{a}_over_{b}_median`` and the
    per-pair ``ratios`` of two equally long series measured in alternation."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired series: {len(a)} and {len(b)} values; give equal, non-empty")
    ratios = [x / y for x, y in zip(a, b)]
    return {"pairs": len(a), f"{a_name}_{unit}_median": statistics.median(a),
            f"{b_name}_{unit}_median": statistics.median(b),
            f"ratio_{a_name}_over_{b_name}_median": statistics.median(ratios), "ratios": ratios}


def pairs_text(row: dict) -> str:
    """``pairs 0.46, 0.50, ...``: each pair's ratio."""
    return "pairs " + ", ".join(f"{r:.2f}" for r in row["ratios"])


def write(name: str, row: dict) -> Path:
    """``row`` as ``build/bench/{name}.json``; returns the path."""
    out = ROOT / "build" / "bench" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(row, indent=1))
    return out
