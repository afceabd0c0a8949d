"""Regenerate the bundled traces: ``python scripts/make_traces.py`` (from the checkout).

Each trace is ``Rollouts.synthetic`` with the parameters below (recorded in
``traces.json`` beside the files too); the same seed gives the same file.
"""

import json
from pathlib import Path

from varbatch_kit import Rollouts
from varbatch_kit.core.traces import write_trace

#: the package data folder the traces are written to
HERE = Path(__file__).resolve().parents[1] / "data" / "traces"

TRACES = {
    # math-style RL: one sample per rollout, long tail truncated at 8k
    "math": dict(n_rollouts=4096, samples_per_rollout=(1, 1), prompt_len=(64, 512),
                 response_len=1500.0, response_sigma=0.9, max_response_len=8192, seed=1),
    # agentic / compact flows: 1-6 samples per rollout, later turns carry more context
    "agentic": dict(n_rollouts=2048, samples_per_rollout=(1, 6), prompt_len=(512, 2048),
                    response_len=800.0, response_sigma=1.0, max_response_len=4096, seed=2),
    # long-context reasoning: one sample per rollout, up to 32k tokens
    "long_context": dict(n_rollouts=1024, samples_per_rollout=(1, 1), prompt_len=(2048, 8192),
                         response_len=6000.0, response_sigma=0.8, max_response_len=24576,
                         seed=3),
}


def main() -> None:
    for name, params in TRACES.items():
        write_trace(Rollouts.synthetic(**params), HERE / f"{name}.jsonl")
    (HERE / "traces.json").write_text(json.dumps(TRACES, indent=2) + "\n")


if __name__ == "__main__":
    main()
