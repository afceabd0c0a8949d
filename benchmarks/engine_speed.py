"""How fast does the engine train, against plain ``transformers`` on the same work?

The same tiny random Llama checkpoint (built by ``transformers``), the same samples (token ids,
per-sample advantages), the same objective (slime's default: GRPO's PPO-clipped policy loss,
``per_token``: summed over a step's response tokens and divided by their count), Adam with
gradient clipping at 1.0, fp32, one CPU thread, 4 steps of 8 samples:

- **engine**: ``varbatch_kit.train`` as a user runs it (dp 1, samples packed into micro-batches
  under ``max_tokens_per_gpu``, per-sample attention), timed by its own step records: the
  forward-only log-prob pass that gives the old policy's log-probs (``log_prob_pass_s``) plus
  the steps (``step_time_s``: forward, backward, optimizer, report), launch excluded;
- **transformers**: the plain loop on ``LlamaForCausalLM``: a ``no_grad`` forward per sample
  for the old log-probs, then per step a forward and backward per sample (logits only at the
  rows that predict response tokens, ``logits_to_keep``) and ``Adam.step``.

Both compute the same thing: their step-1 losses and gradient norms are printed side by side
(they agree to fp32 rounding; the engine's report is the check that they do). Each size is
measured ``--runs`` times (the engine's runs share one launch, each a whole run; transformers
builds a fresh model per run), and the ratio engine / transformers is taken run by run.

What the engine does beyond the plain loop, in both its log-prob pass and its steps: the
per-token statistics it reports (entropy and the argmax hit besides the log-prob, by the chunked
kernel of :mod:`varbatch_kit.report.objective.token_stats`), the report's all-reduces, megatron's
DDP gradient buffer and schedule. Measured here (3 runs each, this 2-core machine): the ratio was
1.11 at the first size before the kernel's softmax sums left float64 accumulation (35 ms against
1.6 ms per 1024 x 8192 logits), 1.00 after; the log-prob pass is the part that stays slower than
the plain one (1.27 s against 1.10 s), which is the entropy it also computes.

Run: ``python -m benchmarks.engine_speed`` (``--quick``: the first size, 2 runs); writes
``build/bench/engine_speed.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from benchmarks._ab import write
from varbatch_kit import Rollouts

#: name -> (transformers LlamaConfig fields, samples: (count, prompt range, response range))
SIZES = {
    "llama L4 H256 V8192, 32 x 256 tokens": (
        dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688, vocab_size=8192,
             num_attention_heads=4, num_key_value_heads=4),
        (32, (24, 40), (200, 264))),
    "llama L4 H512 V32000, 32 x 256 tokens": (
        dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1376, vocab_size=32000,
             num_attention_heads=8, num_key_value_heads=4),
        (32, (24, 40), (200, 264))),
    "llama L2 H256 V8192, 16 x 1024 tokens": (
        dict(num_hidden_layers=2, hidden_size=256, intermediate_size=688, vocab_size=8192,
             num_attention_heads=4, num_key_value_heads=4),
        (16, (96, 160), (860, 900))),
}
STEPS = 4
LR = 1e-5
EPS_CLIP = 0.2


def _checkpoint(fields: dict, out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=False, **fields)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def _rollouts(vocab: int, shape) -> Rollouts:
    n, prompt, response = shape
    rng = np.random.default_rng(0)
    p = rng.integers(*prompt, n)
    r = rng.integers(*response, n)
    tokens = [rng.integers(0, vocab, a + b) for a, b in zip(p, r)]
    adv = rng.choice([-1.0, 1.0], n) * rng.uniform(0.5, 1.5, n)
    extra = pd.DataFrame({"tokens": tokens, "advantage": adv})
    return Rollouts(p, r, np.arange(n), extra=extra)


def _engine(path: Path, rollouts: Rollouts, runs: int, work: Path, **changes) -> list[dict]:
    from varbatch_kit.train import TrainConfig, compare

    base = TrainConfig().with_(path=str(path), global_batch_size=len(rollouts) // STEPS,
                               max_tokens_per_gpu=1024, mode="per_token", lr=LR, min_lr=LR,
                               lr_decay_style="constant", max_steps=STEPS, precision="fp32",
                               threads_per_worker=1, eps_clip=EPS_CLIP, timeout_s=1800,
                               **changes)
    out: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare([base.with_(label=f"run {k}") for k in range(runs)], rollouts, out_dir=work,
                progress=False, runs=out)
    rows = []
    for r in out:
        s = r.steps
        rows.append({"wall_s": float(s["log_prob_pass_s"].sum() + s["step_time_s"].sum()),
                     "log_prob_pass_s": float(s["log_prob_pass_s"].sum()),
                     "loss1": float(s["loss"].iloc[0]), "grad_norm1": float(s["grad_norm"].iloc[0]),
                     "micro_batches": int(sum(np.sum(m) for m in s["num_microbatches"]))})
    return rows


def _transformers(path: Path, rollouts: Rollouts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    # the engine's CPU workers' arithmetic (train.parallel.process_setup.cpu_numerics): one
    # thread, subnormal floats flushed, so that neither side pays for subnormal arithmetic
    from varbatch_kit.train.parallel.process_setup import cpu_numerics

    cpu_numerics(1)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    extra = rollouts.extra
    ids = [torch.as_tensor(np.asarray(t), dtype=torch.long)[None] for t in extra["tokens"]]
    adv = torch.tensor(extra["advantage"].to_numpy(dtype=np.float32))
    resp = [int(x) for x in rollouts.response_len]

    def logp(k: int) -> torch.Tensor:  # log-probs of sample k's response tokens
        logits = model(ids[k], logits_to_keep=resp[k] + 1).logits[0, :-1]
        return torch.log_softmax(logits.float(), -1).gather(
            -1, ids[k][0, -resp[k]:, None])[:, 0]

    t0 = time.perf_counter()
    with torch.no_grad():
        old = [logp(k) for k in range(len(ids))]
    old_pass_s = time.perf_counter() - t0
    per_step = len(ids) // STEPS
    loss1 = norm1 = None
    for step in range(STEPS):
        members = range(step * per_step, (step + 1) * per_step)
        n_tok = sum(resp[k] for k in members)
        total = 0.0
        for k in members:
            ratio = torch.exp(logp(k) - old[k])
            pg = torch.maximum(-adv[k] * ratio,
                               -adv[k] * ratio.clamp(1 - EPS_CLIP, 1 + EPS_CLIP))
            loss = pg.sum() / n_tok
            loss.backward()
            total += float(loss.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:
            loss1, norm1 = total, norm
    return {"wall_s": time.perf_counter() - t0, "log_prob_pass_s": old_pass_s, "loss1": loss1,
            "grad_norm1": norm1}


def measure(name: str, runs: int, work: Path) -> dict:
    fields, shape = SIZES[name]
    path = _checkpoint(fields, work / "ckpt")
    rollouts = _rollouts(fields["vocab_size"], shape)
    engine = _engine(path, rollouts, runs, work / "engine")
    hf = [_transformers(path, rollouts) for _ in range(runs)]
    ratios = [e["wall_s"] / h["wall_s"] for e, h in zip(engine, hf)]
    return {"size": name, "tokens": int(rollouts.total_len.sum()), "runs": runs,
            "engine_s_median": statistics.median(e["wall_s"] for e in engine),
            "engine_log_prob_pass_s_median": statistics.median(
                e["log_prob_pass_s"] for e in engine),
            "transformers_s_median": statistics.median(h["wall_s"] for h in hf),
            "transformers_log_prob_pass_s_median": statistics.median(
                h["log_prob_pass_s"] for h in hf),
            "ratio_engine_over_transformers_median": statistics.median(ratios),
            "ratios": ratios, "engine_micro_batches": engine[0]["micro_batches"],
            "loss1": {"engine": engine[0]["loss1"], "transformers": hf[0]["loss1"]},
            "grad_norm1": {"engine": engine[0]["grad_norm1"], "transformers": hf[0]["grad_norm1"]}}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first size, 2 runs")
    ap.add_argument("--runs", type=int, default=3, help="runs per size (default 3)")
    args = ap.parse_args(argv)
    names = list(SIZES)[:1] if args.quick else list(SIZES)
    runs = 2 if args.quick else args.runs
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            row = measure(name, runs, Path(tmp))
        rows.append(row)
        print(f"{name} ({row['tokens']} tokens, {STEPS} steps, 1 thread): engine "
              f"{row['engine_s_median']:.2f} s (log-prob pass "
              f"{row['engine_log_prob_pass_s_median']:.2f} s, {row['engine_micro_batches']} "
              f"micro-batches), transformers {row['transformers_s_median']:.2f} s (log-prob pass "
              f"{row['transformers_log_prob_pass_s_median']:.2f} s), ratio "
              f"{row['ratio_engine_over_transformers_median']:.2f} (runs "
              + ", ".join(f"{r:.2f}" for r in row["ratios"]) + "); step-1 loss "
              f"{row['loss1']['engine']:.6f} / {row['loss1']['transformers']:.6f}, grad norm "
              f"{row['grad_norm1']['engine']:.5f} / {row['grad_norm1']['transformers']:.5f}")
    print(f"wrote {write('engine_speed', {'sizes': rows})}")
    return rows


if __name__ == "__main__":
    main()
