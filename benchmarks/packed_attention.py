"""Packed attention benchmark: dense block mask vs per-sample attention at a fixed token count.

One packed micro-batch of ``T`` tokens (default 8192) in three compositions
with the same ``sum L = T`` and different ``sum L^2``: 1 x T, 8 x T/8 and
64 x T/64. For each, the forward + backward time of a small megatron-core
GPT (learned absolute positions, ``--layers`` layers of ``--hidden`` width)
on two paths with the same weights:

- ``dense``: megatron's ``DotProductAttention`` with the ``[1, 1, T, T]``
  block-diagonal mask (``pack(..., attention="dense")``);
- ``per_sample``: :class:`varbatch_kit.train.model.attention.PerSampleAttention`
  with ``thd`` packed params (``pack(...)``, the training default).

Median of ``--repeats`` timed runs after one warm-up; ``max_abs_dlogit`` is
the largest logit difference between the two paths on that batch. The dense
time stays flat (its attention is ``T^2`` whatever the packing) while the
per-sample time follows ``sum L^2`` (down to the cost of the rest of the
model): the least-squares line ``time = a + b * sum L^2`` printed under the
table has a slope near 0 for the dense path, and for the per-sample path a
slope that accounts for the drop, with ``a`` the cost of everything but
attention. Writes ``build/bench/packed_attention.json``.

Run ``python -m benchmarks.packed_attention`` (``--help``); ``benchmarks.run``
runs it as its last section.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch

OUT = Path("build/bench/packed_attention.json")
COMPOSITIONS = (1, 8, 64)  # samples per micro-batch, equal lengths T / n


def _setup() -> torch.device:
    """torch.distributed (gloo, world 1) and megatron's parallel state in this process."""
    from varbatch_kit.train.parallel.process_setup import setup_process

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                     "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
            os.environ.setdefault(k, v)
    return setup_process("cuda" if torch.cuda.is_available() else "cpu",
                         threads=torch.get_num_threads())


def _models(layers: int, hidden: int, heads: int, vocab: int, max_len: int, device):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from varbatch_kit.train import ModelConfig
    from varbatch_kit.train.config.model_config import resolve_model
    from varbatch_kit.train.model.attention import local_layer_spec
    from varbatch_kit.train.model.gpt import transformer_config

    cfg = resolve_model(ModelConfig(num_layers=layers, hidden_size=hidden,
                                    num_attention_heads=heads, vocab_size=vocab))
    models = {}
    for path in ("dense", "per_sample"):
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
        models[path] = GPTModel(
            config=transformer_config(cfg),
            transformer_layer_spec=local_layer_spec(per_sample=path == "per_sample"),
            vocab_size=vocab, max_sequence_length=max_len,
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=False, parallel_output=True).to(device)
    models["dense"].load_state_dict(models["per_sample"].state_dict())
    return models


def _step(model, batch, targets) -> torch.Tensor:
    """One forward + backward; returns the logits (detached)."""
    model.zero_grad(set_to_none=True)
    logits = model(batch.tokens, batch.position_ids, **batch.model_inputs())
    torch.nn.functional.cross_entropy(logits[0], targets).backward()
    return logits.detach()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(tokens: int = 8192, layers: int = 2, hidden: int = 256, heads: int = 4,
            vocab: int = 512, repeats: int = 3, compositions=COMPOSITIONS) -> list[dict]:
    """Rows of the benchmark table (see the module docstring)."""
    from varbatch_kit.train.step.packed_batch import pack

    device = _setup()
    models = _models(layers, hidden, heads, vocab, tokens, device)
    rng = np.random.default_rng(0)
    rows = []
    base_l2 = None
    for n in compositions:
        if tokens % n:
            raise ValueError(f"tokens={tokens} is not divisible into {n} equal samples")
        length = tokens // n
        seqs = [rng.integers(0, vocab, length) for _ in range(n)]
        prompts = [1] * n
        sum_l2 = n * length**2
        base_l2 = base_l2 or sum_l2
        row = {"composition": f"{n} x {length}", "samples": n, "length": length,
               "sum_L": tokens, "sum_L2": sum_l2, "sum_L2_ratio": sum_l2 / base_l2}
        logits = {}
        for path, model in models.items():
            batch = pack(seqs, prompts, device=device, attention=path)
            targets = torch.roll(batch.tokens[0], -1)
            logits[path] = _step(model, batch, targets)  # warm-up
            times = []
            for _ in range(repeats):
                _sync(device)
                t0 = time.perf_counter()
                _step(model, batch, targets)
                _sync(device)
                times.append(time.perf_counter() - t0)
            row[f"{path}_s"] = statistics.median(times)
            row[f"{path}_min_s"] = min(times)  # JSON only: robust to a busy machine
            del batch
        row["max_abs_dlogit"] = float((logits["dense"] - logits["per_sample"]).abs().max())
        rows.append(row)
    for row in rows:
        row["dense_ratio"] = row["dense_s"] / rows[0]["dense_s"]
        row["per_sample_ratio"] = row["per_sample_s"] / rows[0]["per_sample_s"]
        row["speedup"] = row["dense_s"] / row["per_sample_s"]
    return rows


