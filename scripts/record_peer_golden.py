"""Record the peers' own balancing functions as golden vectors (``tests/golden/peers/``).

Runs the released packages (verl 0.9.1, areal 1.0.4, openrlhf 0.11.2) on
seeded random inputs and writes inputs, outputs and the package version to
``tests/golden/peers/<peer>.json``. None of the peers' code enters the
project: the packages live in a scratch folder, e.g.::

    pip install --no-deps --target /tmp/peers verl==0.9.1 areal==1.0.4 openrlhf==0.11.2 \\
        ray==2.60.0 tensordict==0.15.3 numba==0.68.1 llvmlite==0.50.0 msgpack==1.2.4 \\
        colorlog==6.12.0 pyvers==0.2.3 cloudpickle==3.1.3
    PYTHONPATH=.:/tmp/peers python scripts/record_peer_golden.py

The modules are imported with their top-level packages' ``__init__`` skipped
(those pull in GPU and cluster machinery); the balancing modules themselves
and everything they import are the packages' own, unchanged.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks._peer_loading, run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks._peer_loading import load_bare  # noqa: E402

OUT = ROOT / "tests" / "golden" / "peers"


def lengths(rng, n, lo=16, hi=4000):
    """Long-tailed token lengths with ties (small integer grid now and then)."""
    if rng.random() < 0.3:
        return rng.integers(1, 6, size=n).tolist()
    x = np.exp(rng.normal(np.log(600), 0.9, size=n)).astype(np.int64)
    return np.clip(x, lo, hi).tolist()


def record_verl(rng, cases):
    sb = load_bare("verl.utils.seqlen_balancing")
    import torch
    from tensordict import TensorDict

    kk, rearr = [], []
    for _ in range(cases):
        n = int(rng.integers(1, 120))
        k = int(rng.integers(1, n + 1))
        equal = bool(rng.random() < 0.4)
        if equal:
            k = int(rng.choice([d for d in range(1, n + 1) if n % d == 0]))
        vals = sb.calculate_workload(torch.tensor(lengths(rng, n))).tolist()
        kk.append({"values": vals, "k": k, "equal_size": equal,
                   "parts": sb.get_seqlen_balanced_partitions(vals, k, equal)})
    for _ in range(cases):
        n = int(rng.integers(1, 80))
        lens = lengths(rng, n)
        cap = int(rng.integers(max(lens), max(lens) * 6 + 1))
        mask = torch.zeros(n, max(lens), dtype=torch.int64)
        for i, v in enumerate(lens):
            mask[i, :v] = 1
        batch = TensorDict({"input_ids": mask.clone(), "attention_mask": mask}, batch_size=[n])
        _, idx = sb.rearrange_micro_batches(batch, max_token_len=cap)
        rearr.append({"lengths": lens, "cap": cap, "micro_batches": idx})
    return {"package": "verl", "version": importlib.metadata.version("verl"),
            "functions": {"get_seqlen_balanced_partitions": kk, "rearrange_micro_batches": rearr}}


def record_areal(rng, cases):
    sp = load_bare("areal.utils.seqpack")
    ffd, kk, greedy = [], [], []
    for _ in range(cases):
        n = int(rng.integers(1, 150))
        vals = lengths(rng, n)
        cap = int(rng.integers(max(vals), max(vals) * 8 + 1))
        mg = int(rng.integers(1, min(n, 6) + 1))
        div = int(rng.choice([1, 1, 2, 4]))
        for store, fn in ((ffd, sp.ffd_allocate), (kk, sp.kk_allocate)):
            try:
                out = [list(map(int, g)) for g in fn(vals, cap, mg, div)]
                store.append({"values": vals, "cap": cap, "min_groups": mg, "divisor": div,
                              "groups": out})
            except RuntimeError as e:
                store.append({"values": vals, "cap": cap, "min_groups": mg, "divisor": div,
                              "error": str(e)[:80]})
    for _ in range(cases):
        k = int(rng.integers(1, 9))
        n = k * int(rng.integers(1, 20))
        vals = lengths(rng, n)
        greedy.append({"values": vals, "k": k,
                       "groups": sp.balanced_greedy_partition(vals, k)})
    return {"package": "areal", "version": importlib.metadata.version("areal"),
            "functions": {"ffd_allocate": ffd, "kk_allocate": kk,
                          "balanced_greedy_partition": greedy}}


def record_openrlhf(rng, cases):
    sb = load_bare("openrlhf.utils.seqlen_balancing")
    kk, ff = [], []
    for _ in range(cases):
        n = int(rng.integers(1, 120))
        vals = lengths(rng, n)
        cap = int(rng.integers(max(vals) // 2 + 1, max(vals) * 6 + 1))
        k = sb.get_minimum_num_micro_batch_size(vals, cap, 1, 1)
        ff.append({"values": vals, "cap": cap, "count": k})
        if k <= n:
            kk.append({"values": vals, "k": k, "equal_size": False,
                       "parts": sb.get_seqlen_balanced_partitions(vals, k, False)})
    import torch

    ex = load_bare("openrlhf.trainer.ppo_utils.experience")
    inter = []
    for _ in range(cases):
        dp = int(rng.integers(1, 9))
        n = int(rng.integers(dp, 8 * dp + 1))
        vals = lengths(rng, n, hi=60)
        # each sample's id rides in its token ids, to be read back after the shuffle
        exps = [ex.Experience(sequences=torch.full((1, v), i + 1, dtype=torch.long),
                              attention_mask=torch.ones(1, v, dtype=torch.long),
                              total_length=torch.tensor([v]), index=[i])
                for i, v in enumerate(vals)]
        args = types.SimpleNamespace(actor=types.SimpleNamespace(num_nodes=1,
                                                                 num_gpus_per_node=dp),
                                     ds=types.SimpleNamespace(ring_attn_size=1,
                                                              tensor_parallel_size=1))
        ranks = [(b.sequences[:, 0] - 1).tolist() for b in ex.balance_experiences(exps, args)]
        inter.append({"lengths": vals, "dp": dp, "ranks": ranks})
    return {"package": "openrlhf", "version": importlib.metadata.version("openrlhf"),
            "functions": {"get_minimum_num_micro_batch_size": ff,
                          "get_seqlen_balanced_partitions": kk,
                          "balance_experiences": inter}}


RECORDERS = {"verl": record_verl, "areal": record_areal, "openrlhf": record_openrlhf}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=60, help="random cases per function")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers", default=",".join(RECORDERS), help="comma-separated")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for i, peer in enumerate(args.peers.split(",")):
        rng = np.random.default_rng([args.seed, i])
        try:
            data = RECORDERS[peer](rng, args.cases)
        except ModuleNotFoundError as e:
            raise SystemExit(f"{peer}: {e}") from None
        data["seed"] = [args.seed, i]
        path = args.out / f"{peer}.json"
        path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        print(f"{peer} {data['version']}: {path} ({path.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
