"""slime's ``policy_loss_function`` and ``loss_function`` end to end, against slime's own code.

``tests/golden/objective/{policy_loss_function,loss_function}.json`` were
written by ``scripts/record_slime_loss.py``, which imports slime's
``backends/megatron_utils/loss.py`` unmodified at the commit each file names,
runs it in one process (gloo world of one, megatron-core's parallel state with
tp = pp = cp = 1) on random packed logits ``[1, T, V]`` (3-5 samples, V in
11..17, padding rows, fully masked samples, per-rollout denominators or none,
per-token loss or not, every estimator / KL type / TIS function / rollout
temperature of the grid) and records the loss, the normalizer, every logged
value with its key, and the gradient of the returned loss with respect to the
logits. Every case is replayed here against
:mod:`varbatch_kit.compat.slime.loss` (which sits on the engine's
:func:`~varbatch_kit.report.objective.policy_objective`), and against the
engine's own path: the one per-token ``loss`` tensor of ``policy_objective``
reduced once gives slime's loss and logits gradient.

Tolerances (float32 throughout): keys equal and in the same order; dtypes,
shapes and the normalizer exact; logged values and losses within ``rtol =
2e-6``, ``atol = 1e-5`` (sums of ~20 log-probs of magnitude ~5 with other
association orders; measured at most 3.8e-6 absolute); the logits gradient
within ``rtol = 2e-6``, ``atol = 4e-6`` (slime's hand-written backward against
autograd; measured at most 1.2e-6). A clip flag flipping would move its
fraction by at least 1/denominator (> 0.01), far outside these.
"""

from __future__ import annotations

import json
import math
import sys
import types
from functools import cache
from types import SimpleNamespace

import pytest
import torch
from _paths import GOLDEN

import varbatch_kit.compat.slime as compat
from varbatch_kit.compat.slime import SlimeCompatError
from varbatch_kit.compat.slime import loss as sl
from varbatch_kit.report import objective as obj

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
FOLDER = GOLDEN / "objective"
#: family -> number of cases recorded (the coverage pin)
FAMILIES = {"policy_loss_function": 30, "loss_function": 48}
VALUE_TOL = {"rtol": 2e-6, "atol": 1e-5}
GRAD_TOL = {"rtol": 2e-6, "atol": 4e-6}
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@cache
def load(name: str) -> dict:
    return json.loads((FOLDER / f"{name}.json").read_text())


def dec(v):
    """Inverse of the recorder's encoding (tensors; dicts and lists recursively)."""
    if isinstance(v, dict) and set(v) == {"dtype", "shape", "data"}:
        data = [NON_FINITE.get(x, x) if isinstance(x, str) else x for x in v["data"]]
        return torch.tensor(data, dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
    if isinstance(v, list):
        return [dec(x) for x in v]
    if isinstance(v, dict):
        return {k: dec(x) for k, x in v.items()}
    return v


def case_inputs(case: dict):
    inp = dec(case["inputs"])
    return SimpleNamespace(**inp["args"]), inp["batch"], inp


def close(got: torch.Tensor, want: torch.Tensor, tol: dict, where: str) -> None:
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{where}: shape {got.shape} != {want.shape}"
    torch.testing.assert_close(got.detach(), want, **tol, msg=lambda m: f"{where}: {m}")


def reducer(args, batch):
    return compat.get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"],
                                     batch["loss_masks"], batch["rollout_mask_sums"],
                                     args.calculate_per_token_loss)


def run_policy(case):
    args, batch, inp = case_inputs(case)
    x = inp["logits"].clone().requires_grad_(True)
    given = inp["sum_of_sample_mean"]
    sum_of_sample_mean = compat.get_sum_of_sample_mean(
        batch["total_lengths"], batch["response_lengths"], batch["loss_masks"],
        given["sample_denoms"], given["calculate_per_token_loss"])
    loss, metrics = sl.policy_loss_function(args, batch, x, sum_of_sample_mean)
    loss.backward()
    return loss, metrics, x.grad


def run_loss(case, **arg_overrides):
    args, batch, inp = case_inputs(case)
    for k, v in arg_overrides.items():
        setattr(args, k, v)
    x = inp["logits"].clone().requires_grad_(True)
    loss, normalizer, log = sl.loss_function(args, batch, inp["num_microbatches"],
                                             inp["step_global_batch_size"], x)
    loss.backward()
    return loss, normalizer, log, x.grad


# --------------------------------------------------------------------------- the files


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_file_header_and_coverage_pin(name):
    data = load(name)
    assert data["slime_commit"] == SLIME_COMMIT
    assert data["generator"] == "scripts/record_slime_loss.py"
    assert data["function"] == name
    assert len(data["cases"]) == FAMILIES[name]
    assert all("output" in c for c in data["cases"]), "slime raised on a recorded case"