def affine_fit(rows: list[dict], key: str) -> dict:
    """Least-squares ``time = a + b * sum_L2`` over the rows; ``b`` per million ``sum_L2``."""
    x = np.array([r["sum_L2"] for r in rows], dtype=float) / 1e6
    y = np.array([r[key] for r in rows], dtype=float)
    b, a = np.polyfit(x, y, 1) if len(rows) > 1 else (0.0, float(y[0]))
    resid = y - (a + b * x)
    return {"a_s": float(a), "b_s_per_M": float(b), "max_rel_residual": float(
        np.max(np.abs(resid) / y))}


def table(rows: list[dict]) -> str:
    cols = [("composition", "s", 12), ("sum_L", "d", 6), ("sum_L2", "d", 10),
            ("sum_L2_ratio", ".4f", 12), ("dense_s", ".3f", 8), ("dense_ratio", ".3f", 11),
            ("per_sample_s", ".3f", 12), ("per_sample_ratio", ".3f", 16), ("speedup", ".2f", 7),
            ("max_abs_dlogit", ".1e", 14)]
    lines = ["  ".join(f"{c:>{w}}" for c, _f, w in cols)]
    for r in rows:
        lines.append("  ".join(f"{format(r[c], f):>{w}}" for c, f, w in cols))
    return "\n".join(lines)


def section(quick: bool = False, out: Path = OUT, **kwargs) -> list[dict]:
    """Measure, print the table, write ``out``; what :mod:`benchmarks.run` calls."""
    params = {"tokens": 4096 if quick else 8192, "layers": 2, "hidden": 256, "heads": 4,
              "vocab": 512, "repeats": 2 if quick else 3}
    params.update({k: v for k, v in kwargs.items() if v is not None})
    print("=" * 100)
    print(f"5. PACKED ATTENTION: one micro-batch of {params['tokens']} tokens, forward + "
          f"backward, GPT {params['layers']} layers x {params['hidden']} ({params['heads']} "
          f"heads), median of {params['repeats']}")
    print("   dense = megatron DotProductAttention + [T,T] block mask; per_sample = "
          "PerSampleAttention (thd cu_seqlens); ratios vs the 1-sample row")
    print("=" * 100)
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # megatron's Apex / TransformerEngine / deprecation notes
        warnings.simplefilter("ignore", UserWarning)
        rows = measure(**params)
    print(table(rows))
    fits = {path: affine_fit(rows, f"{path}_s") for path in ("dense", "per_sample")}
    for path, f in fits.items():
        print(f"   {path:>10}: time ~ {f['a_s']:.3f} s + {f['b_s_per_M']:.4f} s per million "
              f"sum_L2 (largest residual {f['max_rel_residual']:.1%})")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**params, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": "cuda" if torch.cuda.is_available() else "cpu"}
    out.write_text(json.dumps({"params": meta, "rows": rows, "fits": fits}, indent=1))
    print(f"   wrote {out}; {time.perf_counter() - t0:.0f} s\n")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="4096 tokens and 2 repeats instead of 8192 and 3")
    ap.add_argument("--tokens", type=int, default=None, help="tokens of the micro-batch")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per cell (median)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    section(quick=args.quick, out=args.out, tokens=args.tokens, layers=args.layers,
            hidden=args.hidden, heads=args.heads, repeats=args.repeats)


if __name__ == "__main__":
    main()
