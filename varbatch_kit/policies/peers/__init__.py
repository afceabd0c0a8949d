"""The schedulers of other RL frameworks, side by side with ours, on plain arrays.

Every peer answers the same question as :func:`varbatch_kit.build_schedule` does
for one step: given the step's per-sample token lengths, the number of DP
ranks and the token cap per micro-batch, which samples does each rank train,
micro-batch after micro-batch? The answer is a :class:`PeerPlan`.

The functions are our own code, written from each peer's released code or
documentation (never copied). Two kinds:

- **read from the released package** (the module docstring of each function
  names the version): ``verl`` 0.9.1 (``verl.utils.seqlen_balancing`` and the
  trainer's ``_balance_batch``), ``areal`` / ``areal_kk`` 1.0.4
  (``areal.utils.seqpack``, ``areal.utils.data.allocate_balanced_mbs_synced``,
  the train controller's dispatch), ``openrlhf`` 0.11.2
  (``openrlhf.utils.seqlen_balancing``, ``balance_experiences``, the replay
  buffer's dynamic batch). ``tests/golden/peers/`` holds outputs of those
  packages, recorded by ``scripts/record_peer_golden.py``; the unit tests check
  that these functions reproduce them.
- **transcriptions of a documented algorithm** (no package on the index to
  check against): ``prime_rl``, ``nemo_rl``, ``torchtitan``. Their docstrings
  say what was transcribed and where we had to choose.

The Karmarkar-Karp the three packaged peers use is verl's (OpenRLHF and AReaL
carry copies of it); it is the same largest-differencing method with the same
tie-breaking as slime's, so :func:`varbatch_kit.policies.partition.karmarkar_karp`
computes it (the golden vectors check that too).

One module per peer (``verl_peer``, ``prime_rl_peer``, ``nemo_rl_peer``,
``areal_peer``, ``openrlhf_peer``, ``torchtitan_peer``) and :mod:`.base` for
what they share (:class:`PeerPlan`, :class:`PeerRefusal`, the input check).
This ``__init__`` assembles ``PEER_SCHEDULERS`` explicitly; nothing registers
itself. Each scheduler is ``fn(lengths, *, dp, cap, workload=None) -> PeerPlan``, where
``workload`` is an optional per-sample cost (e.g. FLOPs) that peers balancing
by a cost use in place of their own estimate when the peer has no formula of
its own (prime-rl); peers with a fixed formula (verl) or balancing tokens
(OpenRLHF, AReaL, NeMo-RL, torchtitan) ignore it, as the real ones do.
"""

from __future__ import annotations

from collections.abc import Callable

from varbatch_kit.policies.peers.areal_peer import (
    areal,
    areal_balanced_greedy,
    areal_ffd_allocate,
    areal_kk,
    areal_kk_allocate,
)
from varbatch_kit.policies.peers.base import PeerPlan, PeerRefusal
from varbatch_kit.policies.peers.nemo_rl_peer import nemo_rl
from varbatch_kit.policies.peers.openrlhf_peer import openrlhf, openrlhf_interleave
from varbatch_kit.policies.peers.prime_rl_peer import prime_rl
from varbatch_kit.policies.peers.torchtitan_peer import torchtitan
from varbatch_kit.policies.peers.verl_peer import verl, verl_rank_micro_batches, verl_workload

__all__ = [
    "EQUAL_COUNTS",
    "PEER_SCHEDULERS",
    "PEER_SOURCES",
    "RESPECTS_CAP",
    "PeerPlan",
    "PeerRefusal",
    "areal",
    "areal_balanced_greedy",
    "areal_ffd_allocate",
    "areal_kk",
    "areal_kk_allocate",
    "nemo_rl",
    "openrlhf",
    "openrlhf_interleave",
    "prime_rl",
    "torchtitan",
    "verl",
    "verl_rank_micro_batches",
    "verl_workload",
]

#: Every peer, by name: ``fn(lengths, *, dp, cap, workload=None) -> PeerPlan``.
PEER_SCHEDULERS: dict[str, Callable[..., PeerPlan]] = {
    "verl": verl,
    "prime_rl": prime_rl,
    "nemo_rl": nemo_rl,
    "areal": areal,
    "areal_kk": areal_kk,
    "openrlhf": openrlhf,
    "torchtitan": torchtitan,
}

#: How each peer was written: ``"package"`` (read from, and checked against, its
#: released package) or ``"transcription"`` (its documented algorithm only).
PEER_SOURCES: dict[str, str] = {
    "verl": "package verl==0.9.1",
    "prime_rl": "transcription",
    "nemo_rl": "transcription",
    "areal": "package areal==1.0.4",
    "areal_kk": "package areal==1.0.4",
    "openrlhf": "package openrlhf==0.11.2",
    "torchtitan": "transcription",
}

#: Peers that promise every micro-batch of two or more samples stays under the cap.
RESPECTS_CAP = {"verl", "prime_rl", "nemo_rl", "areal", "areal_kk", "torchtitan"}
#: Peers that give every rank the same micro-batch count.
EQUAL_COUNTS = {"verl", "prime_rl", "nemo_rl", "areal", "areal_kk", "openrlhf"}