def test_the_files_are_in_the_objective_folder():
    """The folder is shared with record_slime_objective.py (test_golden_objective.py pins
    its whole listing)."""
    assert set(FAMILIES) <= {p.stem for p in FOLDER.glob("*.json")}


def test_the_grid_covers_every_option():
    cases = load("policy_loss_function")["cases"] + load("loss_function")["cases"]
    args = [c["inputs"]["args"] for c in cases]
    batches = [c["inputs"]["batch"] for c in cases]
    assert {a["advantage_estimator"] for a in args} == {"grpo", "gspo", "cispo"}
    assert {(a["kl_loss_type"], a["use_unbiased_kl"]) for a in args if a["use_kl_loss"]} == {
        (k, u) for k in obj.KL_TYPES for u in (False, True)}
    assert {a["custom_tis_function_path"] for a in args if a["use_tis"]} == {
        None, "slime.backends.megatron_utils.loss.icepop_function"}
    assert {a["rollout_temperature"] for a in args} == {1.0, 0.7, 1.3}
    assert {a["calculate_per_token_loss"] for a in args} == {False, True}
    assert {a["eps_clip_c"] for a in args} == {None, 1.5, 3.0}
    assert any(a["eps_clip_high"] != a["eps_clip"] for a in args)
    assert {a["entropy_coef"] for a in args} == {0.0, 0.01, 0.1}
    for flag in ("use_rollout_logprobs", "use_opsm", "get_mismatch_metrics"):
        assert any(a[flag] for a in args), flag
    assert any(b["rollout_mask_sums"] is None for b in batches)
    assert any(b["rollout_mask_sums"] is not None for b in batches)
    assert any("log_probs" not in b for b in batches)  # on-policy: old = current, detached
    assert any("rollout_log_probs" not in b for b in batches)
    fully_masked = [b for b in batches if any(not any(m["data"]) for m in b["loss_masks"])]
    assert len(fully_masked) > len(batches) // 2
    assert {m["dtype"] for b in batches for m in b["loss_masks"]} == {"int32", "float32"}


# --------------------------------------------------------------------------- the vectors


@pytest.mark.parametrize("i", range(FAMILIES["policy_loss_function"]))
def test_policy_loss_function_matches_slime(i):
    case = load("policy_loss_function")["cases"][i]
    want = dec(case["output"])
    loss, metrics, grad = run_policy(case)
    assert list(metrics) == list(want["metrics"])
    close(loss, want["loss"], VALUE_TOL, "loss")
    for key, value in want["metrics"].items():
        close(metrics[key], value, VALUE_TOL, key)
    close(grad, want["logits_grad"], GRAD_TOL, "logits_grad")


@pytest.mark.parametrize("i", range(FAMILIES["loss_function"]))
def test_loss_function_matches_slime(i):
    case = load("loss_function")["cases"][i]
    want = dec(case["output"])
    loss, normalizer, log, grad = run_loss(case)
    assert log["keys"] == want["log"]["keys"]
    close(loss, want["loss"], VALUE_TOL, "loss")
    assert normalizer.dtype == want["normalizer"].dtype
    assert normalizer.item() == want["normalizer"].item()
    close(log["values"], want["log"]["values"], VALUE_TOL, "values")
    close(grad, want["logits_grad"], GRAD_TOL, "logits_grad")


@pytest.mark.parametrize("i", range(FAMILIES["loss_function"]))
def test_the_engines_single_per_token_loss_reduces_to_slimes(i):
    """The training step reduces one tensor, ``policy_objective(...)["loss"]``; its gradient
    is slime's (OPSM is not part of the engine's objective: those cases are skipped)."""
    case = load("loss_function")["cases"][i]
    args, batch, inp = case_inputs(case)
    if args.use_opsm:
        pytest.skip("OPSM is applied by compat's policy_loss_function, not the engine")
    want = dec(case["output"])
    x = inp["logits"].clone().requires_grad_(True)
    log_probs, entropy = obj.response_log_probs_and_entropy(
        x[0], batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"],
        args.rollout_temperature)
    terms = obj.policy_objective(
        sl.objective_options_from_args(args), log_probs, entropy, batch["advantages"],
        batch["loss_masks"], old_log_probs=batch.get("log_probs"),
        ref_log_probs=batch["ref_log_probs"], rollout_log_probs=batch.get("rollout_log_probs"))
    loss = reducer(args, batch)(terms["loss"])
    if not args.calculate_per_token_loss:
        loss = loss * inp["num_microbatches"] / inp["step_global_batch_size"]
    loss.backward()
    close(loss, want["loss"], VALUE_TOL, "loss")
    close(x.grad, want["logits_grad"], GRAD_TOL, "logits_grad")
    keys = obj.metric_keys(sl.objective_options_from_args(args),
                           has_rollout_log_probs="rollout_log_probs" in batch)
    assert list(keys) == want["log"]["keys"]


