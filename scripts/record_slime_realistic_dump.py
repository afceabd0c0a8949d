#!/usr/bin/env python
"""Write one realistic slime debug rollout dump with slime's own ``Sample`` and
``save_debug_rollout_data`` (the case issue 21 was found on).

Usage::

    python scripts/record_slime_realistic_dump.py --slime /path/to/slime/checkout \
        --out tests/golden/realistic_dump

64 prompts x 4 rollouts: a quarter of the rollouts are compact (2-4 samples
sharing an explicit ``rollout_id``; the rest have ``rollout_id`` None, so
slime numbers them itself), response lengths log-normal up to 8192 tokens
(prompts up to 1024), a few ``remove_sample`` and rollout log-probs on every
sample. Token ids are random below 256 (the schedule reads lengths only; small ids
keep the file small: pickle stores them in two bytes). The dump is
read back with slime's ``load_debug_rollout_data`` and written as
``rollout_0.pt`` with a ``rollout_0.json`` record (commit, seed, counts).
Imports slime's modules from the checkout as ``record_slime_dumps.py`` does
(nothing of slime is copied into varbatch_kit).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from record_slime_dumps import import_slime, slime_commit

GENERATOR = "scripts/record_slime_realistic_dump.py"
SEED = 21
PROMPTS, PER_PROMPT = 64, 4


def make_samples(S, rng: random.Random) -> list:
    samples, index, next_id = [], 0, 10_000
    for g in range(PROMPTS):
        for _ in range(PER_PROMPT):
            compact = rng.random() < 0.25
            k = rng.randint(2, 4) if compact else 1
            rid = None
            if compact:
                rid, next_id = next_id, next_id + 1
            prompt_len = rng.randint(64, 1024)
            for turn in range(k):
                resp = min(8192, max(16, int(math.exp(rng.gauss(6.6, 0.9)))))
                s = S.Sample(
                    group_index=g, index=index, rollout_id=rid, prompt=f"prompt {g}",
                    tokens=[rng.randrange(256) for _ in range(prompt_len + resp)],
                    response=f"response {index}", response_length=resp, label="",
                    reward=round(rng.uniform(-1, 1), 4),
                    loss_mask=None, remove_sample=rng.random() < 0.04,
                    status=S.Sample.Status("completed"),
                    metadata={"turn": turn},
                )
                s.rollout_log_probs = [round(-rng.random(), 3) for _ in range(resp)]
                samples.append(s)
                index += 1
    return samples


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slime", required=True, type=Path, help="path of a slime checkout")
    ap.add_argument("--out", required=True, type=Path, help="folder for the dump")
    ap.add_argument("--slime-commit", default=None)
    a = ap.parse_args(argv)
    S = import_slime(a.slime)
    a.out.mkdir(parents=True, exist_ok=True)
    template = str(a.out / "rollout_{rollout_id}.pt")
    samples = make_samples(S, random.Random(SEED))
    S.save(template, samples, rollout_id=0, evaluation=False)
    loaded = S.load(template, rollout_id=0)
    assert len(loaded) == len(samples)
    record = {
        "slime_commit": slime_commit(a.slime, a.slime_commit), "generator": GENERATOR,
        "seed": SEED, "dump": "rollout_0.pt", "samples": len(samples),
        "without_rollout_id": sum(s.rollout_id is None for s in samples),
        "remove_sample": sum(bool(s.remove_sample) for s in samples),
        "max_response_length": max(s.response_length for s in samples),
    }
    (a.out / "rollout_0.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
