#!/usr/bin/env python
"""Record slime debug rollout dumps and what slime's own trainer makes of them.

Usage::

    python scripts/record_slime_dumps.py --slime /path/to/slime/checkout --out tests/golden/dumps

Imports slime's modules from the checkout given on the command line (nothing of
slime is copied into varbatch_kit) and, for a set of seeded batches:

1. builds the samples with slime's real ``Sample`` class: default rollouts
   (``rollout_id`` None), compact rollouts (several samples sharing an
   explicit ``rollout_id``, some ids small enough to collide with sample
   positions), removed samples, missing and explicit loss masks, every
   status, float / dict / missing rewards, GRPO ``group_index`` and metadata;
2. writes each batch with slime's own ``save_debug_rollout_data`` and reads it
   back with slime's ``load_debug_rollout_data`` (the ``--load-debug-rollout-data``
   path);
3. runs slime's sample -> train-data step (``RolloutManager._convert_samples_to_train_data``
   with ``_post_process_rewards``; advantage estimator without reward
   normalisation, so rewards are raw) and slime's ``build_dp_schedule`` for a
   few configurations (and once through ``_split_train_data_by_dp`` as a
   cross-check);
4. records, per dump, ``<stem>.json`` next to ``<stem>.pt``.

Besides the flat dumps it writes an *old* dump (sample dicts saved before the
``rollout_id`` field existed), *nested* dumps (lists of samples per rollout, as
compact rollout functions return them; slime validates and flattens them with
its own ``_get_rollout_data``) and *unsafe* dumps (pickled ``Sample`` objects
or ``Status`` enums) that a safe reader must refuse.

Heavy imports slime's rollout module pulls in (ray, sglang, wandb, httpx, ...)
are replaced by inert placeholder modules registered in ``sys.modules`` by
this script only.
"""

from __future__ import annotations

import argparse
import copy
import importlib.abc
import importlib.util
import json
import random
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

PINNED_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
GENERATOR = "scripts/record_slime_dumps.py"

# --------------------------------------------------------------------------- stubs
STUB_ROOTS = {
    "ray", "sglang", "sglang_router", "wandb", "httpx", "requests", "urllib3", "tensorboardX",
    "torch_memory_saver", "pybase64", "transformers", "aiohttp", "uvicorn", "fastapi",
}


