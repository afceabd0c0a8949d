"""Run slime's own schedule-invariant checker on every registered policy's outputs.

    PYTHONPATH=$PWD python scripts/record_slime_invariants.py --slime /path/to/slime \\
        --out tests/golden/invariants

Two checks, recorded in ``tests/golden/invariants/slime_invariants.json`` (read by
``tests/unit/compat/test_slime_policy_invariants.py``):

1. **slime's checker.** ``assert_invariants`` of slime's ``tests/test_dp_schedule.py``
   (same number of micro-batches on every rank, each rank's micro-batches tile its
   partition, the ranks' partitions disjoint and covering the kept samples, and with
   ``max_per_bin`` every multi-sample micro-batch under the cap) is imported from the
   checkout, not copied, and run on ``varbatch_kit.compat.slime.build_dp_schedule``'s
   output for every registered (packing, distribution) pair (``args.varbatch_packing``,
   ``args.varbatch_distribution``) on seeded random slime inputs: rollouts of 1-3
   samples (interleaved or not), dp 1-4, cp 1-2, vpp 1-2 with mb_group 1-3. The cap is
   checked (``max_per_bin = max_tokens_per_gpu * cp``) for packings that promise it
   (``respects_cap``). A step with fewer samples than the aligned micro-batch count it
   needs is refused by slime and varbatch_kit alike (counted as ``refused``). For the
   five pairs slime itself has, the output is also compared with slime's own
   ``build_dp_schedule`` under the matching flags (``equals_slime``).
2. **install() on slime's real rollout module.** In a subprocess, ``slime.ray.rollout``
   is imported from the checkout with only its third-party imports (ray, sglang, wandb)
   stubbed (``ray.remote`` the identity, ``ray.put`` returning its argument). A
   ``RolloutManager`` (slime's class, built without ``__init__``) replays a dump written
   by slime's ``save_debug_rollout_data`` through slime's ``generate()`` with
   ``--load-debug-rollout-data`` and ``--custom-rollout-log-function-path
   varbatch_kit.compat.slime.slime_hook.log_rollout_data``: slime's ``log_rollout_data``
   imports the hook, which installs ``balanced``, before ``_split_train_data_by_dp``.
   The per-rank data slime packs must equal ``compat.build_dp_schedule`` with
   ``balanced``; after ``uninstall()`` it must equal slime's own schedule again.

Only slime's code runs slime's part; nothing of slime's is copied into the project.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import types
import warnings
from pathlib import Path
from types import SimpleNamespace

from _golden_recorder import checkout_commit

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
GENERATOR = "scripts/record_slime_invariants.py"
CHECKER = "tests/test_dp_schedule.py::assert_invariants"
DEFAULT_SEED = 20261202
MODEL_ARGS = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_query_groups=2,
                  kv_channels=8, ffn_hidden_size=64, vocab_size=32, num_experts=None)
#: slime's own policies: (packing, distribution) -> (use_dynamic_batch_size, balance_data,
#: balance_by_flops)
SLIME_PAIRS = {("static", "strided"): (False, False, False),
               ("static", "flops_kk"): (False, True, False),
               ("first_fit", "strided"): (True, False, False),
               ("first_fit", "flops_kk"): (True, True, False),
               ("flops_kk", "flops_kk"): (True, True, True)}  # slime sets balance_data with it


def registered_policies() -> list[tuple[str, str]]:
    from varbatch_kit.policies.registry import DISTRIBUTIONS, PACKERS

    return [(p, d) for p in sorted(PACKERS) for d in sorted(DISTRIBUTIONS)
            if PACKERS[p].requires_distribution in (None, d)]


def random_case(rng: random.Random, static: bool) -> dict:
    """One slime input, drawn like the property test's strategy."""
    dp, cp = rng.randint(1, 4), rng.randint(1, 2)
    vpp, mb_group = rng.choice([1, 1, 2]), rng.randint(1, 3)
    align = dp * (mb_group if vpp > 1 else 1)
    mbs = rng.randint(1, 3)
    if static:
        gbs = align * mbs * rng.randint(1, 2)
        sizes = [1] * (gbs * rng.randint(1, 3) + rng.randint(0, gbs - 1))
    else:
        gbs = rng.randint(align, align + 4)
        n_roll = gbs * rng.randint(1, 3) + rng.randint(0, 3)
        sizes = [rng.choice([1, 1, 2, 3]) for _ in range(n_roll)]
    rids = [r for r, k in enumerate(sizes) for _ in range(k)]
    if rng.random() < 0.5:
        rng.shuffle(rids)
    ids = rng.sample(range(10_000), len(sizes))
    rids = [ids[r] for r in rids]
    return dict(dp=dp, cp=cp, vpp=vpp, mb_group=mb_group, mbs=mbs, gbs=gbs, rids=rids,
                lengths=[rng.randint(1, 300) for _ in rids], cap=rng.randint(40, 400))