def test_a_fully_masked_sample_counts_one_token_in_the_per_token_normalizer():
    """slime's ``clamp_min(loss_mask.sum(), 1)``: recorded cases, then a hand-made one."""
    checked = 0
    for case in load("loss_function")["cases"]:
        args, batch, _ = case_inputs(case)
        if not args.calculate_per_token_loss:
            continue
        sums = [int(m.sum()) for m in batch["loss_masks"]]
        want = dec(case["output"])
        assert want["normalizer"].item() == sum(max(s, 1) for s in sums)
        assert want["log"]["values"][0].item() == sum(max(s, 1) for s in sums)
        checked += 0 in sums
    assert checked >= 5
    case = next(c for c in load("loss_function")["cases"]
                if c["inputs"]["args"]["calculate_per_token_loss"])
    args, batch, inp = case_inputs(case)
    n = len(batch["loss_masks"])
    batch["loss_masks"] = [torch.zeros_like(m) if j == 0 else torch.ones_like(m)
                           for j, m in enumerate(batch["loss_masks"])]
    _, normalizer, log = sl.loss_function(args, batch, 1, n, inp["logits"])
    tokens = sum(batch["response_lengths"][1:])
    assert normalizer.item() == tokens + 1
    assert log["values"][0].item() == tokens + 1


# --------------------------------------------------------------------------- beyond slime's grid


def test_the_data_parallel_size_scales_the_per_sample_loss():
    case = next(c for c in load("loss_function")["cases"]
                if not c["inputs"]["args"]["calculate_per_token_loss"])
    want = dec(case["output"])
    loss, _, log, grad = run_loss(case, data_parallel_size=4)
    close(loss, want["loss"] * 4, VALUE_TOL, "loss")
    close(grad, want["logits_grad"] * 4, GRAD_TOL, "logits_grad")
    close(log["values"], want["log"]["values"], VALUE_TOL, "values")  # the log is not scaled


def test_a_custom_tis_function_path_is_loaded_and_called(monkeypatch):
    """Any other dotted path is imported and called with slime's keyword arguments."""
    case = next(c for c in load("loss_function")["cases"]
                if c["inputs"]["args"]["custom_tis_function_path"])
    calls = []

    def my_icepop(args, **kwargs):
        calls.append(sorted(kwargs))
        return compat.icepop_function(args, **kwargs)

    monkeypatch.setitem(sys.modules, "my_tis", types.SimpleNamespace(my_icepop=my_icepop))
    want = dec(case["output"])
    loss, _, log, grad = run_loss(case, custom_tis_function_path="my_tis.my_icepop")
    assert calls == [["loss_masks", "pg_loss", "response_lengths", "rollout_log_probs",
                      "total_lengths", "train_log_probs"]]
    assert log["keys"] == want["log"]["keys"]
    close(loss, want["loss"], VALUE_TOL, "loss")
    close(log["values"], want["log"]["values"], VALUE_TOL, "values")
    close(grad, want["logits_grad"], GRAD_TOL, "logits_grad")


@pytest.mark.parametrize("override, match", [
    ({"allgather_cp": True}, "allgather_cp"),
    ({"context_parallel_size": 2}, "context_parallel_size"),
    ({"rollout_top_p": 0.9}, "rollout_top_p"),
    ({"loss_type": "value_loss"}, "Unknown loss type"),
    ({"advantage_estimator": "ppo"}, "advantage_estimator"),
    ({"data_parallel_size": 0}, "data_parallel_size=0"),
    ({"custom_tis_function_path": "no_such_module_here.fn", "use_tis": True}, "cannot load"),
])
def test_unsupported_arguments_raise_naming_the_flag(override, match):
    case = load("loss_function")["cases"][0]
    with pytest.raises(SlimeCompatError, match=match):
        run_loss(case, **override)


def test_the_engine_options_refuse_a_tis_function_they_do_not_have():
    args = SimpleNamespace(**load("loss_function")["cases"][0]["inputs"]["args"])
    args.use_tis, args.custom_tis_function_path = True, "my_tis.my_icepop"
    with pytest.raises(SlimeCompatError, match="custom_tis_function_path='my_tis.my_icepop'"):
        sl.objective_options_from_args(args)
    args.custom_tis_function_path = "varbatch_kit.compat.slime.icepop_function"
    assert sl.objective_options_from_args(args).tis_function == "icepop"
    args.use_tis, args.get_mismatch_metrics = False, True
    assert sl.objective_options_from_args(args).use_tis  # slime weighs the loss then too


def test_tis_without_rollout_log_probs_raises_slimes_message():
    case = next(c for c in load("loss_function")["cases"] if c["inputs"]["args"]["use_tis"])
    args, batch, inp = case_inputs(case)
    del batch["rollout_log_probs"]
    with pytest.raises(SlimeCompatError, match="rollout_log_probs must be provided for TIS"):
        sl.loss_function(args, batch, 1, 4, inp["logits"])


def test_compat_exports_the_loss_functions():
    assert compat.policy_loss_function is sl.policy_loss_function
    assert compat.loss_function is sl.loss_function
