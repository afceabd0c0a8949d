"""Record golden vectors of slime's ``policy_loss_function`` and ``loss_function`` end to end.

    python scripts/record_slime_loss.py --slime /path/to/slime/checkout \
        --out tests/golden/objective

slime's ``backends/megatron_utils/loss.py`` is imported as a real module (not
copied, not parsed) and run on random packed logits ``[1, T, V]``: its
``loss_function`` builds the reducer with ``cp_utils.get_sum_of_sample_mean``,
calls ``policy_loss_function``, which runs ``get_log_probs_and_entropy``
(slime's vocab-parallel log-prob/entropy autograd function, on a TP group of
one), ``compute_policy_loss`` / ``compute_cispo_loss`` / ``compute_gspo_kl`` /
``compute_opsm_mask`` / ``compute_approx_kl`` and the TIS functions. The
recorder then calls ``backward`` on the returned loss and records the gradient
with respect to the logits.

How slime runs here (one CPU process):

- ``torch.distributed`` is a gloo group of world size 1 (file rendezvous in a
  temporary folder) and megatron-core's real ``parallel_state`` is initialised
  with tensor = pipeline = context parallel size 1 (``megatron.core.mpu`` is
  megatron's own module: data-parallel world 1, TP group of one rank).
- The ``slime``, ``slime.utils``, ``slime.backends`` and
  ``slime.backends.megatron_utils`` package ``__init__`` files are skipped (bare
  namespace packages): ``slime/__init__.py`` initialises the accelerator stack.
  No module is stubbed: ray, sglang and Transformer Engine are not imported by
  ``loss.py`` and its imports (``cp_utils``, ``ppo_utils``, ``misc``,
  ``distributed_utils``, ``types``, ``http_utils``).
- ``@torch.compile`` (on ``compute_approx_kl``, ``compute_policy_loss``, ...)
  is the identity while ``ppo_utils`` loads, as in
  ``scripts/record_slime_objective.py``: the vectors are slime's eager math.
- ``--custom-tis-function-path`` for ICEPOP is slime's own
  ``slime.backends.megatron_utils.loss.icepop_function`` (loaded by slime's
  ``load_function``).

Each case's ``inputs`` hold ``args`` (the namespace slime reads), ``batch``
(per-sample lists as slime's micro-batch holds them: ``unconcat_tokens``,
``total_lengths``, ``response_lengths``, ``loss_masks``, ``advantages``,
``log_probs`` and ``rollout_log_probs`` when present, ``ref_log_probs``,
``rollout_mask_sums``) and ``logits``; ``loss_function`` cases also
``num_microbatches`` and ``step_global_batch_size``; ``policy_loss_function``
cases also ``sum_of_sample_mean``: the ``sample_denoms`` and
``calculate_per_token_loss`` of the reducer handed in
(``get_sum_of_sample_mean(total_lengths, response_lengths, loss_masks, ...)``),
the one ``loss_function`` would build in two cases of three, else a per-sample
mean. Outputs:

- ``policy_loss_function``: ``{"loss", "metrics": {key: value, ...} (slime's
  order), "logits_grad"}``;
- ``loss_function``: ``{"loss" (scaled), "normalizer", "log": {"keys",
  "values"}, "logits_grad"}``.

The file format (header with the commit, one case per line, tensor encoding)
is the one of ``scripts/record_slime_objective.py``.
"""

# ruff: noqa: B023  (every case lambda is called at once, inside run_case)
from __future__ import annotations

import importlib
import random
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from _golden_recorder import record
from record_slime_objective import OBJECTIVE_FORMAT, _package, run_case

GENERATOR = "scripts/record_slime_loss.py"
DEFAULT_SEED = 20261202
ICEPOP_PATH = "slime.backends.megatron_utils.loss.icepop_function"

# --------------------------------------------------------------------------- loading slime


def _init_single_process() -> None:
    """gloo world of one and megatron-core's parallel state with tp = pp = cp = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        store = Path(tempfile.mkdtemp(prefix="slime_loss_")) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, context_parallel_size=1)


def load_slime(root: Path) -> SimpleNamespace:
    """slime's ``loss`` and ``cp_utils`` modules from the checkout at ``root``."""
    root = root.resolve()
    path = root / "slime" / "backends" / "megatron_utils" / "loss.py"
    if not path.is_file():
        raise SystemExit(f"{root} is not a slime checkout (no {path.relative_to(root)})")
    sys.path.insert(0, str(root))
    for pkg in ("slime", "slime.utils", "slime.backends", "slime.backends.megatron_utils"):
        _package(root, pkg)
    _init_single_process()
    compile_ = torch.compile
    torch.compile = lambda fn=None, **kw: (fn if fn is not None else (lambda f: f))
    try:
        loss = importlib.import_module("slime.backends.megatron_utils.loss")
    finally:
        torch.compile = compile_
    cp_utils = importlib.import_module("slime.backends.megatron_utils.cp_utils")
    return SimpleNamespace(loss=loss, cp_utils=cp_utils)


