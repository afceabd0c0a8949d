"""varbatch_kit against golden vectors recorded from slime's own code.

``tests/golden/*.json`` were written by ``scripts/record_slime_golden.py``,
which imports slime's modules (THUDM/slime at the commit each file names) and
runs them on seeded random inputs. Every vector is replayed here against

- the slime-signature adapters of :mod:`varbatch_kit.compat.slime`;
- the core they sit on (:mod:`varbatch_kit.policies.partition`,
  :mod:`varbatch_kit.policies.packers`, :mod:`varbatch_kit.core.flops`,
  :func:`varbatch_kit.core.build.build_schedule`,
  :mod:`varbatch_kit.report.cp`, :mod:`varbatch_kit.report`);
- the in-project plain-Python transcriptions
  (:func:`varbatch_kit.policies.partition.karmarkar_karp_reference` and
  ``benchmarks/baseline.py``), so that the property tests comparing the fast
  core with those transcriptions compare with something checked against slime.

Integers, partitions and schedules must be equal; FLOPs and the metric
reductions bit-exact (slime's arithmetic is reproduced operation by
operation); the reducer sums (torch reductions in a different association)
agree to 1e-12 of the summed magnitudes. Where slime asserts, the compat
function raises :class:`SlimeCompatError` (a ``ValueError`` and an
``AssertionError``) whose message contains slime's own first clause
(``num_rollouts (3) < global_batch_size (4)``, ``step 1: 1 samples < dp_size
2``, ``static path: ...``, ``dynamic path: ...``, ``number of items:[2] <
k_partitions:[3]``, ...). Cases are checked in chunks; a failure lists the
file and the indices of the failing cases.
"""

from __future__ import annotations

import copy
import json
import math
from functools import cache
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _paths import GOLDEN

from benchmarks import baseline
from varbatch_kit import report
from varbatch_kit.compat import slime as compat
from varbatch_kit.compat.slime import SlimeCompatError
from varbatch_kit.core.build import build_schedule
from varbatch_kit.core.config import ScheduleConfig
from varbatch_kit.core.flops import ModelShape
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.policies.packers import AlignmentError, PackInput, first_fit, split_to_target
from varbatch_kit.policies.partition import karmarkar_karp, karmarkar_karp_reference
from varbatch_kit.report.cp import zigzag_slice

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
CHUNK = 200
FAMILIES = ("kk", "first_fit", "expand_bins", "flops", "dp_schedule", "cp_offsets", "reducers",
            "train_step", "rollout_log")


@cache
def load(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


def chunk_params():
    params = []
    for name in FAMILIES:
        path = GOLDEN / f"{name}.json"
        n = len(load(name)["cases"]) if path.is_file() else 0
        for start in range(0, max(n, 1), CHUNK):
            params.append(pytest.param(name, start, id=f"{name}[{start}:{start + CHUNK}]"))
    return params


def as_lists(x):
    """Tuples (and nested tuples) as lists, to compare with JSON."""
    if isinstance(x, (tuple, list)):
        return [as_lists(v) for v in x]
    return x


def slime_head(message: str) -> str:
    """slime's first clause: what our message must contain."""
    return message.split(";")[0].strip()


def expect_compat_error(case: dict, call) -> None:
    try:
        call()
    except SlimeCompatError as e:
        assert isinstance(e, ValueError) and isinstance(e, AssertionError)
        head = slime_head(case["error"]["message"])
        assert head in str(e), f"message {str(e)!r} lacks slime's {head!r}"
        return
    raise AssertionError(f"no SlimeCompatError; slime raised {case['error']['message']!r}")


def expect_raises(exc, call, what: str) -> None:
    try:
        call()
    except exc:
        return
    raise AssertionError(f"{what}: no {exc.__name__}")


def close(got: float, want: float, scale: float) -> bool:
    return math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12 * scale)


# --------------------------------------------------------------------------- per family


def check_kk(case: dict) -> None:
    inp = case["inputs"]
    values, k, eq = inp["values"], inp["k_partitions"], inp["equal_size"]
    raw = inp["fn"] == "karmarkar_karp"
    fn = compat.karmarkar_karp if raw else compat.get_seqlen_balanced_partitions
    n = len(values)
    if "error" in case:
        expect_compat_error(case, lambda: fn(values, k, eq))
        expect_raises(ValueError, lambda: karmarkar_karp(values, k, eq), "core")
        expect_raises(ValueError, lambda: karmarkar_karp_reference(values, k, eq), "reference")
        return
    want = case["output"]
    assert fn(list(values), k, eq) == want, "compat"
    if n < k:  # slime's raw Karmarkar-Karp leaves k - n parts empty; the core requires n >= k
        assert raw and not eq
        return
    sort = not raw
    assert karmarkar_karp(list(values), k, eq, sort_parts=sort) == want, "core (list)"
    if inp["kind"] != "mixed":  # one numeric kind: the fast path on an array
        assert karmarkar_karp(np.asarray(values), k, eq, sort_parts=sort) == want, "core (array)"
    ref = reference_kk(tuple((type(v).__name__, v) for v in values), k, eq)
    assert (ref if raw else [sorted(p) for p in ref]) == want, "reference"


