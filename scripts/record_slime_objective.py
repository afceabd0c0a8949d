"""Record golden vectors of slime's RL objective by running slime's own functions.

    python scripts/record_slime_objective.py --slime /path/to/slime/checkout \
        --out tests/golden/objective

The checkout (THUDM/slime; the folder that holds ``slime/``) is imported, not
copied, the way ``scripts/record_slime_golden.py`` does it:

- ``slime/utils/ppo_utils.py`` is imported as a module of bare namespace
  packages (the ``slime`` package ``__init__`` files would import the
  accelerator stack). Its ``@torch.compile`` decorators are made the identity
  while it loads (the vectors are slime's eager math; inductor on CPU may fuse
  float32 ops differently). ``megatron.core.mpu`` is a stub with a
  context-parallel size of 1.
- ``vanilla_tis_function`` / ``icepop_function`` (``backends/megatron_utils/loss.py``)
  and ``RolloutManager._post_process_rewards`` (``ray/rollout.py``) live in
  modules that import megatron, ray and sglang at the top. Those two files are
  parsed with ``ast`` and only the named function definitions are compiled
  from the checkout's text and run (with ``torch`` and ``Any`` in scope).
  ``_post_process_rewards`` is called unbound on a stub ``self`` that holds
  ``args`` (and no custom post-process function), on real slime ``Sample``
  objects (``slime/utils/types.py`` imported, its ``http_utils`` leaf stubbed).

Each file::

    {"slime_commit": ..., "generator": "scripts/record_slime_objective.py", "seed": ...,
     "function": ..., "cases": [{"inputs": {...}, "output": ...} |
                                {"inputs": {...}, "error": {"type": ..., "message": ...}}]}

A tensor is ``{"dtype": "float32", "shape": [...], "data": [...]}`` (flat,
row-major); floats are written with ``repr`` (exact round trip), non-finite
floats as the strings ``"nan"``, ``"inf"``, ``"-inf"``.
"""

# ruff: noqa: B023  (every case lambda is called at once, inside run_case)
from __future__ import annotations

import ast
import contextlib
import importlib
import math
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from _golden_recorder import record

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
GENERATOR = "scripts/record_slime_objective.py"
DEFAULT_SEED = 20261201

# --------------------------------------------------------------------------- loading slime


def _package(root: Path, pkg: str) -> None:
    mod = types.ModuleType(pkg)
    mod.__path__ = [str(root.joinpath(*pkg.split(".")))]
    sys.modules[pkg] = mod
    if "." in pkg:
        parent, _, name = pkg.rpartition(".")
        setattr(sys.modules[parent], name, mod)


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    parent, _, leaf = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], leaf, mod)
    return mod