# --------------------------------------------------------------------------- generators

ESTIMATORS = ("grpo", "gspo", "cispo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
TEMPERATURES = (1.0, 0.7, 1.3)


def _noise(rng: random.Random, x: torch.Tensor, sd: float) -> torch.Tensor:
    """``x`` plus Gaussian noise, rounded to 4 decimals (short JSON), float32."""
    return torch.tensor([round(v + rng.gauss(0, sd), 4) for v in x.tolist()], dtype=torch.float32)


def _mask(rng: random.Random, n: int, dtype) -> torch.Tensor:
    kind = rng.choice(["ones", "random", "prefix"])
    if kind == "ones":
        vals = [1] * n
    elif kind == "prefix":
        k = rng.randint(1, n)
        vals = [1] * k + [0] * (n - k)
    else:
        vals = [rng.randint(0, 1) for _ in range(n)]
        vals[rng.randrange(n)] = 1
    return torch.tensor(vals, dtype=dtype)


def options(i: int, rng: random.Random) -> dict:
    """The slime flags of case ``i``: every option cycles with its own period."""
    estimator = ESTIMATORS[i % 3]
    kl = ([None] + list(KL_TYPES))[i % 5]
    tis = (None, "vanilla", "icepop")[(i // 3) % 3]
    eps = rng.choice([0.1, 0.2])
    return {
        "loss_type": "policy_loss",
        "advantage_estimator": estimator,
        "eps_clip": eps,
        "eps_clip_high": rng.choice([eps, 0.28, 0.4]),
        "eps_clip_c": (None, 3.0, None, 1.5)[(i // 2) % 4],
        "use_kl_loss": kl is not None,
        "kl_loss_coef": rng.choice([0.01, 0.1]) if kl else 0.0,
        "kl_loss_type": kl or "low_var_kl",
        "use_unbiased_kl": kl is not None and (i // 5) % 2 == 1,
        "entropy_coef": (0.0, 0.01, 0.1)[(i // 4) % 3],
        "use_tis": tis is not None,
        "custom_tis_function_path": ICEPOP_PATH if tis == "icepop" else None,
        "tis_clip_low": rng.choice([0.0, 0.5, 0.8]),
        "tis_clip": rng.choice([1.2, 2.0]),
        "get_mismatch_metrics": tis is None and i % 7 == 3,
        "use_rollout_logprobs": i % 4 == 1,
        "rollout_temperature": TEMPERATURES[(i // 6) % 3],
        "calculate_per_token_loss": i % 2 == 1,
        "use_opsm": i % 11 == 5,
        "opsm_delta": rng.choice([0.0, 0.05]),
        "log_probs_chunk_size": (-1, -1, 4)[i % 3],
        "allgather_cp": False,
        "rollout_top_p": 1.0,
        "recompute_loss_function": False,
        "custom_pg_loss_reducer_function_path": None,
    }


def make_case(i: int, rng: random.Random) -> tuple[SimpleNamespace, dict, torch.Tensor]:
    """``(args, batch, logits)`` of case ``i``: 3-5 packed samples, a fully masked one in
    two cases of three, per-rollout denominators in five of six."""
    args = SimpleNamespace(**options(i, rng))
    n = rng.randint(3, 5)
    vocab = rng.randint(11, 17)
    prompts = [rng.randint(1, 3) for _ in range(n)]
    responses = [rng.randint(1, 6) for _ in range(n)]
    totals = [p + r for p, r in zip(prompts, responses, strict=True)]
    pad = rng.randint(0, 3)
    T = sum(totals) + pad
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = (torch.randn(1, T, vocab, generator=gen) * 1.5).round(decimals=3)
    tokens = [torch.tensor([rng.randrange(vocab) for _ in range(L)], dtype=torch.long)
              for L in totals]
    mask_dtype = torch.float32 if i % 8 in (2, 3) else torch.int32  # slime: int32
    masks = [_mask(rng, r, mask_dtype) for r in responses]
    if i % 3 != 2:
        masks[rng.randrange(n)].zero_()  # a fully masked sample (a removed sample)

    # the current policy's log-probs, to draw old / rollout / reference ones near them
    scaled = logits[0] / args.rollout_temperature
    logp = torch.log_softmax(scaled, dim=-1)
    current, end = [], 0
    for tok, L, R in zip(tokens, totals, responses, strict=True):
        end += L
        rows = logp[end - R - 1:end - 1]
        current.append(rows.gather(1, tok[-R:, None])[:, 0])
    stale = 0.05 if i % 2 else 0.4
    batch = {
        "unconcat_tokens": tokens,
        "total_lengths": totals,
        "response_lengths": responses,
        "loss_masks": masks,
        "advantages": [
            torch.tensor([round(rng.gauss(0, 1), 4)] * R if i % 5 != 4 else
                         [round(rng.choice([0.0, rng.gauss(0, 1)]), 4) for _ in range(R)],
                         dtype=torch.float32) for R in responses],
    }
    if i % 8 != 7:  # else on-policy: slime uses the detached current log-probs as old
        batch["log_probs"] = [_noise(rng, c, stale) for c in current]
    batch["ref_log_probs"] = [_noise(rng, c, 0.3) for c in current]
    mismatch = args.use_tis or args.get_mismatch_metrics or args.use_rollout_logprobs
    if mismatch or i % 5 != 2:  # else no rollout log-probs (no logprob_abs_diff)
        batch["rollout_log_probs"] = [_noise(rng, c, rng.choice([0.05, 0.5])) for c in current]
    if i % 6 != 0:
        rollout = [rng.randrange(max(1, n // 2)) for _ in range(n)]
        per = {r: 0.0 for r in rollout}
        for r, m in zip(rollout, masks, strict=True):
            per[r] += float(m.sum())
        extra = {r: float(rng.choice([0, 0, 2, 5])) for r in per}  # siblings in other mbs
        batch["rollout_mask_sums"] = torch.tensor([per[r] + extra[r] for r in rollout],
                                                  dtype=torch.float32)
    else:
        batch["rollout_mask_sums"] = None
    return args, batch, logits


def family_policy_loss_function(S, rng):
    cases = []
    for i in range(30):
        args, batch, logits = make_case(i, rng)
        # the reducer handed in: loss_function's in two cases of three, else a per-sample
        # mean (slime's TIS path rebuilds its own from rollout_mask_sums; the mismatch
        # metrics keep this one)
        own = i % 3 != 1
        reducer = {"sample_denoms": batch["rollout_mask_sums"] if own else None,
                   "calculate_per_token_loss": args.calculate_per_token_loss if own else False}
        inp = {"args": args, "batch": batch, "logits": logits, "sum_of_sample_mean": reducer}

        def run(args=args, batch=batch, logits=logits, reducer=reducer):
            x = logits.clone().requires_grad_(True)
            sum_of_sample_mean = S.cp_utils.get_sum_of_sample_mean(
                batch["total_lengths"], batch["response_lengths"], batch["loss_masks"],
                reducer["sample_denoms"], reducer["calculate_per_token_loss"])
            loss, metrics = S.loss.policy_loss_function(args, batch, x, sum_of_sample_mean)
            loss.backward()
            return {"loss": loss, "metrics": metrics, "logits_grad": x.grad}

        cases.append(run_case(run, inp))
    return cases


def family_loss_function(S, rng):
    cases = []
    for i in range(48):
        args, batch, logits = make_case(i, rng)
        n_mb = rng.randint(1, 4)
        gbs = len(batch["total_lengths"]) + rng.randint(0, 8)
        inp = {"args": args, "batch": batch, "num_microbatches": n_mb,
               "step_global_batch_size": gbs, "logits": logits}

        def run(args=args, batch=batch, logits=logits, n_mb=n_mb, gbs=gbs):
            x = logits.clone().requires_grad_(True)
            loss, normalizer, log = S.loss.loss_function(args, batch, n_mb, gbs, x)
            loss.backward()
            return {"loss": loss, "normalizer": normalizer, "log": log, "logits_grad": x.grad}

        cases.append(run_case(run, inp))
    return cases


FAMILIES = {
    "policy_loss_function": family_policy_loss_function,
    "loss_function": family_loss_function,
}


def main(argv: list[str] | None = None) -> int:
    return record(argv, description=__doc__.split("\n\n")[0], families=FAMILIES,
                  load_slime=load_slime, generator=GENERATOR, default_seed=DEFAULT_SEED,
                  **OBJECTIVE_FORMAT)


if __name__ == "__main__":
    raise SystemExit(main())
