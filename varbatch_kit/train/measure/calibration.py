"""Calibration sweep: time synthetic micro-batches on this device, fit the cost model.

:func:`calibrate` builds the training engine's model
(:func:`~varbatch_kit.train.model.gpt.build_gpt`
with the per-sample packed attention of :mod:`~varbatch_kit.train.model.attention`),
packs micro-batches of chosen compositions with :func:`~varbatch_kit.train.step.packed_batch.pack`
and times each one's forward (model + the policy-gradient loss over its
response tokens) and backward with the engine's
:class:`~varbatch_kit.train.step.microbatch_timer.MicroBatchTimer`
(``torch.cuda.synchronize()`` at the boundaries on CUDA). Warm-up passes run
first; every composition is timed ``repeats`` times (the repeats interleaved
over the compositions) and its fastest pass kept: other processes on the
same cores only ever add time, so the minimum is the best estimate of the
micro-batch's own cost.

The compositions vary ``sum L`` and ``sum L^2`` independently
(:func:`grid_compositions`: a token budget ``T`` split into ``k`` equal
samples has ``sum L = T`` and ``sum L^2 = T^2 / k``). The cost model
(:mod:`varbatch_kit.analysis.cost_model`) is fitted on the grid and judged
on *held-out* random compositions (:func:`random_compositions`: mixed
lengths, a different shape of micro-batch), so the reported R² says how well
``c0 + c1 sum L + c2 sum L^2`` predicts micro-batches it has not seen.

Runs in the calling process: it starts a one-process gloo group and
megatron-core's parallel state when none exists (and tears them down
after), sets ``torch`` to ``threads`` threads for the sweep (1 by default,
like a training worker with ``threads_per_worker=1``) and restores it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from varbatch_kit.analysis.cost_model import CostFit, MicroBatchCostModel, fit_with_holdout
from varbatch_kit.checks import nonnegative_int, positive_int
from varbatch_kit.train.config.train_config import TrainConfig

__all__ = ["Calibration", "calibrate", "grid_compositions", "random_compositions"]


def grid_compositions(max_tokens: int, *, budgets: int = 4, splits: Sequence[int] = (1, 2, 4, 8),
                      min_len: int = 16) -> list[list[int]]:
    """Token budgets ``T`` (``budgets`` values, geometric, the largest ``max_tokens``), each
    split into ``k`` equal samples for every ``k`` in ``splits`` with ``T / k >= min_len``."""
    positive_int("max_tokens", max_tokens)
    positive_int("budgets", budgets)
    positive_int("min_len", min_len)
    if max_tokens < 2 * min_len:
        raise ValueError(f"max_tokens={max_tokens} must be at least 2 * min_len={2 * min_len}")
    lo = max(2 * min_len, max_tokens // 2 ** (budgets - 1)) if budgets > 1 else max_tokens
    totals = sorted({int(round(x)) for x in np.geomspace(lo, max_tokens, budgets)})
    out = []
    for T in totals:
        for k in splits:
            positive_int("splits", k)
            if T // k >= min_len:
                out.append([T // k] * k)
    return out


def random_compositions(n: int, max_tokens: int, *, min_len: int = 16, max_samples: int = 8,
                        seed: int = 0) -> list[list[int]]:
    """``n`` micro-batches of 1..``max_samples`` samples of mixed (log-uniform) lengths, at most
    ``max_tokens`` tokens each."""
    positive_int("n", n)
    positive_int("max_tokens", max_tokens)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(1, max_samples + 1))
        L = np.exp(rng.uniform(np.log(min_len), np.log(max_tokens), k)).astype(int)
        L = np.maximum(L, min_len)
        while L.sum() > max_tokens and L.size > 1:
            L = L[:-1]
        if L.sum() > max_tokens:
            L = np.array([max_tokens])
        out.append([int(x) for x in L])
    return out


@dataclass(frozen=True, eq=False)
class Calibration:
    """A calibration sweep's measurements and the cost model fitted to them.

    ``measurements``: one dict per composition: ``lengths, num_samples,
    sum_len, sum_len_sq, fwd_s, bwd_s, time_s`` (of its fastest repeat),
    ``heldout`` (judged, not fitted). ``fit``: the :class:`CostFit`.
    """

    measurements: list[dict]
    fit: CostFit
    info: dict = field(default_factory=dict)

    @property
    def model(self) -> MicroBatchCostModel:
        return self.fit.model

    def save(self, path) -> Path:
        """Write the measurements, the sweep's settings and the fitted model as JSON
        (``{"info", "model", "measurements"}``; the notebooks read such a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        model = {k: (None if isinstance(v, float) and math.isnan(v) else v)
                 for k, v in self.model.to_dict().items()}
        path.write_text(json.dumps({"info": self.info, "model": model,
                                    "heldout_r2": self.fit.heldout_r2,
                                    "measurements": self.measurements}, indent=1) + "\n")
        return path

    def table(self):
        """The measurements as a pandas table, with the prediction of each."""
        import pandas as pd

        t = pd.DataFrame(self.measurements)
        t["predicted_s"] = self.fit.predicted_s
        return t


def _device_name(dev) -> str:
    import torch

    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return "cpu"


def calibrate(
    config: TrainConfig | None = None,
    *,
    compositions: Sequence[Sequence[int]] | None = None,
    heldout: Sequence[Sequence[int]] | None = None,
    max_tokens: int = 2048,
    n_heldout: int = 8,
    repeats: int = 3,
    warmup: int = 2,
    threads: int = 1,
    device: str = "auto",
    seed: int = 0,
    progress: bool = True,
) -> Calibration:
    """Time micro-batches of chosen compositions with the engine's model; fit the cost model.

    Parameters
    ----------
    config:
        The model (its :class:`ModelConfig` ``config.model``, resolved once) and
        ``config.data.seed``; default ``TrainConfig()``'s toy GPT.
    compositions:
        Sample lengths (prompt + response) of each fitted micro-batch;
        default :func:`grid_compositions` up to ``max_tokens``.
    heldout:
        Compositions timed and judged but not fitted; default
        ``n_heldout`` :func:`random_compositions` up to ``max_tokens``.
    repeats, warmup:
        Timed passes per composition (the fastest kept) and untimed passes first.
    threads:
        torch CPU threads during the sweep (1, as a training worker).
    device:
        ``"auto"`` (CUDA when present), ``"cpu"`` or ``"cuda"``.
    """
    import torch

    cfg = TrainConfig() if config is None else config
    if not isinstance(cfg, TrainConfig):
        raise ValueError(f"config must be a TrainConfig, got {type(cfg).__name__}")
    for name, v in (("repeats", repeats), ("threads", threads)):
        positive_int(name, v)
    nonnegative_int("warmup", warmup, numpy=False)
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r}; choose 'auto', 'cpu' or 'cuda'")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    fit_set = [list(map(int, c)) for c in (compositions if compositions is not None
                                           else grid_compositions(max_tokens))]
    out_set = [list(map(int, c)) for c in (heldout if heldout is not None
                                           else random_compositions(n_heldout, max_tokens,
                                                                    seed=seed + 1))]
    for c in fit_set + out_set:
        if not c or min(c) < 2:
            raise ValueError(f"composition {c}: every sample needs at least 2 tokens (a prompt "
                             "token and a response token)")
    if len(fit_set) < 3:
        raise ValueError(f"{len(fit_set)} compositions to fit: need at least 3")
    longest = max(max(c) for c in fit_set + out_set)

    from varbatch_kit.train.parallel.process_setup import single_process

    model = cfg.resolve_model()  # the checkpoint's config.json read once, before the sweep

    t_start = time.perf_counter()
    with single_process(device, threads) as dev:
        rows = _sweep(cfg, model, dev, fit_set, out_set, longest, repeats, warmup, seed, progress)
        dev_name = _device_name(dev)
    mask = np.array([r["heldout"] for r in rows])
    fit = fit_with_holdout(
        [r["sum_len"] for r in rows], [r["sum_len_sq"] for r in rows],
        [r["time_s"] for r in rows], heldout_mask=mask, device=dev_name, source="calibrate",
        forward_share=float(sum(r["fwd_s"] for r in rows) / sum(r["time_s"] for r in rows)))
    info = {"config": cfg.summary(), "device": dev_name, "repeats": repeats, "warmup": warmup,
            "threads": threads, "wall_s": time.perf_counter() - t_start}
    return Calibration(rows, fit, info)