def _functions_from(path: Path, names: dict[str, str | None], scope: dict) -> dict:
    """Compile the definitions ``names`` (function name -> enclosing class or None) of ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = {}
    for node in tree.body:
        bodies = [(None, node)]
        if isinstance(node, ast.ClassDef):
            bodies = [(node.name, n) for n in node.body]
        for owner, fn in bodies:
            if isinstance(fn, ast.FunctionDef) and names.get(fn.name, "?") == owner:
                found[fn.name] = fn
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"{path}: definitions not found: {sorted(missing)}")
    out = {}
    for name, fn in found.items():
        module = ast.Module(body=[fn], type_ignores=[])
        ns = dict(scope)
        exec(compile(module, str(path), "exec"), ns)  # noqa: S102 (slime's own text)
        out[name] = ns[name]
    return out


def load_slime(root: Path) -> SimpleNamespace:
    """The slime functions the vectors need, from the checkout at ``root``."""
    root = root.resolve()
    ppo = root / "slime" / "utils" / "ppo_utils.py"
    if not ppo.is_file():
        raise SystemExit(f"{root} is not a slime checkout (no slime/utils/ppo_utils.py)")
    sys.path.insert(0, str(root))
    for pkg in ("slime", "slime.utils", "slime.backends", "slime.backends.megatron_utils",
                "slime.ray"):
        _package(root, pkg)
    _stub("megatron")
    _stub("megatron.core")
    mpu = _stub("megatron.core.mpu", get_context_parallel_world_size=lambda: 1,
                get_context_parallel_rank=lambda: 0, is_pipeline_last_stage=lambda: True,
                get_data_parallel_group=lambda **kw: None)
    _stub("slime.utils.http_utils", is_port_available=lambda *a, **k: True)

    compile_ = torch.compile
    torch.compile = lambda fn=None, **kw: (fn if fn is not None else (lambda f: f))
    try:
        ppo_utils = importlib.import_module("slime.utils.ppo_utils")
    finally:
        torch.compile = compile_
    sample_types = importlib.import_module("slime.utils.types")
    dist_utils = importlib.import_module("slime.utils.distributed_utils")

    def no_opd(*a, **k):
        raise AssertionError("use_opd is not recorded")

    loss_scope = {"torch": torch, "Any": Any, "Namespace": SimpleNamespace, "mpu": mpu,
                  "RolloutBatch": dict, "load_function": None, "apply_opd_kl_to_advantages": no_opd,
                  "distributed_masked_whiten": dist_utils.distributed_masked_whiten,
                  "get_logits_and_tokens_offset_with_cp": None}
    loss_scope.update({n: getattr(ppo_utils, n) for n in (
        "compute_approx_kl", "get_grpo_returns", "get_reinforce_plus_plus_returns",
        "get_reinforce_plus_plus_baseline_advantages", "get_advantages_and_returns_batch")})
    loss = _functions_from(root / "slime" / "backends" / "megatron_utils" / "loss.py",
                           {"vanilla_tis_function": None, "icepop_function": None,
                            "compute_advantages_and_returns": None}, loss_scope)
    rollout = _functions_from(root / "slime" / "ray" / "rollout.py",
                              {"_post_process_rewards": "RolloutManager"},
                              {"torch": torch, "Sample": sample_types.Sample})
    return SimpleNamespace(ppo=ppo_utils, Sample=sample_types.Sample, dist_utils=dist_utils,
                           **loss, **rollout)


@contextlib.contextmanager
def single_rank_all_reduce():
    """``torch.distributed.all_reduce`` as a no-op: one rank, the sum is the local value."""
    old = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda tensor, *a, **k: None
    try:
        yield
    finally:
        torch.distributed.all_reduce = old


def enc_float(x: float):
    x = float(x)
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def enc(v):
    """JSON form of a value slime takes or returns."""
    if isinstance(v, torch.Tensor):
        flat = v.detach().reshape(-1).tolist()
        data = [enc_float(x) if v.is_floating_point() else x for x in flat]
        return {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                "data": data}
    if isinstance(v, bool) or v is None or isinstance(v, int | str):
        return v
    if isinstance(v, float):
        return enc_float(v)
    if isinstance(v, list | tuple):
        return [enc(x) for x in v]
    if isinstance(v, dict):
        return {k: enc(x) for k, x in v.items()}
    if isinstance(v, SimpleNamespace):
        return enc(vars(v))
    raise TypeError(f"cannot encode {type(v)}")


def run_case(fn, inputs: dict) -> dict:
    """The inputs (encoded before the call: slime may write into them) and the result."""
    encoded = enc(inputs)
    try:
        out = fn()
    except (AssertionError, ValueError) as e:
        return {"inputs": encoded, "error": {"type": type(e).__name__, "message": str(e)}}
    return {"inputs": encoded, "output": enc(out)}


# --------------------------------------------------------------------------- generators

DTYPES = (torch.float32, torch.float64)


def t(values, dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def logp(rng: random.Random, n: int, dtype, spread: float = 1.0) -> torch.Tensor:
    return t([-abs(rng.gauss(0, spread)) - 1e-3 for _ in range(n)], dtype)


def mask(rng: random.Random, n: int, kind: str | None = None) -> torch.Tensor:
    kind = kind or rng.choice(["ones", "random", "random", "zeros", "prefix"])
    if kind == "ones":
        vals = [1] * n
    elif kind == "zeros":
        vals = [0] * n
    elif kind == "prefix":
        k = rng.randint(0, n)
        vals = [1] * k + [0] * (n - k)
    else:
        vals = [rng.randint(0, 1) for _ in range(n)]
    return t(vals, torch.float32 if rng.random() < 0.5 else torch.int64)


def family_approx_kl(S, rng):
    cases = []
    for kl_type in ("k1", "k2", "k3", "low_var_kl"):
        for with_ratio in (False, True):
            for dtype in DTYPES:
                for spread in (0.3, 2.0, 12.0):
                    n = rng.randint(0, 9)
                    a, b = logp(rng, n, dtype, spread), logp(rng, n, dtype, spread)
                    ratio = t([math.exp(rng.gauss(0, 0.7)) for _ in range(n)],
                              rng.choice(DTYPES)) if with_ratio else None
                    inp = {"log_probs": a, "log_probs_base": b, "kl_loss_type": kl_type,
                           "importance_ratio": ratio}
                    cases.append(run_case(lambda: S.ppo.compute_approx_kl(a, b, kl_type, ratio),
                                          inp))
    a, b = logp(rng, 3, torch.float32), logp(rng, 3, torch.float32)
    cases.append(run_case(lambda: S.ppo.compute_approx_kl(a, b, "k4"),
                          {"log_probs": a, "log_probs_base": b, "kl_loss_type": "k4",
                           "importance_ratio": None}))
    return cases


def family_policy_loss(S, rng):
    cases = []
    for i in range(60):
        dtype = DTYPES[i % 2]
        n = rng.randint(0, 10)
        ppo_kl = t([rng.gauss(0, 0.3) for _ in range(n)], dtype)
        adv = t([rng.choice([0.0, rng.gauss(0, 1)]) for _ in range(n)], dtype)
        eps = rng.choice([0.1, 0.2, 0.28])
        eps_high = rng.choice([eps, 0.28, 0.4])
        eps_c = [None, None, 3.0, 1.5, 10.0, 1.0, 0.5][i % 7]
        inp = {"ppo_kl": ppo_kl, "advantages": adv, "eps_clip": eps, "eps_clip_high": eps_high,
               "eps_clip_c": eps_c}
        cases.append(run_case(lambda: S.ppo.compute_policy_loss(ppo_kl, adv, eps, eps_high, eps_c),
                              inp))
    return cases


def family_cispo_loss(S, rng):
    cases = []
    for i in range(40):
        dtype = DTYPES[i % 2]
        n = rng.randint(0, 10)
        ppo_kl = t([rng.gauss(0, 0.4) for _ in range(n)], dtype)
        lp = logp(rng, n, dtype)
        adv = t([rng.gauss(0, 1) for _ in range(n)], dtype)
        eps = rng.choice([0.2, 1.0, 5.0])
        eps_high = rng.choice([0.2, 0.28, 4.0])
        inp = {"ppo_kl": ppo_kl, "log_probs": lp, "advantages": adv, "eps_clip": eps,
               "eps_clip_high": eps_high}
        cases.append(run_case(lambda: S.ppo.compute_cispo_loss(ppo_kl, lp, adv, eps, eps_high),
                              inp))
    return cases


def _seq_lists(rng, dtype, kinds=None):
    k = rng.randint(1, 4)
    lens = [rng.randint(1, 8) for _ in range(k)]
    kinds = kinds or [None] * k
    new = [logp(rng, n, dtype) for n in lens]
    old = [logp(rng, n, dtype) for n in lens]
    masks = [mask(rng, n, kinds[i % len(kinds)]) for i, n in enumerate(lens)]
    return lens, new, old, masks


def family_gspo_kl(S, rng):
    cases = []
    for i in range(40):
        dtype = DTYPES[i % 2]
        lens, new, old, masks = _seq_lists(rng, dtype, ["zeros", None] if i % 5 == 0 else None)
        # local log-probs: the full ones, or a CP-local slice (only the shape is read)
        local = new if i % 3 else [x[: rng.randint(0, len(x))] for x in new]
        inp = {"full_log_probs": new, "full_old_log_probs": old, "local_log_probs": local,
               "loss_masks": masks}
        cases.append(run_case(lambda: S.ppo.compute_gspo_kl(new, old, local, masks), inp))
    return cases


def family_opsm_mask(S, rng):
    cases = []
    for i in range(40):
        dtype = DTYPES[i % 2]
        lens, new, old, masks = _seq_lists(rng, dtype, ["zeros", None] if i % 5 == 0 else None)
        adv = [t([rng.choice([-1.0, 1.0]) * rng.random()] * n, dtype) for n in lens]
        args = SimpleNamespace(opsm_delta=rng.choice([0.0, 0.05, 0.2, -0.1]))
        inp = {"args": args, "full_log_probs": new, "full_old_log_probs": old,
               "advantages": adv, "loss_masks": masks}
        cases.append(run_case(lambda: S.ppo.compute_opsm_mask(args, new, old, adv, masks), inp))
    return cases


def family_grpo_returns(S, rng):
    cases = []
    for i in range(20):
        k = rng.randint(1, 5)
        rewards = t([rng.gauss(0, 1) for _ in range(k)], torch.float32)
        kl = [t([rng.gauss(0, 0.1) for _ in range(rng.randint(0, 6))], DTYPES[i % 2])
              for _ in range(k)]
        cases.append(run_case(lambda: S.ppo.get_grpo_returns(rewards, kl),
                              {"rewards": rewards, "kl": kl}))
    return cases


def family_reinforce_pp_returns(S, rng):
    cases = []
    for i in range(40):
        k = rng.randint(1, 4)
        long = i % 8 == 0
        lens = [rng.randint(1, 300 if long else 10) for _ in range(k)]
        dtype = DTYPES[i % 2]
        rewards = t([rng.gauss(0, 1) for _ in range(k)], torch.float32)
        kl = [t([rng.gauss(0, 0.1) for _ in range(n)], dtype) for n in lens]
        kinds = ["zeros", None] if i % 10 == 5 else ["ones", "random", "prefix"]
        masks = [mask(rng, n, rng.choice(kinds)) for n in lens]
        if i % 10 != 5:  # non-empty masks except in the error cases
            for m in masks:
                m[rng.randrange(len(m))] = 1
        totals = [n + rng.randint(1, 5) for n in lens]
        kl_coef = rng.choice([0.0, 0.01, 0.5])
        gamma = [1.0, 0.99, 0.0, 0.5][i % 4]
        inp = {"rewards": rewards, "kl": kl, "loss_masks": masks, "response_lengths": lens,
               "total_lengths": totals, "kl_coef": kl_coef, "gamma": gamma}
        cases.append(run_case(lambda: S.ppo.get_reinforce_plus_plus_returns(
            rewards=rewards, kl=kl, loss_masks=masks, response_lengths=lens,
            total_lengths=totals, kl_coef=kl_coef, gamma=gamma), inp))
    return cases


def family_reinforce_pp_baseline(S, rng):
    cases = []
    for i in range(20):
        k = rng.randint(1, 4)
        lens = [rng.randint(0, 8) for _ in range(k)]
        dtype = DTYPES[i % 2]
        rewards = t([rng.gauss(0, 1) for _ in range(k)], torch.float32)
        kl = [t([rng.gauss(0, 0.1) for _ in range(n)], dtype) for n in lens]
        masks = [mask(rng, n) for n in lens]
        kl_coef = rng.choice([0.0, 0.01, 0.5])
        inp = {"rewards": rewards, "kl": kl, "loss_masks": masks, "kl_coef": kl_coef}
        cases.append(run_case(lambda: S.ppo.get_reinforce_plus_plus_baseline_advantages(
            rewards=rewards, kl=kl, loss_masks=masks, kl_coef=kl_coef), inp))
    return cases


def family_gae(S, rng):
    cases = []
    for i in range(40):
        k = rng.randint(1, 4)
        long = i % 8 == 0
        lens = [rng.randint(1, 300 if long else 10) for _ in range(k)]
        dtype = DTYPES[i % 2]
        values = [t([rng.gauss(0, 1) for _ in range(n)], dtype) for n in lens]
        rewards = [t([rng.gauss(0, 0.1) for _ in range(n)], dtype) for n in lens]
        totals = [n + rng.randint(1, 5) for n in lens]
        gamma = [1.0, 0.99, 0.0, 0.9][i % 4]
        lambd = [1.0, 0.95, 0.5, 0.0][(i // 4) % 4]
        chunked = i % 3 != 0
        inp = {"total_lengths": totals, "response_lengths": lens, "values_list": values,
               "rewards_list": rewards, "gamma": gamma, "lambd": lambd, "chunked": chunked}
        cases.append(run_case(lambda: S.ppo.get_advantages_and_returns_batch(
            totals, lens, values, rewards, gamma, lambd, chunked=chunked), inp))
    return cases


def family_discounted_returns(S, rng):
    cases = []
    for i in range(20):
        b, n = rng.randint(1, 3), rng.choice([1, 5, 127, 128, 129, 260])
        dtype = DTYPES[i % 2]
        rewards = t([[rng.gauss(0, 1) for _ in range(n)] for _ in range(b)], dtype)
        discount = [1.0, 0.99, 0.0, 0.5][i % 4]
        chunk = rng.choice([128, 4, 1])
        inp = {"rewards": rewards, "discount": discount, "chunk_size": chunk}
        cases.append(run_case(lambda: S.ppo.chunked_discounted_returns(rewards, discount, chunk),
                              inp))
    return cases


def _tis_family(fn):
    def family(S, rng):
        cases = []
        for i in range(30):
            dtype = DTYPES[i % 2]
            lens, train, rollout, masks = _seq_lists(rng, dtype,
                                                     ["zeros", None] if i % 5 == 0 else None)
            # rollout log-probs near the train ones, some far (ratios outside the bounds)
            rollout = [x + t([rng.gauss(0, 0.05 if i % 3 else 1.0) for _ in range(len(x))], dtype)
                       for x in train]
            pg = t([rng.gauss(0, 1) for _ in range(sum(lens))], dtype)
            args = SimpleNamespace(tis_clip_low=rng.choice([0.0, 0.5, 0.9]),
                                   tis_clip=rng.choice([1.1, 2.0, 5.0]))
            inp = {"args": args, "pg_loss": pg, "train_log_probs": train,
                   "rollout_log_probs": rollout, "loss_masks": masks}
            cases.append(run_case(lambda: getattr(S, fn)(
                args, pg_loss=pg, train_log_probs=train, rollout_log_probs=rollout,
                loss_masks=masks), inp))
        return cases
    return family


ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline", "reinforce_plus_plus",
              "ppo")


def family_post_process_rewards(S, rng):
    cases = []
    i = 0
    for estimator in ESTIMATORS:
        for norm in (True, False):
            for std_norm in (True, False):
                for shape in ("equal", "unequal", "single", "dict", "ints"):
                    i += 1
                    n_per, rbs = rng.choice([(4, 2), (2, 3), (8, 1), (1, 4)])
                    if shape == "single":
                        n_per, rbs = 1, rng.randint(1, 3)
                    count = n_per * rbs
                    if shape == "unequal":
                        count = max(1, count + rng.choice([-3, -1, 1, 2]))
                    key = "acc" if shape == "dict" else None

                    def reward():
                        if shape == "ints":
                            return rng.randint(0, 1)
                        r = round(rng.gauss(0, 1), 3) if rng.random() < 0.7 else 1.0
                        return {"acc": r, "fmt": rng.random()} if key else r

                    samples = []
                    for s in range(count):
                        smp = S.Sample(group_index=s // n_per, index=s, tokens=[1, 2, 3],
                                       response_length=2, reward=reward())
                        samples.append(smp)
                    args = SimpleNamespace(
                        advantage_estimator=estimator, rewards_normalization=norm,
                        grpo_std_normalization=std_norm, n_samples_per_prompt=n_per,
                        rollout_batch_size=rbs, reward_key=key)
                    manager = SimpleNamespace(args=args, custom_reward_post_process_func=None)
                    inp = {"args": args, "samples": [s.to_dict() for s in samples]}
                    cases.append(run_case(lambda: S._post_process_rewards(manager, samples), inp))
    return cases


def family_masked_whiten(S, rng):
    cases = []
    for i in range(30):
        dtype = DTYPES[i % 2]
        n = rng.randint(0, 12)
        values = t([rng.gauss(0.5, 2) for _ in range(n)], dtype)
        m = mask(rng, n, ["ones", "random", "zeros", "prefix"][i % 4])
        shift = i % 3 != 0
        eps = rng.choice([1e-8, 1e-3])
        inp = {"values": values, "mask": m, "shift_mean": shift, "epsilon": eps}
        with single_rank_all_reduce():
            cases.append(run_case(lambda: S.dist_utils.distributed_masked_whiten(
                values, m, process_group=None, shift_mean=shift, epsilon=eps), inp))
    return cases


def family_advantages_and_returns(S, rng):
    """slime's train-side ``compute_advantages_and_returns`` on one rank (no CP, last stage)."""
    cases = []
    i = 0
    for estimator in ("grpo", "gspo", "cispo", "ppo", "reinforce_plus_plus",
                      "reinforce_plus_plus_baseline"):
        for kl_coef in (0.0, 0.05):
            for normalize in (False, True):
                for rep in range(2):
                    i += 1
                    k = rng.randint(1, 4)
                    lens = [rng.randint(1, 8) for _ in range(k)]
                    kinds = ["ones", "random", "prefix"]
                    masks = [mask(rng, n, rng.choice(kinds)) for n in lens]
                    for m in masks:
                        m[rng.randrange(len(m))] = 1
                    if rep and estimator != "reinforce_plus_plus":
                        masks[0] = masks[0] * 0  # a fully masked sample
                    data = {
                        "log_probs": [logp(rng, n, torch.float32) for n in lens],
                        "ref_log_probs": [logp(rng, n, torch.float32) for n in lens],
                        "rollout_log_probs": [logp(rng, n, torch.float32) for n in lens],
                        "rewards": [rng.gauss(0, 1) for _ in lens],
                        "response_lengths": lens,
                        "total_lengths": [n + rng.randint(1, 5) for n in lens],
                        "loss_masks": masks,
                    }
                    if estimator == "ppo":
                        data["values"] = [t([rng.gauss(0, 1) for _ in range(n)], torch.float32)
                                          for n in lens]
                    args = SimpleNamespace(
                        advantage_estimator=estimator, kl_coef=kl_coef,
                        kl_loss_type=rng.choice(["k1", "k2", "k3", "low_var_kl"]),
                        use_rollout_logprobs=rng.random() < 0.3, normalize_advantages=normalize,
                        gamma=rng.choice([1.0, 0.99]), lambd=rng.choice([1.0, 0.95]),
                        custom_advantage_function_path=None, use_opd=False)
                    inp = {"args": args, "rollout_data": dict(data)}

                    def run(args=args, data=data):
                        with single_rank_all_reduce():
                            S.compute_advantages_and_returns(args, data)
                        return {k: data[k] for k in ("kl", "advantages", "returns")}

                    cases.append(run_case(run, inp))
    return cases


