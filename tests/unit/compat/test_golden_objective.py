"""slime's RL objective: varbatch_kit against vectors recorded from slime's own functions.

``tests/golden/objective/*.json`` were written by
``scripts/record_slime_objective.py``, which imports slime's
``utils/ppo_utils.py`` (and compiles ``vanilla_tis_function``,
``icepop_function`` and ``RolloutManager._post_process_rewards`` from the
checkout's text) at the commit each file names, and runs them on seeded
random inputs, fully masked samples included. Every vector is replayed here
against :mod:`varbatch_kit.compat.slime.objective` (which sits on
:mod:`varbatch_kit.report.objective`).

Besides ``ppo_utils``, the files hold slime's ``distributed_masked_whiten``
(one rank) and the train-side ``compute_advantages_and_returns`` end to end
(every estimator, with and without the KL penalty and the whitening; one
rank, last pipeline stage, no CP).

Tolerances: dtypes and shapes must be equal. Elementwise functions (KL, PPO
clip, CISPO, OPSM, GSPO, TIS, ICEPOP, GRPO / REINFORCE++-baseline broadcasts,
the reward normalisation, the whitening) are reproduced operation by
operation: equal where the recording machine's ``exp`` / ``log`` kernels are this machine's,
else within ``ELEMENTWISE_ULPS`` units of the dtype's epsilon scaled by ``1 + |value|``
(``rtol = atol = ELEMENTWISE_ULPS * eps``): on a CPU whose vectorised kernels round
differently the replay measured at most 1.0 such unit (``compute_approx_kl``,
``icepop_function``, ``vanilla_tis_function``, ``compute_cispo_loss``,
``compute_policy_loss``), where bit-exact comparison failed 5 families on a fresh clone; a
formula that differs from slime's moves values by orders of magnitude more. The returns and
GAE use a plain backward recurrence where slime uses a chunked matrix-product scan
(another association of the same sums): float64 within 1e-12 (relative and absolute), float32 within
``rtol = atol = 2e-6`` (measured: at most 7.2e-7). Where slime raises, the compat function raises
:class:`SlimeCompatError` (an ``AssertionError`` and a ``ValueError``) whose
message starts with slime's.
"""

from __future__ import annotations

import json
import math
import sys
from functools import cache
from types import SimpleNamespace

import pytest
import torch
from _paths import GOLDEN

from varbatch_kit.compat.slime import SlimeCompatError
from varbatch_kit.compat.slime import objective as so
from varbatch_kit.report import objective as obj
from varbatch_kit.report.objective import GROUP_NORMALIZED_ESTIMATORS

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
FOLDER = GOLDEN / "objective"
#: family -> number of cases recorded (the coverage pin)
FAMILIES = {
    "compute_approx_kl": 49,
    "compute_policy_loss": 60,
    "compute_cispo_loss": 40,
    "compute_gspo_kl": 40,
    "compute_opsm_mask": 40,
    "get_grpo_returns": 20,
    "get_reinforce_plus_plus_returns": 40,
    "get_reinforce_plus_plus_baseline_advantages": 20,
    "get_advantages_and_returns_batch": 40,
    "chunked_discounted_returns": 20,
    "vanilla_tis_function": 30,
    "icepop_function": 30,
    "post_process_rewards": 120,
    "distributed_masked_whiten": 30,
    "compute_advantages_and_returns": 48,
}
#: elementwise families: within this many eps(dtype) * (1 + |value|) of slime's output
ELEMENTWISE_ULPS = 16
#: families computed with another association than slime's: (float64 tol, float32 tol)
SCANS = {"get_reinforce_plus_plus_returns": (1e-12, 2e-6),
         "get_advantages_and_returns_batch": (1e-12, 2e-6),
         "chunked_discounted_returns": (1e-12, 2e-6),
         "compute_advantages_and_returns": (1e-12, 2e-6)}


@cache
def load(name: str) -> dict:
    return json.loads((FOLDER / f"{name}.json").read_text())


NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def dec_float(x):
    return NON_FINITE.get(x, x) if isinstance(x, str) else x


def dec(v):
    """Inverse of the recorder's encoding: tensors, namespaces stay dicts (see ``ns``)."""
    if isinstance(v, dict) and set(v) == {"dtype", "shape", "data"}:
        dtype = getattr(torch, v["dtype"])
        data = [dec_float(x) for x in v["data"]]
        return torch.tensor(data, dtype=dtype).reshape(v["shape"])
    if isinstance(v, list):
        return [dec(x) for x in v]
    if isinstance(v, dict):
        return {k: dec(x) for k, x in v.items()}
    return dec_float(v)


def assert_same(got, want, tol: float | None, where: str) -> None:
    """``got`` (our output) equals ``want`` (slime's, decoded): structure, dtypes, values;
    floats within ``tol`` (relative and absolute), or ``ELEMENTWISE_ULPS`` eps of their dtype
    where ``tol`` is None; integers and booleans exactly."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got)} is not a tensor"
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert tuple(got.shape) == tuple(want.shape), f"{where}: shape {got.shape} != {want.shape}"
        if not got.is_floating_point():
            assert bool((got == want).all()), f"{where}: {got.tolist()} != {want.tolist()}"
        else:
            if tol is None:
                tol = ELEMENTWISE_ULPS * torch.finfo(want.dtype).eps
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True,
                                       msg=lambda m: f"{where}: {m} ({got.tolist()} != "
                                                     f"{want.tolist()})")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), \
            f"{where}: {got!r} vs {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, tol, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {got} vs {want}"
        for k in want:
            assert_same(got[k], want[k], tol, f"{where}.{k}")
    elif isinstance(want, float):
        g = float(got)
        bound = tol if tol is not None else ELEMENTWISE_ULPS * sys.float_info.epsilon * (
            1 + abs(want))
        assert (math.isnan(g) and math.isnan(want)) or g == want or abs(g - want) <= bound, \
            f"{where}: {g!r} != {want!r}"
    else:
        assert got == want and type(got) is type(want), f"{where}: {got!r} != {want!r}"


def call(name: str, inp: dict):
    i = dec(inp)
    if name == "post_process_rewards":
        return so.post_process_rewards(SimpleNamespace(**i["args"]), i["samples"])
    if "args" in i:
        i["args"] = SimpleNamespace(**i["args"])
    if name == "compute_advantages_and_returns":
        data = i["rollout_data"]
        so.compute_advantages_and_returns(i["args"], data)
        return {k: data[k] for k in ("kl", "advantages", "returns")}
    fn = getattr(so, name)
    if name in ("vanilla_tis_function", "icepop_function"):
        args = i.pop("args")
        return fn(args, **i)
    return fn(**i)


def _tol(name: str, want) -> float | None:
    """A scan family's (float64, float32) tolerance; None (a few eps) for the others."""
    if name not in SCANS:
        return None
    t64, t32 = SCANS[name]
    flat = list(want.values()) if isinstance(want, dict) else want
    flat = flat if isinstance(flat, list) else [flat]
    while flat and isinstance(flat[0], list):
        flat = [x for sub in flat for x in sub]
    return t32 if any(isinstance(x, torch.Tensor) and x.dtype == torch.float32 for x in flat) \
        else t64


#: the folder's files written by the other recorder (checked in test_golden_loss.py)
LOSS_FAMILIES = ("loss_function", "policy_loss_function")


def test_golden_files_are_slime_recordings():
    files = sorted(p.stem for p in FOLDER.glob("*.json"))
    assert files == sorted([*FAMILIES, *LOSS_FAMILIES])
    for name, count in FAMILIES.items():
        data = load(name)
        assert data["slime_commit"] == SLIME_COMMIT
        assert data["generator"] == "scripts/record_slime_objective.py"
        assert data["function"] == name
        assert len(data["cases"]) == count