@cache
def reference_kk(typed_values: tuple, k: int, eq: bool) -> list[list[int]]:
    """The plain transcription's parts in merge order (the large cases repeat per function)."""
    return karmarkar_karp_reference([v for _, v in typed_values], k, eq, sort_parts=False)


def check_first_fit(case: dict) -> None:
    inp = case["inputs"]
    lengths, cap = inp["total_lengths"], inp["max_tokens_per_bin"]
    want = case["output"]
    assert compat.first_fit_pack(lengths, cap) == want, "compat"
    assert baseline.first_fit(lengths, cap) == want, "baseline"
    if lengths:
        assert first_fit(PackInput(np.asarray(lengths), cap=cap)) == want, "core"


def check_expand_bins(case: dict) -> None:
    inp = case["inputs"]
    bins, target, lengths = inp["bins"], inp["target_count"], inp["lengths"]
    want = case["output"]
    work = copy.deepcopy(bins)
    assert compat.expand_bins_by_splitting(work, target, lengths) is None
    assert work == want, "compat (in place)"
    reached = len(want) >= target
    if reached:
        assert split_to_target(bins, np.asarray(lengths), target) == want, "core"
        assert baseline.split(bins, lengths, target) == want, "baseline"
    else:  # slime stopped early (only singletons left); the core and the baseline refuse
        expect_raises(AlignmentError, lambda: split_to_target(bins, np.asarray(lengths), target),
                      "core")
        expect_raises(ValueError, lambda: baseline.split(bins, lengths, target), "baseline")


def check_flops(case: dict) -> None:
    inp = case["inputs"]
    args = SimpleNamespace(**inp["args"])
    seqlens = inp["seqlens"]
    want = case["output"]
    got = compat.calculate_fwd_flops(seqlens, args)
    assert isinstance(got, float) and got == want, f"compat {got!r} != {want!r}"
    shape = ModelShape.from_args(args)
    per_sample = shape.forward_flops(np.asarray(seqlens))
    if len(seqlens) == 1:
        assert float(shape.forward_flops(seqlens[0])) == want, "core (scalar)"
        assert float(per_sample[0]) == want, "core (array)"
    else:
        assert close(float(sum(per_sample.tolist())), want, abs(want)), "core (sum)"


def config_of(args: dict, tpc: dict, gbs: int) -> ScheduleConfig:
    dynamic = args["use_dynamic_batch_size"]
    return ScheduleConfig(
        dp=tpc["dp_size"], cp=tpc["cp_size"], vpp=tpc["vpp_size"],
        mb_group=tpc["microbatch_group_size_per_vp_stage"], global_batch_size=gbs,
        micro_batch_size=None if dynamic else args["micro_batch_size"],
        max_tokens_per_gpu=args["max_tokens_per_gpu"] if dynamic else None,
        packing="flops_kk" if args["balance_by_flops"] else "first_fit" if dynamic else "static",
        distribution="flops_kk" if args["balance_data"] else "strided",
    )


def check_dp_schedule(case: dict) -> None:
    inp = case["inputs"]
    args, tpc = inp["args"], inp["train_parallel_config"]
    lengths, gbs, rid = inp["total_lengths"], inp["global_batch_size"], inp["rollout_indices"]
    ns = SimpleNamespace(**args)

    def run_compat():
        return compat.build_dp_schedule(ns, dict(tpc), list(lengths), global_batch_size=gbs,
                                        rollout_indices=list(rid))

    config = config_of(args, tpc, gbs)
    rollouts = Rollouts(prompt_len=np.zeros(len(lengths), dtype=np.int64),
                        response_len=np.asarray(lengths), rollout_id=np.asarray(rid))
    shape = ModelShape.from_args(ns)
    if "error" in case:
        expect_compat_error(case, run_compat)
        expect_raises(ValueError, lambda: build_schedule(rollouts, config, shape), "core")
        return
    want = case["output"]
    assert as_lists(run_compat()) == want, "compat"
    sched = build_schedule(rollouts, config, shape)
    sched.check()
    assert as_lists(sched.rank_layout()) == want, "core"
    flops = shape.forward_flops(np.asarray(lengths)).tolist()
    ref = baseline.build_dp_schedule(
        lengths, rid, flops, dp=config.dp, gbs=gbs, cap=config.cap,
        mbs=config.micro_batch_size, align=config.align, by_flops=args["balance_by_flops"],
        balance=args["balance_data"])
    assert as_lists(ref) == want, "baseline"