FAMILIES = {
    "compute_approx_kl": family_approx_kl,
    "compute_policy_loss": family_policy_loss,
    "compute_cispo_loss": family_cispo_loss,
    "compute_gspo_kl": family_gspo_kl,
    "compute_opsm_mask": family_opsm_mask,
    "get_grpo_returns": family_grpo_returns,
    "get_reinforce_plus_plus_returns": family_reinforce_pp_returns,
    "get_reinforce_plus_plus_baseline_advantages": family_reinforce_pp_baseline,
    "get_advantages_and_returns_batch": family_gae,
    "chunked_discounted_returns": family_discounted_returns,
    "vanilla_tis_function": _tis_family("vanilla_tis_function"),
    "icepop_function": _tis_family("icepop_function"),
    "post_process_rewards": family_post_process_rewards,
    "distributed_masked_whiten": family_masked_whiten,
    "compute_advantages_and_returns": family_advantages_and_returns,
}


#: how both objective recorders write tests/golden/objective (record_slime_loss.py reuses it)
OBJECTIVE_FORMAT = dict(commit=SLIME_COMMIT,
                        out_help="output folder (tests/golden/objective)", name_in_header=True,
                        before_family=torch.manual_seed, name_width=44, count_width=4)


def main(argv: list[str] | None = None) -> int:
    return record(argv, description=__doc__.split("\n\n")[0], families=FAMILIES,
                  load_slime=load_slime, generator=GENERATOR, default_seed=DEFAULT_SEED,
                  **OBJECTIVE_FORMAT)


if __name__ == "__main__":
    raise SystemExit(main())