def test_golden_coverage():
    """The vectors hold the cases the brief names: every KL type with and without the ratio,
    dual clip on and off (and its error), fully masked samples, unequal groups, every flag."""
    kl = [c["inputs"] for c in load("compute_approx_kl")["cases"]]
    assert {(c["kl_loss_type"], c["importance_ratio"] is None) for c in kl} >= {
        (k, r) for k in obj.KL_TYPES for r in (True, False)}
    pl = load("compute_policy_loss")["cases"]
    assert {c["inputs"]["eps_clip_c"] is None for c in pl if "output" in c} == {True, False}
    assert any("error" in c for c in pl)

    def fully_masked(case, key="loss_masks"):
        return any(not any(m["data"]) for m in case["inputs"][key])

    ar = [c["inputs"] for c in load("compute_advantages_and_returns")["cases"]]
    assert {(a["args"]["advantage_estimator"], a["args"]["normalize_advantages"],
             a["args"]["kl_coef"] == 0) for a in ar} == {
        (e, n, z) for e in obj.ESTIMATORS for n in (True, False) for z in (True, False)}
    assert any(not any(m["data"]) for a in ar for m in a["rollout_data"]["loss_masks"])
    wh = load("distributed_masked_whiten")["cases"]
    assert {c["inputs"]["shift_mean"] for c in wh if "output" in c} == {True, False}
    assert any("error" in c for c in wh)

    for name in ("compute_gspo_kl", "compute_opsm_mask", "vanilla_tis_function",
                 "icepop_function", "get_reinforce_plus_plus_baseline_advantages"):
        assert any(fully_masked(c) for c in load(name)["cases"]), name
    rpp = load("get_reinforce_plus_plus_returns")["cases"]
    assert any("error" in c and fully_masked(c) for c in rpp)
    assert any(max(c["inputs"]["response_lengths"]) > 128 for c in rpp if "output" in c)
    pr = [c["inputs"]["args"] | {"n": len(c["inputs"]["samples"])}
          for c in load("post_process_rewards")["cases"]]
    assert {(a["advantage_estimator"], a["rewards_normalization"], a["grpo_std_normalization"])
            for a in pr} == {(e, x, y) for e in GROUP_NORMALIZED_ESTIMATORS + (
                "reinforce_plus_plus", "ppo") for x in (True, False) for y in (True, False)}
    equal = {a["n"] == a["n_samples_per_prompt"] * a["rollout_batch_size"] for a in pr}
    assert equal == {True, False}
    assert any(a["reward_key"] for a in pr)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_golden(name):
    bad = []
    for k, case in enumerate(load(name)["cases"]):
        where = f"{name}[{k}]"
        if "error" in case:
            with pytest.raises(SlimeCompatError) as e:
                call(name, case["inputs"])
            assert isinstance(e.value, AssertionError) and isinstance(e.value, ValueError)
            msg = case["error"]["message"]
            if not str(e.value).startswith(msg):
                bad.append(f"{where}: message {str(e.value)!r} does not start with {msg!r}")
            continue
        want = dec(case["output"])
        try:
            assert_same(call(name, case["inputs"]), want, _tol(name, want), where)
        except AssertionError as err:
            bad.append(str(err)[:400])
    assert not bad, f"{len(bad)} cases differ:\n" + "\n".join(bad[:10])


@pytest.mark.parametrize("name", ["compute_approx_kl", "vanilla_tis_function"])
def test_the_elementwise_tolerance_catches_a_formula_change(name):
    """A change far below any formula bug (1000 eps, relative) already fails the replay."""
    case = next(c for c in load(name)["cases"] if "output" in c)
    got, want = call(name, case["inputs"]), dec(case["output"])
    assert_same(got, want, _tol(name, want), name)

    def nudge(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x * (1 + 1000 * torch.finfo(x.dtype).eps) + 1000 * torch.finfo(x.dtype).eps
        if isinstance(x, list | tuple):
            return type(x)(nudge(v) for v in x)
        return {k: nudge(v) for k, v in x.items()} if isinstance(x, dict) else x

    with pytest.raises(AssertionError):
        assert_same(nudge(got), want, _tol(name, want), name)
