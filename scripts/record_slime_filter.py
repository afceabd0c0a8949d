"""Record slime's DAPO group filter on seeded reward groups (golden vectors).

    python scripts/record_slime_filter.py --slime /path/to/slime --out tests/golden/rl

slime's own ``check_reward_nonzero_std`` and ``check_reward_nonzero_std_with_fallback``
(``slime/rollout/filter_hub/dynamic_sampling_filters.py``), imported from the checkout,
judge groups of slime ``Sample`` objects: rewards that are all equal, equal but one, tiny
spreads either side of the 1e-6 threshold, one-sample groups, and dict rewards read with
``--reward-key``. Their verdicts (keep, reason, keep_when_insufficient) go to
``tests/golden/rl/dynamic_filter.json``, which ``tests/unit/train/rl/test_task.py`` compares
with :func:`varbatch_kit.train.rl.task.nonzero_reward_std`. Nothing of slime's is copied.
"""

from __future__ import annotations

import random
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _golden_recorder import checkout_commit, write_family  # noqa: E402

COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"


def cases(rng: random.Random) -> list[dict]:
    """Reward groups: hand-picked edges, then seeded random ones."""
    groups = [[1.0] * 4, [0.0] * 4, [0.0, 1.0, 0.0, 0.0], [0.25], [0.5, 0.5], [1e-7, 0.0, 0.0],
              [3e-6, 0.0, 0.0, 0.0], [0.04, 0.04, 0.04], [-1.0, -1.0], [0.96] * 8]
    for _ in range(40):
        n = rng.randint(1, 8)
        value = rng.choice([0.0, 1.0, round(rng.random(), 3)])
        g = [value] * n
        if rng.random() < 0.6:
            g[rng.randrange(n)] = rng.choice([0.0, 1.0, value + rng.choice([1e-7, 1e-5, 0.5])])
        groups.append(g)
    out = [{"rewards": g, "reward_key": None} for g in groups]
    out += [{"rewards": [{"acc": r, "len": 1.0} for r in g], "reward_key": "acc"}
            for g in groups[:6]]
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slime", type=Path, required=True, help="slime checkout (holds slime/)")
    p.add_argument("--out", type=Path, required=True, help="folder of dynamic_filter.json")
    p.add_argument("--commit", default=COMMIT)
    a = p.parse_args(argv)
    found = checkout_commit(a.slime)
    if found is not None and found != a.commit:
        raise SystemExit(f"{a.slime} is at {found}, not {a.commit}; pass --commit {found}")
    sys.path.insert(0, str(a.slime))
    from slime.rollout.filter_hub.dynamic_sampling_filters import (
        check_reward_nonzero_std,
        check_reward_nonzero_std_with_fallback,
    )
    from slime.utils.types import Sample

    rows = []
    for case in cases(random.Random(0)):
        args = SimpleNamespace(reward_key=case["reward_key"])
        samples = [Sample(reward=r) for r in case["rewards"]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch: std of one value
            plain = check_reward_nonzero_std(args, samples)
            fallback = check_reward_nonzero_std_with_fallback(args, samples)
        rows.append({**case, "keep": bool(plain.keep), "reason": plain.reason,
                     "fallback_keep_when_insufficient": bool(fallback.keep_when_insufficient)})
    a.out.mkdir(parents=True, exist_ok=True)
    size = write_family(a.out, "dynamic_filter", {
        "generator": "scripts/record_slime_filter.py", "slime_commit": a.commit,
        "function": "slime.rollout.filter_hub.dynamic_sampling_filters."
                    "check_reward_nonzero_std(_with_fallback)"}, rows)
    print(f"dynamic_filter.json: {len(rows)} cases, {size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
