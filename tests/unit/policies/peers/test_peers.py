"""All the peers together: the registry, their golden files, and the promises each keeps.

Each peer's own cases (parity with its released package, hand-made cases) are
in ``test_<peer>_peer.py`` next to this file; golden vectors
(``tests/golden/peers/``, recorded by ``scripts/record_peer_golden.py`` from
verl 0.9.1, areal 1.0.4 and openrlhf 0.11.2) are compared exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from _peer_golden import GOLDEN, golden
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit.policies import peers
from varbatch_kit.policies.partition import karmarkar_karp
from varbatch_kit.policies.peers import (
    EQUAL_COUNTS,
    PEER_SCHEDULERS,
    PEER_SOURCES,
    RESPECTS_CAP,
    PeerRefusal,
)


# ------------------------------------------------------------------------------ golden parity
def test_golden_files_name_their_package_version():
    assert golden("verl")["version"] == "0.9.1"
    assert golden("areal")["version"] == "1.0.4"
    assert golden("openrlhf")["version"] == "0.11.2"
    for f in GOLDEN.glob("*.json"):
        assert f.stat().st_size < 300_000


@pytest.mark.parametrize("peer", ["verl", "openrlhf"])
def test_karmarkar_karp_matches_the_package(peer):
    cases = golden(peer)["functions"]["get_seqlen_balanced_partitions"]
    assert len(cases) >= 50
    for c in cases:
        assert karmarkar_karp(c["values"], c["k"], c["equal_size"]) == c["parts"], c


# ------------------------------------------------------------------------------ the registry
def test_the_registry_lists_every_peer_module_explicitly():
    from varbatch_kit.policies.peers import (
        areal_peer,
        nemo_rl_peer,
        openrlhf_peer,
        prime_rl_peer,
        torchtitan_peer,
        verl_peer,
    )

    assert PEER_SCHEDULERS == {
        "verl": verl_peer.verl, "prime_rl": prime_rl_peer.prime_rl,
        "nemo_rl": nemo_rl_peer.nemo_rl, "areal": areal_peer.areal,
        "areal_kk": areal_peer.areal_kk, "openrlhf": openrlhf_peer.openrlhf,
        "torchtitan": torchtitan_peer.torchtitan}
    assert set(PEER_SOURCES) == set(PEER_SCHEDULERS)
    assert RESPECTS_CAP <= set(PEER_SCHEDULERS) and EQUAL_COUNTS <= set(PEER_SCHEDULERS)
    # the package's public names are the modules' own
    assert peers.verl_workload is verl_peer.verl_workload
    assert peers.openrlhf_interleave is openrlhf_peer.openrlhf_interleave
    assert peers.areal_kk_allocate is areal_peer.areal_kk_allocate
    assert all(hasattr(peers, name) for name in peers.__all__)


@pytest.mark.parametrize("bad", [dict(lengths=[], dp=1, cap=4), dict(lengths=[3], dp=0, cap=4),
                                 dict(lengths=[3], dp=1, cap=0), dict(lengths=[0], dp=1, cap=4)])
def test_bad_inputs_raise_value_errors(bad):
    lengths = bad.pop("lengths")
    for fn in PEER_SCHEDULERS.values():
        with pytest.raises(ValueError):
            fn(lengths, **bad)


# ------------------------------------------------------------------------------ invariants
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3000), min_size=1, max_size=60), st.integers(1, 5),
       st.sampled_from([3000, 5000, 12000]))
def test_every_peer_keeps_its_promises(lengths, dp, cap):
    for name, fn in PEER_SCHEDULERS.items():
        try:
            plan = fn(lengths, dp=dp, cap=cap, workload=np.asarray(lengths, float) ** 1.5)
        except PeerRefusal:
            continue  # the peer itself refuses (too few samples for the ranks, ...)
        plan.check(len(lengths))
        assert plan.dp == dp
        lens = np.asarray(lengths)
        if name in RESPECTS_CAP:
            assert all(m.size <= 1 or int(lens[m].sum()) <= cap for m in plan.micro_batches), name
        if name in EQUAL_COUNTS:
            assert len({len(r) for r in plan.rank_micro_batches}) == 1, name
        total = len(plan.micro_batches)
        assert total >= math.ceil(lens.sum() / cap) or name == "openrlhf"


# ------------------------------------------------------------------------------ bench helpers
def test_bench_step_time_is_the_slowest_rank_of_summed_micro_batches():
    from benchmarks.peers import _InlineCost, step_seconds, uncalibrated
    from varbatch_kit import ModelShape

    cm = _InlineCost(1.0, 0.1, 0.01)
    lens = np.array([10, 20, 30])
    # rank 0: [0, 1] -> 1 + 3 + 5 = 9; [2] -> 1 + 3 + 9 = 13 -> 22; rank 1: nothing
    assert step_seconds(cm, [[np.array([0, 1]), np.array([2])], []], lens) == pytest.approx(22)
    # the uncalibrated model is 3x forward FLOPs at 0.45 of 989 TFLOP/s, plus 4 ms
    u = uncalibrated()
    f = ModelShape.preset("qwen3-8b").forward_flops(np.array([3000]))[0]
    assert u.seconds(3000, 3000**2) == pytest.approx(0.004 + 3 * f / (989e12 * 0.45), rel=1e-9)


def test_load_bare_skips_the_package_init(tmp_path, monkeypatch):
    """The one loader of peer packages (the bench and scripts/record_peer_golden.py share it)."""
    import sys

    from benchmarks._peer_loading import load_bare

    pkg = tmp_path / "fakepeer_vbk"
    (pkg / "utils").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('needs a GPU cluster')\n")
    (pkg / "utils" / "__init__.py").write_text("raise RuntimeError('needs ray')\n")
    (pkg / "utils" / "balancing.py").write_text("def twice(x):\n    return 2 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        mod = load_bare("fakepeer_vbk.utils.balancing")
        assert mod.twice(21) == 42
        assert mod.__file__ == str(pkg / "utils" / "balancing.py")
        with pytest.raises(ModuleNotFoundError, match="package nopeer_vbk not found"):
            load_bare("nopeer_vbk.utils.x")
    finally:
        for name in [n for n in sys.modules if n.startswith("fakepeer_vbk")]:
            del sys.modules[name]
    scripts = Path(__file__).resolve().parents[4] / "scripts" / "record_peer_golden.py"
    assert "from benchmarks._peer_loading import load_bare" in scripts.read_text()
