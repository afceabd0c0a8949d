"""Record golden vectors by running slime's own scheduling and reporting code.

    python scripts/record_slime_golden.py --slime /path/to/slime/checkout --out tests/golden

The checkout (THUDM/slime; the folder that holds ``slime/``) is imported, not
copied: this script builds seeded random inputs, calls slime's functions on
them and writes what they return (or the assertion they raise) as JSON, one
file per function family. ``tests/test_golden_slime.py`` replays every vector
against varbatch_kit.

Only the modules the vectors need are loaded. The ``slime`` package roots are
registered as bare namespace packages (their ``__init__`` would import the
accelerator stack), and the few heavy leaf imports of the metric module
(wandb logging, the timer, the rollout types) are stubbed. CP-dependent
functions read ``megatron.core.mpu``; the script sets its context-parallel
rank and size per case. ``torch.distributed`` collectives are replaced the
way slime's own single-process tests do: the virtual ranks' vectors are
summed beforehand and ``all_reduce`` is a no-op; ``gather_object`` hands the
per-rank dicts to the source rank.

File layout::

    {"slime_commit": ..., "generator": "scripts/record_slime_golden.py", "seed": ...,
     "cases": [{"inputs": {...}, "output": ...} | {"inputs": {...},
               "error": {"type": "AssertionError", "message": "..."}}]}

Floats are written with ``repr`` (exact round trip); integers stay integers.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace

from _golden_recorder import record

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
GENERATOR = "scripts/record_slime_golden.py"
DEFAULT_SEED = 20260503

# --------------------------------------------------------------------------- loading slime


def load_slime(root: Path) -> SimpleNamespace:
    """Import the slime modules the vectors need from the checkout at ``root``."""
    root = root.resolve()
    if not (root / "slime" / "utils" / "dp_schedule.py").is_file():
        raise SystemExit(f"{root} is not a slime checkout (no slime/utils/dp_schedule.py)")
    sys.path.insert(0, str(root))
    for pkg in ("slime", "slime.utils", "slime.backends", "slime.backends.megatron_utils",
                "slime.observability"):
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(root.joinpath(*pkg.split(".")))]
        sys.modules[pkg] = mod
        if "." in pkg:
            parent, _, name = pkg.rpartition(".")
            setattr(sys.modules[parent], name, mod)

    def stub(name: str, **attrs) -> None:
        mod = types.ModuleType(name)
        for k, v in attrs.items():
            setattr(mod, k, v)
        sys.modules[name] = mod
        parent, _, leaf = name.rpartition(".")
        setattr(sys.modules[parent], leaf, mod)

    class _Timer:  # the metric module only imports it
        pass

    stub("slime.observability.logging_utils")
    stub("slime.observability.timer", Timer=_Timer)
    stub("slime.utils.types", RolloutBatch=dict)

    return SimpleNamespace(
        seqlen=importlib.import_module("slime.utils.seqlen_balancing"),
        flops=importlib.import_module("slime.utils.flops_utils"),
        dp=importlib.import_module("slime.utils.dp_schedule"),
        cp=importlib.import_module("slime.backends.megatron_utils.cp_utils"),
        metrics=importlib.import_module("slime.observability.train_metric_utils"),
    )


@contextlib.contextmanager
def patched(obj, **attrs):
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def run_case(fn, inputs: dict) -> dict:
    """``{"inputs", "output"}`` or ``{"inputs", "error"}`` for one call."""
    try:
        out = fn()
    except AssertionError as e:
        return {"inputs": inputs, "error": {"type": type(e).__name__, "message": str(e)}}
    return {"inputs": inputs, "output": out}


# --------------------------------------------------------------------------- value generators


def flops_like(rng: random.Random, lengths: list[int]) -> list[float]:
    """FLOPs-shaped weights ``c1*L + c2*L^2`` (floats; repeated lengths give tied weights)."""
    c1 = rng.choice([1.6e10, 4.4e9, 123456789.0, 7.3e8])
    c2 = rng.choice([4.4e5, 65536.0, 3.3e4, 1234.5])
    return [c1 * L + c2 * L * L for L in lengths]


def kk_values(rng: random.Random, n: int, kind: str) -> list:
    if kind == "ties_small":
        hi = rng.choice([0, 1, 2, 3, 6])
        return [rng.randint(0, hi) for _ in range(n)]
    if kind == "ties_pool":
        pool = rng.sample(range(1, 5000), rng.randint(1, 5))
        return [rng.choice(pool) for _ in range(n)]
    if kind == "distinct_int":
        return rng.sample(range(1, 10**6), n)
    if kind == "int_wide":
        return [rng.randint(1, 32768) for _ in range(n)]
    if kind == "float":
        return [rng.uniform(0.0, 1e4) for _ in range(n)]
    if kind == "float_ties":
        pool = [rng.choice([1e13, 2e13, 3.5e13, 0.5, 2.25, 1e-3]) for _ in range(3)]
        return [rng.choice(pool) for _ in range(n)]
    if kind == "flops":
        pool = [rng.randint(1, 4000) for _ in range(max(1, n // rng.choice([1, 2, 4, 8])))]
        return flops_like(rng, [rng.choice(pool) for _ in range(n)])
    if kind == "float_rounding":  # set sums round: the order of the additions shows
        r = rng.random()
        if r < 0.6:  # tenths (0.30000000000000004, ...)
            return [rng.randint(1, 5) * 0.1 for _ in range(n)]
        if r < 0.8:
            pool = [rng.choice([2.0**52, 2.0**52 + 2, 3.0, 1.0, 0.5]) for _ in range(4)]
        else:
            pool = [rng.choice([1e13, 2e13, 3.5e13, 0.001, 0.1, 0.3]) for _ in range(4)]
        return [rng.choice(pool) for _ in range(n)]
    if kind == "float_integral_big":  # integral floats whose sums pass 2**53 and round
        pool = [float(rng.choice([2**52 - 1, 2**52 - 3, 2**51 + 1, 1, 3, 5])) for _ in range(4)]
        return [rng.choice(pool) for _ in range(n)]
    if kind == "float_integral":
        return [float(rng.randint(0, 20)) for _ in range(n)]
    if kind == "mixed":
        return [rng.randint(0, 9) if rng.random() < 0.5 else rng.choice([0.5, 2.0, 3.0, 7.25])
                for _ in range(n)]
    raise ValueError(kind)


KK_KINDS = ["ties_small", "ties_pool", "distinct_int", "int_wide", "float", "float_ties",
            "float_rounding", "flops", "float_integral", "mixed"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --------------------------------------------------------------------------- families


def family_kk(S, rng: random.Random) -> list[dict]:
    cases = []

    def add(fn_name: str, values: list, k: int, equal_size: bool, kind: str) -> None:
        fn = getattr(S.seqlen, fn_name)
        inputs = {"fn": fn_name, "kind": kind, "values": values, "k_partitions": k,
                  "equal_size": equal_size}
        cases.append(run_case(lambda: fn(list(values), k, equal_size), inputs))

    for _ in range(1900):
        kind = rng.choice(KK_KINDS)
        n = rng.choice([rng.randint(1, 8), rng.randint(1, 24), rng.randint(1, 64)])
        values = kk_values(rng, n, kind)
        equal_size = rng.random() < 0.45
        if equal_size:
            k = rng.choice(divisors(n)) if rng.random() < 0.9 else rng.randint(1, n + 2)
        else:
            r = rng.random()
            k = (rng.randint(1, min(n, 4)) if r < 0.35 else rng.randint(1, n) if r < 0.95
                 else rng.randint(n + 1, n + 3))
        fn_name = "karmarkar_karp" if rng.random() < 0.5 else "get_seqlen_balanced_partitions"
        add(fn_name, values, k, equal_size, kind)
    for _ in range(500):  # sums beyond 2**53: rarely, the order of the additions shows
        n = rng.randint(3, 30)
        values = kk_values(rng, n, "float_integral_big")
        add(rng.choice(["karmarkar_karp", "get_seqlen_balanced_partitions"]), values,
            rng.randint(2, max(2, n // 2)), False, "float_integral_big")
    for _ in range(12):  # a few large inputs
        kind = rng.choice(["ties_pool", "flops", "int_wide", "float", "ties_small",
                           "float_rounding"])
        n = rng.choice([480, 500, 512, 600])
        values = kk_values(rng, n, kind)
        equal_size = rng.random() < 0.5
        k = rng.choice([d for d in divisors(n) if d <= 120]) if equal_size else rng.randint(2, 120)
        for fn_name in ("karmarkar_karp", "get_seqlen_balanced_partitions"):
            add(fn_name, values, k, equal_size, kind)
    return cases


def random_lengths(rng: random.Random, n: int) -> list[int]:
    mode = rng.random()
    if mode < 0.25:
        pool = [rng.randint(1, 3000) for _ in range(rng.randint(1, 4))]
        return [rng.choice(pool) for _ in range(n)]
    if mode < 0.5:
        return [rng.randint(1, 120) for _ in range(n)]
    if mode < 0.8:
        return [max(1, min(40000, int(rng.lognormvariate(7.0, 1.0)))) for _ in range(n)]
    return [rng.randint(1, 5000) for _ in range(n)]


def family_first_fit(S, rng: random.Random) -> list[dict]:
    cases = []
    for t in range(700):
        n = 0 if t < 3 else rng.choice([rng.randint(1, 10), rng.randint(1, 60),
                                         rng.randint(1, 200)])
        lengths = random_lengths(rng, n)
        top = max(lengths, default=10)
        cap = rng.choice([top, top + rng.randint(0, top), max(1, top // rng.randint(1, 4)),
                          rng.randint(1, 2 * top), sum(lengths) or 1])
        inputs = {"total_lengths": lengths, "max_tokens_per_bin": cap}
        cases.append(run_case(
            lambda lengths=lengths, cap=cap: S.seqlen.first_fit_pack(lengths, cap), inputs))
    return cases


def random_bins(rng: random.Random, n: int) -> list[list[int]]:
    idx = list(range(n))
    if rng.random() < 0.5:
        rng.shuffle(idx)
    bins, i = [], 0
    while i < n:
        size = rng.choice([1, 1, 2, 3, rng.randint(1, max(1, n // 2))])
        bins.append(idx[i:i + size])
        i += size
    rng.shuffle(bins)
    return bins


def family_expand_bins(S, rng: random.Random) -> list[dict]:
    cases = []
    for _ in range(700):
        n = rng.choice([rng.randint(1, 8), rng.randint(1, 40), rng.randint(1, 120)])
        lengths = random_lengths(rng, n)
        if rng.random() < 0.5:
            cap = rng.randint(1, max(1, 2 * max(lengths)))
            bins = S.seqlen.first_fit_pack(lengths, cap)
        else:
            bins = random_bins(rng, n)
        r = rng.random()
        if r < 0.1:
            target = rng.randint(0, len(bins))  # already enough bins
        elif r < 0.75:
            target = rng.randint(len(bins), n)  # reachable
        else:
            target = rng.randint(n + 1, n + 6)  # stops early: only singletons left
        before = copy.deepcopy(bins)
        inputs = {"bins": before, "target_count": target, "lengths": lengths}

        def call(bins=bins, target=target, lengths=lengths):
            ret = S.seqlen.expand_bins_by_splitting(bins, target, lengths)
            assert ret is None
            return bins

        cases.append(run_case(call, inputs))
    return cases


MODEL_BASES = [
    # slime's own test model
    dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_query_groups=2, kv_channels=8,
         ffn_hidden_size=64, vocab_size=32),
    # Qwen3-8B-like (GQA)
    dict(num_layers=36, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
         kv_channels=128, ffn_hidden_size=12288, vocab_size=151936),
    # Qwen2.5-0.5B-like
    dict(num_layers=24, hidden_size=896, num_attention_heads=14, num_query_groups=2,
         kv_channels=64, ffn_hidden_size=4864, vocab_size=151936),
    # Llama-70B-like
    dict(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
         kv_channels=128, ffn_hidden_size=28672, vocab_size=128256),
]


def random_model_args(rng: random.Random) -> dict:
    if rng.random() < 0.35:
        args = dict(rng.choice(MODEL_BASES))
    else:
        heads = rng.choice([1, 2, 8, 14, 32, 64, 128, rng.randint(1, 160)])
        hidden = rng.choice([16, 896, 2048, 4096, 7168, 8192, rng.randint(8, 20000)])
        args = dict(
            num_layers=rng.choice([1, 2, 24, 48, 61, 94, rng.randint(1, 128)]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=rng.choice([heads, 1, 2, 4, 8, rng.randint(1, heads)]),
            kv_channels=rng.choice([max(1, hidden // heads), 64, 128, rng.randint(1, 256)]),
            ffn_hidden_size=rng.choice([4 * hidden, 3 * hidden, 11008, rng.randint(8, 60000)]),
            vocab_size=rng.choice([32, 32000, 151936, 129280, rng.randint(2, 300000)]),
        )
    args["num_experts"] = None
    return args


def add_moe(rng: random.Random, args: dict) -> str:
    """Turn ``args`` into an MoE model; returns a label of the variant."""
    args["num_experts"] = rng.choice([8, 64, 128, 256])
    args["moe_ffn_hidden_size"] = rng.choice([512, 768, 1408, 2048, rng.randint(8, 4096)])
    args["moe_router_topk"] = rng.choice([1, 2, 6, 8])
    shared = rng.random()
    if shared < 0.35:
        args["moe_shared_expert_intermediate_size"] = rng.choice([1408, 2816, 2048])
    elif shared < 0.55:
        args["moe_shared_expert_intermediate_size"] = None
    # else: attribute absent
    freq = rng.random()
    n = args["num_layers"]
    if freq < 0.3:
        return "moe_no_freq"
    if freq < 0.6:
        args["moe_layer_freq"] = rng.choice([1, 2, 3, rng.randint(1, n + 2)])
        return "moe_int_freq"
    if freq < 0.85:
        lst = [int(rng.random() < 0.7) for _ in range(n)]
        if rng.random() < 0.3:  # DeepSeek-style: the first layers dense
            first = min(n, rng.randint(1, 3))
            lst = [0] * first + [1] * (n - first)
        args["moe_layer_freq"] = lst
        return "moe_list_freq"
    args["moe_layer_freq"] = [rng.choice([0, 1, 2, 3]) for _ in range(n)]
    return "moe_list_freq_gt1"


def add_mla(rng: random.Random, args: dict) -> str:
    args["multi_latent_attention"] = True
    args["q_lora_rank"] = rng.choice([None, 1536, rng.randint(16, 2048)])
    args["kv_lora_rank"] = rng.choice([None, 512, rng.randint(16, 1024)])
    args["qk_head_dim"] = rng.choice([128, 192, rng.randint(8, 256)])
    args["qk_pos_emb_head_dim"] = rng.choice([64, 32, rng.randint(1, 128)])
    args["v_head_dim"] = rng.choice([128, rng.randint(8, 256)])
    return f"mla_q{'set' if args['q_lora_rank'] else 'none'}_kv" \
           f"{'set' if args['kv_lora_rank'] else 'none'}"


def random_flops_args(rng: random.Random) -> tuple[dict, str]:
    args = random_model_args(rng)
    labels = []
    if args["num_query_groups"] != args["num_attention_heads"]:
        labels.append("gqa")
    if rng.random() < 0.5:
        labels.append(add_moe(rng, args))
    if rng.random() < 0.3:
        labels.append(add_mla(rng, args))
    elif rng.random() < 0.1:
        args["multi_latent_attention"] = False
        labels.append("mla_false")
    return args, "+".join(labels) or "dense"


def family_flops(S, rng: random.Random) -> list[dict]:
    cases = []
    for _ in range(800):
        args, label = random_flops_args(rng)
        count = 1 if rng.random() < 0.5 else rng.randint(2, 8)
        seqlens = [rng.choice([1, 2, 7, 100, 1000, 4096, 32768, 131072, 10**6,
                               rng.randint(1, 200000), rng.randint(1, 5000)])
                   for _ in range(count)]
        inputs = {"variant": label, "args": args, "seqlens": seqlens}
        ns = SimpleNamespace(**args)

        def call(ns=ns, seqlens=seqlens):
            out = S.flops.calculate_fwd_flops(list(seqlens), ns)
            assert isinstance(out, float), type(out)
            return out

        cases.append(run_case(call, inputs))
    return cases


def random_rollout_batch(rng: random.Random, n_roll: int, multi: bool, interleave: bool
                         ) -> tuple[list[int], list[int]]:
    counts = [rng.choice([1, 1, 2, 3, 4]) if multi else 1 for _ in range(n_roll)]
    labels = rng.sample(range(0, 10 * n_roll + 10), n_roll) if rng.random() < 0.6 else \
        list(range(n_roll))
    rid = [labels[r] for r in range(n_roll) for _ in range(counts[r])]
    if interleave:
        rng.shuffle(rid)
    lengths = random_lengths(rng, len(rid))
    return lengths, rid


def family_dp_schedule(S, rng: random.Random) -> list[dict]:
    cases = []
    for _ in range(1100):
        multi = rng.random() < 0.45
        interleave = multi and rng.random() < 0.5
        dynamic = rng.random() < 0.65
        by_flops = dynamic and rng.random() < 0.35
        balance = by_flops or rng.random() < 0.4
        dp = rng.choice([1, 1, 2, 2, 3, 4, 8])
        cp = rng.choice([1, 1, 2, 4])
        vpp = rng.choice([1, 1, 2, 3])
        mb_group = rng.choice([1, 2, 3]) if vpp > 1 else rng.choice([1, 1, 2])
        align = dp * (mb_group if vpp > 1 else 1)
        mbs = rng.choice([1, 1, 2, 3, 4])
        r = rng.random()
        if not dynamic and r < 0.7:  # a layout whose static steps align (one-sample rollouts)
            multi = interleave = False
            gbs = mbs * align * rng.randint(1, 3)
        elif r < 0.85:  # enough samples per step to reach the alignment
            gbs = rng.randint(max(1, align), max(1, align) + rng.choice([0, 2, 8, 20]))
        else:  # anything, including steps too small for dp or the alignment
            gbs = rng.randint(1, max(2, 2 * align))
        gbs = min(gbs, 60)
        n_steps = rng.choice([1, 1, 2, 3])
        n_roll = gbs * n_steps + (rng.randint(1, gbs) - 1 if rng.random() < 0.4 else 0)
        if rng.random() < 0.06:
            n_roll = rng.randint(1, gbs)  # num_rollouts < global_batch_size (or just enough)
        while n_roll * (2.5 if multi else 1) > 320 and gbs > 1:
            gbs = max(1, gbs // 2)
            n_roll = gbs * n_steps
        lengths, rid = random_rollout_batch(rng, n_roll, multi, interleave)
        model = random_model_args(rng)
        if rng.random() < 0.2:
            add_moe(rng, model)
        args = dict(model)
        top = max(lengths)
        if dynamic:
            mtpg = rng.choice([max(1, top // cp), max(1, top // (2 * cp)), 2 * top,
                               rng.randint(1, 8000), 4096, 16384])
            args.update(use_dynamic_batch_size=True, max_tokens_per_gpu=mtpg,
                        micro_batch_size=rng.choice([1, 2]))
        else:
            args.update(use_dynamic_batch_size=False, max_tokens_per_gpu=None,
                        micro_batch_size=mbs)
        # slime's argument validation: --balance-by-flops requires dynamic and sets balance_data
        args.update(balance_data=balance, balance_by_flops=by_flops)
        tpc = {"dp_size": dp, "cp_size": cp, "vpp_size": vpp,
               "microbatch_group_size_per_vp_stage": mb_group}
        scenario = ("static" if not dynamic else "by_flops" if by_flops else "first_fit") + \
            ("+balance" if balance and not by_flops else "") + ("+multi" if multi else "") + \
            ("+interleaved" if interleave else "") + (f"+vpp{vpp}x{mb_group}" if vpp > 1 else "") \
            + (f"+cp{cp}" if cp > 1 else "")
        inputs = {"scenario": scenario, "args": args, "train_parallel_config": tpc,
                  "total_lengths": lengths, "global_batch_size": gbs, "rollout_indices": rid}
        ns = SimpleNamespace(**args)

        def call(ns=ns, tpc=tpc, lengths=lengths, gbs=gbs, rid=rid):
            out = S.dp.build_dp_schedule(ns, dict(tpc), list(lengths), global_batch_size=gbs,
                                         rollout_indices=list(rid))
            return [list(x) for x in out]

        cases.append(run_case(call, inputs))
    # hand-picked edge cases: static aligned/misaligned, oversize, splitting stalls
    extra = [
        (dict(use_dynamic_batch_size=False, micro_batch_size=2), dict(dp_size=4), [10] * 16,
         16, list(range(16))),
        (dict(use_dynamic_batch_size=False, micro_batch_size=1), dict(dp_size=4), [5] * 6, 6,
         list(range(6))),
        (dict(use_dynamic_batch_size=True, max_tokens_per_gpu=10), dict(dp_size=2),
         [15, 3, 3, 3, 3, 3, 3, 3], 8, list(range(8))),
        (dict(use_dynamic_batch_size=True, max_tokens_per_gpu=100),
         dict(dp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2), [10] * 7, 1,
         [0, 0, 0, 0, 1, 1, 1]),
        (dict(use_dynamic_batch_size=True, max_tokens_per_gpu=12), dict(dp_size=1), [3] * 6, 4,
         [0, 0, 1, 1, 2, 2]),
        (dict(use_dynamic_batch_size=True, max_tokens_per_gpu=10), dict(dp_size=4), [5, 5], 2,
         [0, 1]),
        (dict(use_dynamic_batch_size=True, max_tokens_per_gpu=10, balance_by_flops=True,
              balance_data=True), dict(dp_size=2), [4, 4, 4, 4, 4, 4, 4, 4, 4, 4], 10,
         list(range(10))),
        # the first failing step decides the error: step 0 cannot be aligned, step 1 is too
        # small for dp (slime checks step by step)
        (dict(use_dynamic_batch_size=True, max_tokens_per_gpu=100),
         dict(dp_size=2, vpp_size=2, microbatch_group_size_per_vp_stage=2), [10, 10, 10, 10], 1,
         [0, 0, 0, 1]),
        (dict(use_dynamic_batch_size=False, micro_batch_size=1), dict(dp_size=2), [5, 5, 5, 5],
         1, [0, 0, 0, 1]),
        (dict(use_dynamic_batch_size=False, micro_batch_size=2), dict(dp_size=2),
         [5, 5, 5, 5, 5, 5, 5], 1, [7, 7, 7, 7, 3, 3, 9]),
    ]
    for a, tp, lengths, gbs, rid in extra:
        args = dict(MODEL_BASES[0], num_experts=None, micro_batch_size=1,
                    use_dynamic_batch_size=False, max_tokens_per_gpu=None, balance_data=False,
                    balance_by_flops=False)
        args.update(a)
        tpc = {"dp_size": 1, "cp_size": 1, "vpp_size": 1,
               "microbatch_group_size_per_vp_stage": 1}
        tpc.update(tp)
        inputs = {"scenario": "hand", "args": args, "train_parallel_config": tpc,
                  "total_lengths": lengths, "global_batch_size": gbs, "rollout_indices": rid}
        ns = SimpleNamespace(**args)
        cases.append(run_case(
            lambda ns=ns, tpc=tpc, lengths=lengths, gbs=gbs, rid=rid: [list(x) for x in
                S.dp.build_dp_schedule(ns, dict(tpc), list(lengths), global_batch_size=gbs,
                                       rollout_indices=list(rid))], inputs))
    return cases


def family_cp_offsets(S, rng: random.Random) -> list[dict]:
    cases = []
    mpu = S.cp.mpu
    seen = set()
    combos = []
    for total in range(1, 41):  # every small case with cp 2..4
        for resp in range(0, total):
            for cp in (2, 3, 4):
                combos.append((total, resp, cp))
    rng.shuffle(combos)
    combos = combos[:700]
    for _ in range(260):
        total = rng.choice([rng.randint(1, 300), rng.randint(1, 5000), rng.randint(1, 200000)])
        resp = rng.choice([0, total - 1, rng.randint(0, total - 1), min(total - 1, 1)])
        combos.append((total, resp, rng.choice([2, 3, 4, 5, 8, 16])))
    for total, resp, cp in combos:
        if (total, resp, cp) in seen:
            continue
        seen.add((total, resp, cp))
        for rank in range(cp):
            inputs = {"total_length": total, "response_length": resp, "cp_rank": rank,
                      "cp_size": cp}
            with patched(mpu, get_context_parallel_rank=lambda r=rank: r,
                         get_context_parallel_world_size=lambda c=cp: c):
                case = run_case(lambda t=total, r=resp: json.loads(json.dumps(
                    S.cp.get_logits_and_tokens_offset_with_cp(t, r))), inputs)
            cases.append(case)
    return cases


def family_reducers(S, rng: random.Random) -> list[dict]:
    import torch

    cases = []
    mpu = S.cp.mpu
    for _ in range(600):
        n = rng.randint(1, 6)
        resp = [rng.choice([0, 1, 2, 3, rng.randint(1, 12), rng.randint(1, 40)])
                for _ in range(n)]
        prompt = [rng.choice([1, 2, 4, rng.randint(1, 30)]) for _ in range(n)]
        total = [p + r for p, r in zip(prompt, resp)]
        p_one = rng.choice([0.0, 0.3, 0.8, 1.0])
        masks = [[int(rng.random() < p_one) if p_one < 1 else 1 for _ in range(r)] for r in resp]
        mask_dtype = rng.choice(["float64", "float64", "int64"])
        cp = rng.choice([1, 1, 2, 3, 4])
        rank = rng.randrange(cp)
        per_token = rng.random() < 0.35
        d = rng.random()
        if d < 0.35:
            denoms = None
        elif d < 0.75:  # per-rollout mask totals
            groups = [rng.randrange(max(1, n // 2)) for _ in range(n)]
            sums = {}
            for g, m in zip(groups, masks):
                sums[g] = sums.get(g, 0) + sum(m)
            denoms = [float(sums[g]) for g in groups]
        else:
            denoms = [rng.choice([0.0, 0.5, rng.uniform(0, 50), float(rng.randint(0, 60))])
                      for _ in range(n)]
        torch_masks = [torch.tensor(m, dtype=getattr(torch, mask_dtype)) for m in masks]
        with patched(mpu, get_context_parallel_rank=lambda r=rank: r,
                     get_context_parallel_world_size=lambda c=cp: c):
            if cp == 1:
                local = resp
            else:
                local = []
                for t, r in zip(total, resp):
                    _, _, _, tok = S.cp.get_logits_and_tokens_offset_with_cp(t, r)
                    local.append((tok[0][1] - tok[0][0]) + (tok[1][1] - tok[1][0]))
            x = [rng.uniform(-10, 10) if rng.random() < 0.8 else float(rng.randint(-5, 5))
                 for _ in range(sum(local))]
            inputs = {"total_lengths": total, "response_lengths": resp, "loss_masks": masks,
                      "mask_dtype": mask_dtype, "sample_denoms": denoms,
                      "calculate_per_token_loss": per_token, "cp_rank": rank, "cp_size": cp,
                      "x": x}

            def call(total=total, resp=resp, torch_masks=torch_masks, denoms=denoms,
                     per_token=per_token, x=x):
                den = None if denoms is None else torch.tensor(denoms, dtype=torch.float64)
                reducer = S.cp.get_sum_of_sample_mean(list(total), list(resp), torch_masks, den,
                                                      calculate_per_token_loss=per_token)
                out = reducer(torch.tensor(x, dtype=torch.float64))
                assert out.dtype == torch.float64
                return float(out.item())

            cases.append(run_case(call, inputs))
    return cases


def family_train_step(S, rng: random.Random) -> list[dict]:
    import torch
    import torch.distributed as dist

    cases = []
    names = ["loss", "pg_loss", "entropy_loss", "kl", "pg_clipfrac", "ppo_kl"]
    with patched(dist, all_reduce=lambda tensor, group=None, op=None: None):
        for _ in range(450):
            keys = rng.sample(names, rng.randint(1, 4))
            per_token = rng.random() < 0.5
            dp = rng.choice([1, 2, 3, 4])
            cp = rng.choice([1, 2, 4, 1, 2, 4, 3])
            n_mb = rng.randint(1, 4)
            gbs = rng.randint(1, 64)
            # virtual rank (d, c) micro-batch j: [slot0, metric sums...]; each CP rank counts
            # its micro-batch's tokens in full (slot0), the metric sums are CP-local
            ranks = []
            for _d in range(dp):
                tokens = [rng.randint(1, 4000) for _ in range(n_mb)]
                for _c in range(cp):
                    ranks.append([[float(tokens[j]) if per_token else 0.0] +
                                  [rng.uniform(-100, 100) if rng.random() < 0.9 else 0.0
                                   for _ in keys] for j in range(n_mb)])
            # pre-sum the virtual ranks (the all-reduce), micro-batch by micro-batch
            summed = []
            for j in range(n_mb):
                v = torch.tensor(ranks[0][j], dtype=torch.float64)
                for rk in ranks[1:]:
                    v = v + torch.tensor(rk[j], dtype=torch.float64)
                summed.append(v.tolist())
            inputs = {"keys": keys, "losses_reduced": [{"keys": keys, "values": v} for v in summed],
                      "calculate_per_token_loss": per_token, "step_global_batch_size": gbs,
                      "cp_size": cp, "dp_size": dp}

            def call(keys=keys, summed=summed, per_token=per_token, gbs=gbs, cp=cp):
                lr = [{"keys": list(keys), "values": torch.tensor(v, dtype=torch.float64)}
                      for v in summed]
                return S.metrics.reduce_train_step_metrics(
                    lr, calculate_per_token_loss=per_token, step_global_batch_size=gbs,
                    cp_size=cp, dp_with_cp_group=object())

            cases.append(run_case(call, inputs))
    return cases


def family_rollout_log(S, rng: random.Random) -> list[dict]:
    import torch.distributed as dist

    cases = []
    for _ in range(300):
        s = rng.choice([0.0, rng.uniform(-50, 50), rng.uniform(0, 1e6), float(rng.randint(0, 9))])
        cp = rng.choice([1, 2, 3, 4, 8])
        nr = rng.randint(1, 128)
        dp = rng.choice([1, 2, 3, 4, 6, 8])
        inputs = {"fn": "rollout_log_metric_contribution", "per_rank_reducer_sum": s,
                  "cp_size": cp, "num_rollouts_in_rollout": nr, "dp_size": dp}
        cases.append(run_case(lambda s=s, cp=cp, nr=nr, dp=dp: list(
            S.metrics.rollout_log_metric_contribution(s, cp_size=cp, num_rollouts_in_rollout=nr,
                                                      dp_size=dp)), inputs))
    for _ in range(300):
        n = rng.choice([1, 2, 3, 4, 8])
        src = 0 if rng.random() < 0.7 else rng.randrange(n)
        pair_keys = rng.sample(["rewards", "response_len", "truncated", "pg_loss", "kl"],
                               rng.randint(0, 3))
        scalar_keys = rng.sample(["lr", "grad_norm", "time", "step"], rng.randint(0 if pair_keys
                                                                              else 1, 2))
        nr = rng.randint(1, 64)
        cpf = rng.choice([1, 2, 4])
        per_rank = []
        for _r in range(n):
            d = {}
            for k in pair_keys:
                if rng.random() < 0.1:
                    d[k] = ["pair", 0.0, 0.0]
                else:
                    d[k] = ["pair", cpf * rng.uniform(-20, 20), nr / n]
            for k in scalar_keys:
                d[k] = ["scalar", rng.uniform(-5, 5) if rng.random() < 0.8 else rng.randint(0, 9)]
            per_rank.append(d)
        zero_keys = [k for k in pair_keys if all(d[k][2] == 0.0 for d in per_rank)]
        for k in zero_keys:  # a zero total count comes with a zero total sum
            for d in per_rank:
                d[k] = ["pair", 0.0, 0.0]
        inputs = {"fn": "gather_and_reduce_log_dict", "per_rank": per_rank, "dp_size": n,
                  "dp_src_rank": src}

        def decode(d):
            return {k: (v[1], v[2]) if v[0] == "pair" else v[1] for k, v in d.items()}

        def call(per_rank=per_rank, n=n, src=src):
            dicts = [decode(d) for d in per_rank]

            def gather_object(obj, object_gather_list=None, dst=0, group=None):
                assert object_gather_list is not None
                object_gather_list[:] = copy.deepcopy(dicts)

            with patched(dist, get_rank=lambda group=None: src, gather_object=gather_object):
                return S.metrics.gather_and_reduce_log_dict(dicts[src], dp_size=n,
                                                            dp_src_rank=src, dp_group=object())

        cases.append(run_case(call, inputs))
    return cases


FAMILIES = {
    "kk": family_kk,
    "first_fit": family_first_fit,
    "expand_bins": family_expand_bins,
    "flops": family_flops,
    "dp_schedule": family_dp_schedule,
    "cp_offsets": family_cp_offsets,
    "reducers": family_reducers,
    "train_step": family_train_step,
    "rollout_log": family_rollout_log,
}


def main(argv: list[str] | None = None) -> int:
    return record(argv, description=__doc__.split("\n\n")[0], families=FAMILIES,
                  load_slime=load_slime, generator=GENERATOR, commit=SLIME_COMMIT,
                  default_seed=DEFAULT_SEED, out_help="output folder (tests/golden)")


if __name__ == "__main__":
    raise SystemExit(main())