class _Placeholder:
    """Anything a stubbed module exports: callable, attribute-bearing, usable as a base."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator (e.g. ``@ray.remote``): keep the target
        return _Placeholder(self._name + "()")

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __getitem__(self, key):
        return self

    def __iter__(self):
        return iter(())


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STUB_ROOTS:
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def import_slime(checkout: Path) -> SimpleNamespace:
    for name in list(sys.modules):
        if name.split(".")[0] in STUB_ROOTS:
            del sys.modules[name]
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, str(checkout))
    import slime.ray.rollout as rollout_mod
    from slime.observability import rollout_data_utils
    from slime.utils import dp_schedule
    from slime.utils.types import Sample

    assert Path(rollout_mod.__file__).resolve().is_relative_to(checkout.resolve())
    return SimpleNamespace(
        Sample=Sample,
        rollout_mod=rollout_mod,
        RolloutManager=rollout_mod.RolloutManager,
        save=rollout_data_utils.save_debug_rollout_data,
        load=rollout_data_utils.load_debug_rollout_data,
        build_dp_schedule=dp_schedule.build_dp_schedule,
    )


def slime_commit(checkout: Path, given: str | None) -> str:
    if given:
        return given
    try:
        out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"],
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return PINNED_COMMIT


# --------------------------------------------------------------------------- batches
STATUSES = ["completed"] * 5 + ["truncated"] * 2 + ["aborted", "failed"]
SOURCES = ["math", "code", "swe"]
MASK_KINDS = ["none", "ones", "zeros"]


def _mask(rng: random.Random, n: int, kind: str):
    if kind == "none":
        return None
    if kind == "ones":
        return [1] * n
    mask = [1 if rng.random() < 0.6 else 0 for _ in range(n)]
    if n > 1:  # a tool-output span the policy did not write
        a = rng.randrange(n)
        b = rng.randrange(a, n)
        mask[a:b + 1] = [0] * (b - a + 1)
    return mask


def _reward(rng: random.Random, mode: str):
    if mode == "mixed":
        mode = rng.choice(["float", "dict", "none"])
    if mode == "none":
        return None
    if mode == "dict":
        return {"score": round(rng.uniform(-1, 1), 3), "acc": rng.randint(0, 1),
                "format": round(rng.random(), 2)}
    return round(rng.uniform(-1, 1), 4)


def make_samples(S, spec: dict) -> list[list[list]]:
    """Samples nested as prompt -> rollout -> samples of that rollout."""
    rng = random.Random(spec["seed"])
    index = 0
    next_big = 100 + 100 * spec["seed"]
    prompts = []
    small_ids = list(spec.get("small_ids", []))
    for g in range(spec["prompts"]):
        rollouts = []
        for _ in range(spec["per_prompt"]):
            compact = rng.random() < spec["p_compact"]
            if compact:
                k = rng.randint(1, spec.get("max_siblings", 3))
                if small_ids and rng.random() < 0.7:
                    rid = small_ids.pop(0)
                else:
                    rid, next_big = next_big, next_big + rng.randint(1, 7)
            else:
                k, rid = 1, None
            prompt_len = rng.randint(1, spec.get("max_prompt", 24))
            siblings = []
            for turn in range(k):
                resp = rng.randint(1, spec.get("max_response", 24))
                ptoks = prompt_len + turn * rng.randint(0, 6)  # later turns carry more context
                s = S.Sample(
                    group_index=g,
                    index=index,
                    rollout_id=rid,
                    prompt=f"prompt {g}",
                    tokens=[rng.randrange(32000) for _ in range(ptoks + resp)],
                    response=f"response {index}",
                    response_length=resp,
                    label=str(rng.randint(0, 9)),
                    reward=_reward(rng, spec["reward"]),
                    loss_mask=_mask(rng, resp, rng.choice(spec.get("masks", MASK_KINDS))),
                    remove_sample=rng.random() < spec.get("p_remove", 0.1),
                    status=S.Sample.Status(rng.choice(STATUSES)),
                    metadata={"source_name": rng.choice(SOURCES), "turn": turn},
                )
                if spec.get("metadata_raw_reward") and rng.random() < 0.5:
                    s.metadata["raw_reward"] = round(rng.random(), 3)
                if spec.get("log_probs"):
                    s.rollout_log_probs = [round(-rng.random(), 3) for _ in range(resp)]
                index += 1
                siblings.append(s)
            rollouts.append(siblings)
        prompts.append(rollouts)
    return prompts


def to_dicts(node):
    return [to_dicts(x) for x in node] if isinstance(node, list) else node.to_dict()


def flat(prompts) -> list:
    return [s for rollouts in prompts for sib in rollouts for s in sib]


# --------------------------------------------------------------------------- slime's view
def manager(S, samples) -> SimpleNamespace:
    args = SimpleNamespace(
        advantage_estimator="reinforce",  # not a group-normalised estimator: rewards stay raw
        rewards_normalization=False,
        grpo_std_normalization=False,
        reward_key=None,
        rollout_top_p=1.0,
        use_rollout_routing_replay=False,
        n_samples_per_prompt=1,
        rollout_batch_size=max(1, len(samples)),
        load_debug_rollout_data=None,
        global_batch_size=1,
        rollout_data_transport="object-store",
    )
    self = SimpleNamespace(
        args=args,
        custom_convert_samples_to_train_data_func=None,
        custom_reward_post_process_func=None,
        train_parallel_config=None,
    )
    self._post_process_rewards = types.MethodType(S.RolloutManager._post_process_rewards, self)
    return self


def convert(S, samples) -> dict:
    return S.RolloutManager._convert_samples_to_train_data(manager(S, samples), samples)


def slime_flatten(S, nested) -> list:
    """slime's ``_get_rollout_data`` (rollout_id contract check + flattening) on ``nested``."""
    mod = S.rollout_mod
    saved = mod.call_rollout_fn
    mod.call_rollout_fn = lambda *a, **k: SimpleNamespace(samples=nested, metrics=None)
    try:
        self = manager(S, [])
        self.generate_rollout = None
        self.data_source = None
        data, _ = S.RolloutManager._get_rollout_data(self, rollout_id=0)
    finally:
        mod.call_rollout_fn = saved
    return data


