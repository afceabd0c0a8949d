"""Shared by the peers' tests: the golden vectors of the released packages, and plan lists.

``tests/golden/peers/<peer>.json`` holds outputs of verl 0.9.1, areal 1.0.4 and
openrlhf 0.11.2, recorded by ``scripts/record_peer_golden.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

from varbatch_kit.policies.peers import PeerPlan

GOLDEN = Path(__file__).resolve().parents[3] / "golden" / "peers"


def golden(peer: str) -> dict:
    """The recorded vectors of one package (``verl``, ``areal``, ``openrlhf``)."""
    return json.loads((GOLDEN / f"{peer}.json").read_text())


def as_lists(plan: PeerPlan):
    """A plan's micro-batches as plain nested lists of sample indices."""
    return [[m.tolist() for m in rank] for rank in plan.rank_micro_batches]