def _args(case: dict, **kw) -> SimpleNamespace:
    return SimpleNamespace(micro_batch_size=case["mbs"], max_tokens_per_gpu=case["cap"],
                           use_dynamic_batch_size=kw.pop("dynamic", True),
                           balance_data=kw.pop("balance_data", False),
                           balance_by_flops=kw.pop("balance_by_flops", False), **MODEL_ARGS, **kw)


def _tpc(case: dict) -> dict:
    return dict(dp_size=case["dp"], cp_size=case["cp"], vpp_size=case["vpp"],
                microbatch_group_size_per_vp_stage=case["mb_group"])


def check_policies(slime_root: Path, seed: int, n_cases: int) -> list[dict]:
    """Part 1: slime's ``assert_invariants`` on every policy's outputs."""
    from record_slime_golden import load_slime

    from varbatch_kit.compat.slime import SlimeCompatError, build_dp_schedule
    from varbatch_kit.policies.registry import PACKERS

    S = load_slime(slime_root)
    spec = importlib.util.spec_from_file_location(
        "slime_test_dp_schedule", slime_root / "tests" / "test_dp_schedule.py")
    checker_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker_mod)
    assert_invariants = checker_mod.assert_invariants
    rows = []
    for i, (packing, distribution) in enumerate(registered_policies()):
        rng = random.Random(seed * 100 + i)
        respects_cap = PACKERS[packing].respects_cap
        row = dict(packing=packing, distribution=distribution, cases=n_cases, checked=0,
                   passed=0, failed=0, refused=0, cap_checked=respects_cap,
                   equals_slime=0 if (packing, distribution) in SLIME_PAIRS else None)
        for _ in range(n_cases):
            case = random_case(rng, static=not PACKERS[packing].dynamic)
            args = _args(case, dynamic=PACKERS[packing].dynamic, varbatch_packing=packing,
                         varbatch_distribution=distribution)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    out = build_dp_schedule(args, _tpc(case), case["lengths"],
                                            global_batch_size=case["gbs"],
                                            rollout_indices=case["rids"])
            except SlimeCompatError as e:
                if not str(e).startswith("dynamic path: could only produce"):
                    raise
                row["refused"] += 1
                continue
            order = list(dict.fromkeys(case["rids"]))
            kept_ids = set(order[:len(order) // case["gbs"] * case["gbs"]])
            kept = [j for j, r in enumerate(case["rids"]) if r in kept_ids]
            row["checked"] += 1
            try:
                assert_invariants(out[0], out[1], out[2], dp_size=case["dp"],
                                  expected_global_sample_indices=kept,
                                  total_lengths=case["lengths"],
                                  max_per_bin=case["cap"] * case["cp"] if respects_cap else None)
                row["passed"] += 1
            except AssertionError as e:
                row["failed"] += 1
                print(f"FAILED {packing}/{distribution}: {e}", file=sys.stderr)
            if row["equals_slime"] is not None:
                dyn, bal, byf = SLIME_PAIRS[(packing, distribution)]
                theirs = S.dp.build_dp_schedule(
                    _args(case, dynamic=dyn, balance_data=bal, balance_by_flops=byf),
                    _tpc(case), list(case["lengths"]), global_batch_size=case["gbs"],
                    rollout_indices=list(case["rids"]))
                row["equals_slime"] += int(list(map(list, theirs)) == list(map(list, out)))
        print(f"{packing:10s} {distribution:9s} checked {row['checked']:4d} passed "
              f"{row['passed']:4d} refused {row['refused']:3d} equals_slime {row['equals_slime']}")
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- part 2


class _Any:
    """Whatever a stubbed third-party name is: callable, with any attribute."""

    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Any()

    def __getattr__(self, name):
        return _Any()


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    roots = ("ray", "sglang", "wandb")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        if spec.name == "ray":
            mod.remote = lambda cls=None, **kw: cls if cls is not None else (lambda c: c)
            mod.put = lambda obj, **kw: obj
            mod.get = lambda obj, **kw: obj
        return mod

    def exec_module(self, module):
        pass


def install_check(slime_root: Path) -> dict:
    """Part 2 (run in its own process): install() through slime's real rollout module."""
    sys.path.insert(0, str(slime_root))
    sys.meta_path.insert(0, _StubFinder())
    os.environ["VARBATCH_KIT_PACKING"] = "balanced"
    rollout = importlib.import_module("slime.ray.rollout")
    from slime.observability.rollout_data_utils import save_debug_rollout_data
    from slime.utils.types import Sample

    from varbatch_kit.compat import slime as compat

    rng = random.Random(7)
    samples, lengths, rids = [], [], []
    for r in range(16):  # 16 rollouts, some compact (several samples of one rollout)
        for _ in range(rng.choice([1, 1, 2, 3])):
            n_prompt, n_resp = rng.randint(4, 40), rng.randint(1, 200)
            samples.append(Sample(index=len(samples), rollout_id=r,
                                  tokens=list(range(n_prompt + n_resp)),
                                  response_length=n_resp, reward=rng.random(),
                                  status=Sample.Status.COMPLETED))
            lengths.append(n_prompt + n_resp)
            rids.append(r)
    tmp = Path(tempfile.mkdtemp(prefix="slime_check_"))
    save_debug_rollout_data(str(tmp / "rollout_{rollout_id}.pt"), samples, rollout_id=0,
                            evaluation=False)
    args = SimpleNamespace(
        load_debug_rollout_data=str(tmp / "rollout_{rollout_id}.pt"),
        load_debug_rollout_data_subsample=None, save_debug_rollout_data=None,
        custom_rollout_log_function_path="varbatch_kit.compat.slime.slime_hook.log_rollout_data",
        debug_rollout_only=False, ci_test=False, use_fault_tolerance=False,
        advantage_estimator="grpo", rewards_normalization=False, reward_key=None,
        n_samples_per_prompt=1, rollout_batch_size=16, global_batch_size=8,
        use_dynamic_batch_size=True, max_tokens_per_gpu=300, micro_batch_size=1,
        balance_data=False, balance_by_flops=False, **MODEL_ARGS)
    tpc = dict(dp_size=2, cp_size=1, vpp_size=1, microbatch_group_size_per_vp_stage=1)
    manager = object.__new__(rollout.RolloutManager)
    manager.args, manager.train_parallel_config = args, tpc
    manager._health_monitors, manager.custom_convert_samples_to_train_data_func = [], None
    manager.custom_reward_post_process_func = None
    before = compat.installed_policy()

    def schedule_from(boxes):
        per_rank = [b.inner for b in boxes]
        return ([list(d["partition"]) for d in per_rank],
                [list(map(list, d["micro_batch_indices"])) for d in per_rank],
                list(per_rank[0]["num_microbatches"]), list(per_rank[0]["global_batch_sizes"]))

    patched = schedule_from(manager.generate(0))  # imports the hook: install("balanced")
    installed = compat.installed_policy()
    balanced_args = SimpleNamespace(**vars(args), varbatch_packing="balanced")
    want = compat.build_dp_schedule(balanced_args, tpc, lengths, global_batch_size=8,
                                    rollout_indices=rids)
    sys.modules["varbatch_kit.compat.slime.slime_hook"].uninstall()
    restored = schedule_from(manager.generate(0))
    slimes = importlib.import_module("slime.utils.dp_schedule").build_dp_schedule(
        args, tpc, lengths, global_batch_size=8, rollout_indices=rids)
    return dict(
        module="slime.ray.rollout", attribute="build_dp_schedule",
        flag="--custom-rollout-log-function-path "
             "varbatch_kit.compat.slime.slime_hook.log_rollout_data",
        path="RolloutManager.generate -> log_rollout_data (imports the hook) -> "
             "_split_train_data_by_dp -> build_dp_schedule",
        samples=len(lengths), rollouts=16, dp=2, global_batch_size=8,
        installed_before=before, installed_after_first_rollout=list(installed or ()),
        patched_equals_compat=patched == tuple(want),
        patched_differs_from_slime=patched != tuple(map(list, slimes)),
        restored_equals_slime=restored == tuple(map(list, slimes)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slime", type=Path, required=True, help="slime checkout (holds slime/)")
    p.add_argument("--out", type=Path, required=True, help="folder of slime_invariants.json")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--cases", type=int, default=300, help="random inputs per policy")
    p.add_argument("--commit", default=SLIME_COMMIT)
    p.add_argument("--install-check-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    root = a.slime.resolve()
    if a.install_check_only:
        print(json.dumps(install_check(root)))
        return 0
    found = checkout_commit(root)
    if found is not None and found != a.commit:
        raise SystemExit(f"{root} is at {found}, not {a.commit}; pass --commit {found}")
    rows = check_policies(root, a.seed, a.cases)
    proc = subprocess.run([sys.executable, __file__, "--slime", str(root), "--out", str(a.out),
                           "--install-check-only"], capture_output=True, text=True, check=True)
    check = json.loads(proc.stdout.strip().splitlines()[-1])
    print("install check:", check)
    record = dict(slime_commit=a.commit, generator=GENERATOR, checker=CHECKER, seed=a.seed,
                  command=f"PYTHONPATH=$PWD python {GENERATOR} --slime SLIME_CHECKOUT --out "
                          f"{a.out} --seed {a.seed} --cases {a.cases}",
                  policies=rows, install_check=check)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "slime_invariants.json").write_text(json.dumps(record, indent=1) + "\n")
    failed = sum(r["failed"] for r in rows)
    ok = not failed and check["patched_equals_compat"] and check["restored_equals_slime"]
    print(f"{sum(r['checked'] for r in rows)} schedules checked, {failed} failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