def check_cp_offsets(case: dict) -> None:
    inp = case["inputs"]
    t, r, rank, cp = (inp["total_length"], inp["response_length"], inp["cp_rank"],
                      inp["cp_size"])
    want = case["output"]
    got = compat.get_logits_and_tokens_offset_with_cp(t, r, cp_rank=rank, cp_size=cp)
    assert as_lists(got) == want, f"compat {got}"
    s = zigzag_slice(t, r, cp_rank=rank, cp_size=cp)
    assert as_lists((s.chunk_size, s.chunks, s.logits_ranges, s.token_ranges)) == want, "core"
    # the response pieces are the token ranges shifted by the prompt length
    p = t - r
    assert as_lists(s.response_ranges) == [[a - p, b - p] if b > a else [0, 0]
                                           for a, b in want[3]]


def check_reducers(case: dict) -> None:
    inp = case["inputs"]
    dtype = getattr(torch, inp["mask_dtype"])
    masks = [torch.tensor(m, dtype=dtype) for m in inp["loss_masks"]]
    den = inp["sample_denoms"]
    den_t = None if den is None else torch.tensor(den, dtype=torch.float64)
    x = torch.tensor(inp["x"], dtype=torch.float64)
    scale = float(x.abs().sum()) + 1.0
    want = case["output"]
    reducer = compat.get_sum_of_sample_mean(
        inp["total_lengths"], inp["response_lengths"], masks, den_t,
        inp["calculate_per_token_loss"], cp_rank=inp["cp_rank"], cp_size=inp["cp_size"])
    got = reducer(x)
    assert got.dtype == torch.float64
    assert close(float(got), want, scale), f"compat {float(got)!r} != {want!r}"
    core = report.make_reducer(
        inp["total_lengths"], inp["response_lengths"], masks, den,
        per_token=inp["calculate_per_token_loss"], cp_rank=inp["cp_rank"],
        cp_size=inp["cp_size"])
    assert close(float(core(x)), want, scale), "core"


def check_train_step(case: dict) -> None:
    inp = case["inputs"]
    entries = [{"keys": list(e["keys"]), "values": torch.tensor(e["values"], dtype=torch.float64)}
               for e in inp["losses_reduced"]]
    want = case["output"]
    got = compat.reduce_train_step_metrics(
        entries, calculate_per_token_loss=inp["calculate_per_token_loss"],
        step_global_batch_size=inp["step_global_batch_size"], cp_size=inp["cp_size"])
    assert got == want, f"compat {got} != {want}"
    core = report.reduce_train_step_metrics(
        [e["values"] for e in entries], keys=inp["keys"],
        divisor=None if inp["calculate_per_token_loss"] else inp["step_global_batch_size"],
        cp_size=inp["cp_size"])
    assert core == want, f"core {core} != {want}"


def _decode_log_dict(d: dict) -> dict:
    return {k: (v[1], v[2]) if v[0] == "pair" else v[1] for k, v in d.items()}


def check_rollout_log(case: dict, monkeypatch) -> None:
    inp = case["inputs"]
    want = case["output"]
    if inp["fn"] == "rollout_log_metric_contribution":
        kw = dict(cp_size=inp["cp_size"], dp_size=inp["dp_size"])
        got = compat.rollout_log_metric_contribution(
            inp["per_rank_reducer_sum"], num_rollouts_in_rollout=inp["num_rollouts_in_rollout"],
            **kw)
        assert list(got) == want, f"compat {got}"
        core = report.rollout_log_metric_contribution(
            inp["per_rank_reducer_sum"], num_rollouts=inp["num_rollouts_in_rollout"], **kw)
        assert list(core) == want, f"core {core}"
        return
    dicts = [_decode_log_dict(d) for d in inp["per_rank"]]
    n, src = inp["dp_size"], inp["dp_src_rank"]
    assert report.reduce_log_dicts(copy.deepcopy(dicts)) == want, "core"

    def all_gather_object(object_list, obj, group=None):
        object_list[:] = copy.deepcopy(dicts)

    group = object()
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: n)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: src)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    got = compat.gather_and_reduce_log_dict(dicts[src], dp_size=n, dp_src_rank=src,
                                            dp_group=group)
    assert got == want, f"compat {got} != {want}"
    # any other rank gets None, as in slime
    monkeypatch.setattr(dist, "get_rank", lambda group=None: src + 1)
    assert compat.gather_and_reduce_log_dict(dicts[src], dp_size=n, dp_src_rank=src,
                                             dp_group=group) is None