def _sweep(cfg, model, dev, fit_set, out_set, longest, repeats, warmup, seed,
           progress) -> list[dict]:
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from tqdm.auto import tqdm

    from varbatch_kit.train.model.gpt import build_gpt
    from varbatch_kit.train.step.microbatch_timer import MicroBatchTimer
    from varbatch_kit.train.step.packed_batch import pack, response_logits, response_token_stats

    torch.manual_seed(cfg.data.seed)
    model_parallel_cuda_manual_seed(cfg.data.seed, inference_rng_tracker=True,
                                    force_reset_rng=True)
    gpt = build_gpt(model, max_seq_len=max(longest, model.max_seq_len or 0)).to(dev)
    gpt.train()
    rng = np.random.default_rng(seed)

    def one(lengths, timer):
        seqs = [rng.integers(0, model.vocab_size, n) for n in lengths]
        batch = pack(seqs, [1] * len(lengths), device=dev)
        timer.lengths = batch.lengths

        def forward():
            logits = response_logits(gpt, batch)  # as the training engine does
            stats = response_token_stats(logits, batch, at_response_rows=True)
            # a policy-gradient loss of advantage 1 (on-policy: -log p), the step's cost
            return -stats["logprob"].sum() / max(1, stats["logprob"].numel())

        timer.backward(timer.forward(forward).backward)
        gpt.zero_grad(set_to_none=True)

    cuda = dev.type == "cuda"
    jobs = [(c, False) for c in fit_set] + [(c, True) for c in out_set]
    bar = tqdm(total=warmup + len(jobs) * repeats, desc="calibrate", disable=not progress,
               unit="mb")
    for _ in range(warmup):  # the largest composition: allocator and first-call costs
        one(max(fit_set, key=sum), MicroBatchTimer(cuda=cuda))
        bar.update()
    rows = []
    order = [(j, r) for r in range(repeats) for j in range(len(jobs))]  # interleave the repeats
    times: dict[int, list[tuple[float, float]]] = {j: [] for j in range(len(jobs))}
    for j, _ in order:
        timer = MicroBatchTimer(cuda=cuda)
        one(jobs[j][0], timer)
        rec = timer.records[0]
        times[j].append((rec["fwd_s"], rec["bwd_s"]))
        bar.update()
    bar.close()
    for j, (c, held) in enumerate(jobs):
        fb = np.array(times[j])
        tot = fb.sum(axis=1)
        k = int(np.argmin(tot))  # the fastest pass: other load on the machine only adds time
        L = np.asarray(c, dtype=np.int64)
        rows.append({"lengths": [int(x) for x in L], "num_samples": int(L.size),
                     "sum_len": int(L.sum()), "sum_len_sq": int((L * L).sum()),
                     "fwd_s": float(fb[k, 0]), "bwd_s": float(fb[k, 1]),
                     "time_s": float(tot[k]), "heldout": bool(held)})
    return rows