def json_train_data(td: dict) -> dict:
    return {
        "total_lengths": [len(t) for t in td["tokens"]],
        "response_lengths": list(td["response_lengths"]),
        "rollout_ids": list(td["rollout_ids"]),
        "loss_masks": [list(m) for m in td["loss_masks"]],
        "rollout_mask_sums": list(td["rollout_mask_sums"]),
        "truncated": list(td["truncated"]),
        "raw_reward": list(td["raw_reward"]),
        "sample_indices": list(td["sample_indices"]),
    }


def sample_fields(samples) -> list[dict]:
    return [{"index": s.index, "group_index": s.group_index, "rollout_id": s.rollout_id,
             "status": s.status.value, "reward": s.reward, "remove_sample": s.remove_sample}
            for s in samples]


DENSE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             kv_channels=16, ffn_hidden_size=128, vocab_size=1000, num_experts=None,
             multi_latent_attention=False)
MOE = dict(DENSE, num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2,
           moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1])


def schedule_families(num_rollouts: int, max_total: int) -> list[list[tuple[dict, dict, int]]]:
    """Configuration families; each lists variants (batch size, cap) to try in order."""
    def tpc(dp, cp=1, vpp=1, mbg=1):
        return {"dp_size": dp, "cp_size": cp, "vpp_size": vpp,
                "microbatch_group_size_per_vp_stage": mbg}

    base = dict(micro_batch_size=1, use_dynamic_batch_size=True, max_tokens_per_gpu=None,
                balance_data=False, balance_by_flops=False)
    n = num_rollouts
    sizes = list(dict.fromkeys(g for g in (n // 2, n // 3, n, n // 4, 1) if g >= 1))
    caps = [max(8, max_total) * f for f in (2, 1, 4)]
    static = dict(base, use_dynamic_batch_size=False)
    return [
        # dp 2, dynamic first-fit
        [(dict(base, max_tokens_per_gpu=c), tpc(2), g) for g in sizes for c in caps],
        # dp 2, static micro-batches of one sample
        [(static, tpc(2), g) for g in sizes],
        # dp 2, dynamic, FLOPs-balanced ranks (dense model)
        [(dict(base, max_tokens_per_gpu=c, balance_data=True, **DENSE), tpc(2), g)
         for g in sizes for c in caps],
        # dp 2 x cp 2 x vpp 2 (micro-batch groups of 2), balance_by_flops (MoE model)
        [(dict(base, max_tokens_per_gpu=c, balance_data=True, balance_by_flops=True, **MOE),
          tpc(2, cp=2, vpp=2, mbg=2), g) for g in sizes for c in caps],
        # dp 1, static micro-batches of two samples
        [(dict(static, micro_batch_size=2), tpc(1), g) for g in sizes],
    ]


def run_schedules(S, td: dict) -> list[dict]:
    """Per family: its first variant slime schedules, and the first it rejects (if before)."""
    total = [len(t) for t in td["tokens"]]
    out = []
    for family in schedule_families(len(set(td["rollout_ids"])), max(total)):
        error = None
        for args, tpc, gbs in family:
            rec = {"args": args, "train_parallel_config": tpc, "global_batch_size": gbs}
            try:
                res = S.build_dp_schedule(SimpleNamespace(**args), tpc, total,
                                          global_batch_size=gbs,
                                          rollout_indices=td["rollout_ids"])
            except AssertionError as e:
                if error is None:
                    error = dict(rec, error=str(e))
                continue
            out.append(dict(rec, output=[list(x) for x in res]))
            break
        if error is not None:
            out.append(error)
    return out


def check_split(S, td: dict, sched: dict) -> None:
    """Cross-check: slime's ``_split_train_data_by_dp`` packs the same schedule."""
    if "output" not in sched:
        return
    mod = S.rollout_mod
    saved = mod.ray, mod.Box
    mod.ray, mod.Box = SimpleNamespace(put=lambda x, **k: x), (lambda x: x)
    try:
        self = manager(S, [])
        for k, v in sched["args"].items():
            setattr(self.args, k, v)
        self.args.global_batch_size = sched["global_batch_size"]
        self.train_parallel_config = sched["train_parallel_config"]
        ranks = S.RolloutManager._split_train_data_by_dp(self, dict(td))
    finally:
        mod.ray, mod.Box = saved
    parts, mbi, nmb, gbs = sched["output"]
    for r, rd in enumerate(ranks):
        assert rd["partition"] == parts[r] and rd["micro_batch_indices"] == mbi[r]
        assert rd["num_microbatches"] == nmb and rd["global_batch_sizes"] == gbs
        assert list(rd["total_lengths"]) == [len(t) for t in td["tokens"]]


def record(out: Path, stem: str, payload: dict) -> None:
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- specs
FLAT_SPECS = [
    dict(seed=1, prompts=3, per_prompt=2, p_compact=0.0, reward="float"),
    dict(seed=2, prompts=3, per_prompt=2, p_compact=1.0, reward="float", small_ids=[0, 1, 2]),
    dict(seed=3, prompts=4, per_prompt=2, p_compact=0.5, reward="float", small_ids=[0, 1, 3]),
    dict(seed=4, prompts=2, per_prompt=4, p_compact=0.5, reward="dict", small_ids=[1, 2]),
    dict(seed=5, prompts=5, per_prompt=1, p_compact=0.6, reward="mixed", small_ids=[0, 2, 4]),
    dict(seed=6, prompts=3, per_prompt=3, p_compact=0.4, reward="float", shuffle=True,
         small_ids=[0, 5]),
    dict(seed=7, prompts=4, per_prompt=2, p_compact=0.5, reward="float", metadata_raw_reward=True,
         small_ids=[3]),
    dict(seed=8, prompts=2, per_prompt=3, p_compact=0.7, reward="dict", p_remove=0.4,
         masks=["zeros"], small_ids=[0]),
    dict(seed=9, prompts=3, per_prompt=2, p_compact=0.5, reward="none", masks=["none"],
         small_ids=[-1, 0]),
    dict(seed=10, prompts=6, per_prompt=2, p_compact=0.3, reward="float", log_probs=True,
         max_siblings=4, small_ids=[0, 1]),
    dict(seed=11, prompts=2, per_prompt=2, p_compact=1.0, reward="float", shuffle=True,
         max_siblings=4, small_ids=[2, 0]),
    dict(seed=12, prompts=4, per_prompt=4, p_compact=0.25, reward="mixed", shuffle=True,
         max_prompt=60, max_response=90, small_ids=[7, 1]),
    dict(seed=13, prompts=1, per_prompt=3, p_compact=0.0, reward="float", p_remove=0.0),
    dict(seed=14, prompts=5, per_prompt=2, p_compact=0.5, reward="float", masks=["ones"],
         small_ids=[0, 1, 2, 3]),
]


def base_payload(commit: str, dump: str, kind: str) -> dict:
    return {"slime_commit": commit, "generator": GENERATOR, "dump": dump, "kind": kind}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slime", required=True, type=Path, help="path of a slime checkout")
    ap.add_argument("--out", required=True, type=Path, help="folder for the dumps and records")
    ap.add_argument("--slime-commit", default=None,
                    help=f"commit of the checkout (default: git rev-parse, else {PINNED_COMMIT})")
    a = ap.parse_args(argv)
    S = import_slime(a.slime)
    import torch

    commit = slime_commit(a.slime, a.slime_commit)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.pt")) + list(out.glob("*.json")):
        old.unlink()
    template = str(out / "rollout_{rollout_id}.pt")
    n_samples = 0

    # flat dumps, written and read by slime's own debug-data functions
    for spec in FLAT_SPECS:
        k = spec["seed"]
        samples = flat(make_samples(S, spec))
        if spec.get("shuffle"):
            random.Random(1000 + k).shuffle(samples)
        pristine = copy.deepcopy(samples)
        S.save(template, samples, rollout_id=k, evaluation=False)
        loaded = S.load(template, rollout_id=k)
        td = convert(S, loaded)
        assert json_train_data(td) == json_train_data(convert(S, pristine))
        schedules = run_schedules(S, td)
        for sched in schedules:
            check_split(S, td, sched)
        payload = base_payload(commit, f"rollout_{k}.pt", "flat")
        payload.update(spec=spec, train_data=json_train_data(td), schedules=schedules,
                       samples=sample_fields(S.load(template, rollout_id=k)))
        record(out, f"rollout_{k}", payload)
        n_samples += len(samples)

    # an old dump: sample dicts from before the rollout_id field (and other newer fields)
    spec = dict(seed=20, prompts=3, per_prompt=2, p_compact=0.0, reward="float")
    samples = flat(make_samples(S, spec))
    dicts = [s.to_dict() for s in samples]
    for d in dicts:
        for key in ("rollout_id", "prefix_cache_info", "rollout_top_p_token_ids",
                    "rollout_top_p_token_offsets", "teacher_log_probs", "session_id",
                    "non_generation_time"):
            d.pop(key, None)
    torch.save({"rollout_id": 20, "samples": dicts}, out / "old_rollout_20.pt")
    loaded = S.load(str(out / "old_rollout_{rollout_id}.pt"), rollout_id=20)
    td = convert(S, loaded)
    payload = base_payload(commit, "old_rollout_20.pt", "old")
    payload.update(spec=spec, train_data=json_train_data(td), schedules=run_schedules(S, td),
                   samples=sample_fields(loaded))
    record(out, "old_rollout_20", payload)
    n_samples += len(samples)

    # nested dumps: prompt -> rollout siblings (depth 2) and prompt -> rollout -> siblings (3)
    for k, spec, depth in [
        (21, dict(seed=21, prompts=3, per_prompt=2, p_compact=0.7, reward="float",
                  small_ids=[0, 1]), 2),
        (22, dict(seed=22, prompts=3, per_prompt=2, p_compact=0.6, reward="dict",
                  small_ids=[1]), 3),
    ]:
        prompts = make_samples(S, spec)
        if depth == 2:  # one list per rollout: its siblings share an explicit id (or it is alone)
            nested = [sib for rollouts in prompts for sib in rollouts]
        else:
            nested = prompts
        nested_dicts = to_dicts(nested)
        torch.save({"rollout_id": k, "samples": nested_dicts}, out / f"nested_rollout_{k}.pt")
        flat_samples = slime_flatten(S, copy.deepcopy(nested))
        fields = sample_fields(flat_samples)
        td = convert(S, flat_samples)
        payload = base_payload(commit, f"nested_rollout_{k}.pt", "nested")
        payload.update(spec=spec, depth=depth, train_data=json_train_data(td),
                       schedules=run_schedules(S, td), samples=fields)
        record(out, f"nested_rollout_{k}", payload)
        n_samples += len(flat_samples)

    # unsafe dumps: rebuilding these needs unpickling slime's classes
    spec = dict(seed=30, prompts=1, per_prompt=2, p_compact=0.0, reward="float")
    samples = flat(make_samples(S, spec))
    torch.save({"rollout_id": 30, "samples": samples}, out / "unsafe_sample_objects.pt")
    enum_dicts = []
    for s in samples:
        d = s.to_dict()
        d["status"] = s.status  # the Enum itself, not its string value
        enum_dicts.append(d)
    torch.save({"rollout_id": 31, "samples": enum_dicts}, out / "unsafe_status_enum.pt")
    for stem, why in [("unsafe_sample_objects", "pickled slime Sample objects"),
                      ("unsafe_status_enum", "Sample.Status enum members")]:
        payload = base_payload(commit, f"{stem}.pt", "unsafe")
        payload["holds"] = why
        record(out, stem, payload)

    print(f"recorded {len(FLAT_SPECS) + 3} readable dumps ({n_samples} samples) and 2 unsafe "
          f"dumps in {out}")


if __name__ == "__main__":
    main()