CHECKS = {name: globals()[f"check_{name}"] for name in FAMILIES}


# --------------------------------------------------------------------------- tests


def test_golden_files_are_slime_recordings():
    files = sorted(p.stem for p in GOLDEN.glob("*.json"))
    assert files == sorted(FAMILIES), f"unexpected golden files: {files}"
    for name in FAMILIES:
        data = load(name)
        assert data["slime_commit"] == SLIME_COMMIT
        assert data["generator"] == "scripts/record_slime_golden.py"
        assert isinstance(data["seed"], int)
        assert data["cases"], name
        for i, c in enumerate(data["cases"]):
            assert set(c) in ({"inputs", "output"}, {"inputs", "error"}), (name, i)
            if "error" in c:
                assert c["error"]["type"] == "AssertionError", (name, i)


def test_golden_coverage():
    """The vectors cover what the recording promises (ties, errors, layouts, model kinds)."""
    kk = load("kk")["cases"]
    kinds = {(c["inputs"]["fn"], c["inputs"]["equal_size"], "error" in c) for c in kk}
    # every (function, equal_size) with and without an error, except raw KK without
    # equal_size: slime's raw karmarkar_karp never asserts there (k > n leaves parts empty)
    assert len(kinds) == 7 and ("karmarkar_karp", False, True) not in kinds
    assert any(c["inputs"]["fn"] == "karmarkar_karp" and "output" in c
               and c["inputs"]["k_partitions"] > len(c["inputs"]["values"]) for c in kk)
    assert max(len(c["inputs"]["values"]) for c in kk) >= 500
    assert any(c["inputs"]["k_partitions"] == len(c["inputs"]["values"]) > 1 for c in kk)
    variants = " ".join(c["inputs"]["variant"] for c in load("flops")["cases"])
    for v in ("dense", "gqa", "moe_no_freq", "moe_int_freq", "moe_list_freq", "moe_list_freq_gt1",
              "mla_qset_kvset", "mla_qnone_kvnone", "mla_qset_kvnone", "mla_qnone_kvset"):
        assert v in variants, v
    dps = load("dp_schedule")["cases"]
    scen = " ".join(c["inputs"]["scenario"] for c in dps if "output" in c)
    for s in ("static", "first_fit", "by_flops", "balance", "multi", "interleaved", "vpp",
              "cp2"):
        assert s in scen, s
    heads = " ".join(c["error"]["message"] for c in dps if "error" in c)
    for h in ("num_rollouts", "dp_size", "static path", "dynamic path"):
        assert h in heads, h

    def cap(c):
        inp = c["inputs"]
        return inp["args"]["max_tokens_per_gpu"] * inp["train_parallel_config"]["cp_size"]

    assert any("output" in c and c["inputs"]["args"]["use_dynamic_batch_size"]
               and max(c["inputs"]["total_lengths"]) > cap(c) for c in dps)  # oversize samples
    assert any(len(c["output"][2]) > 1 for c in dps if "output" in c)  # several steps
    assert any(sum(map(len, c["output"][0])) < len(c["inputs"]["total_lengths"])
               for c in dps if "output" in c)  # trailing rollouts dropped
    expand = load("expand_bins")["cases"]
    assert any(len(c["output"]) < c["inputs"]["target_count"] for c in expand)  # stopped early
    assert any(max(c["inputs"]["total_lengths"], default=0) > c["inputs"]["max_tokens_per_bin"]
               for c in load("first_fit")["cases"])
    assert any([0, 0] in c["output"][2] for c in load("cp_offsets")["cases"])  # empty ranges
    reducers = {(c["inputs"]["cp_size"] > 1, c["inputs"]["sample_denoms"] is None,
                 c["inputs"]["calculate_per_token_loss"]) for c in load("reducers")["cases"]}
    assert len(reducers) == 8
    steps = {(c["inputs"]["cp_size"], c["inputs"]["calculate_per_token_loss"])
             for c in load("train_step")["cases"]}
    assert {(cp, pt) for cp in (1, 2, 4) for pt in (False, True)} <= steps


@pytest.mark.parametrize("name,start", chunk_params())
def test_golden(name, start, monkeypatch):
    cases = load(name)["cases"][start:start + CHUNK]
    check = CHECKS[name]
    failures = []
    for i, case in enumerate(cases, start):
        try:
            if name == "rollout_log":
                check(case, monkeypatch)
            else:
                check(case)
        except Exception as e:  # noqa: BLE001 - collect, then report every failing index
            failures.append(f"{name}.json case {i}: {type(e).__name__}: {e}")
    assert not failures, f"{len(failures)} of {len(cases)} cases differ from slime:\n" + "\n".join(
        failures[:12])
