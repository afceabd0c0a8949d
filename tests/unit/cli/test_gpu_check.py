"""The GPU check's parts that need no GPU: arguments, the JSON it writes (a stand-in
measurement backend, and the real one on the CPU), the skip logic, the wheel pins and the
shell script (``bash -n``, ``--dry-run``)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import types

import pytest
from _paths import REPO

from varbatch_kit.cli import gpu_check
from varbatch_kit.cli.gpu_check import SKIPPED, availability, has_config_field, main, model_source
from varbatch_kit.train import TrainConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
SCRIPT = REPO / "scripts" / "gpu_check.sh"
COEFFS = {"format": "varbatch_kit.cost_model/1", "c0": 1e-3, "c1": 2e-6, "c2": 3e-10}


class FakeBench:
    """The measurement backend's methods, with fixed numbers; records what it was given."""

    def __init__(self, *, fail_calibrate: bool = False, ok: bool = True) -> None:
        self.calls: list[tuple] = []
        self.fail_calibrate, self.ok = fail_calibrate, ok

    def available(self):
        return (True, "") if self.ok else (False, "no CUDA device here")

    def device_info(self):
        return {"type": "cuda", "name": "Fake H200", "count": 1}

    def versions(self):
        return {"torch": "2.11.0", "megatron-core": "0.16.1"}

    def train(self, cfg, rollouts):
        self.calls.append(("train", cfg, rollouts))
        return {"steps": cfg.run.max_steps, "tokens_per_s": 1234.5,
                "peak_memory_bytes": 7 * 2**30, "loss": [1.0, float("nan")]}

    def memory(self, cfg, rollouts, work_dir):
        self.calls.append(("memory", cfg, rollouts))
        return {"rows": [{"step": 1, "rank": 0, "ratio": 0.98}], "worst_ratio": 0.98,
                "within_10_percent": True}

    def calibrate(self, cfg, **sweep):
        self.calls.append(("calibrate", cfg, sweep))
        if self.fail_calibrate:
            raise RuntimeError("the sweep broke")
        return {"coefficients": dict(COEFFS), "heldout_r2": float("nan")}

    def rl_iteration(self, rl_loop, cfg, work_dir, *, prompts):
        self.calls.append(("rl", rl_loop, cfg, prompts))
        return {"iterations": 1, "result": rl_loop(cfg, prompts)}


NO_EXTRAS = types.SimpleNamespace()  # a varbatch_kit.train without rl_loop


def _run(tmp_path, *extra, bench=None, **kw):
    out = tmp_path / "report.json"
    bench = bench or FakeBench()
    rc = main(["--out", str(out), "--model", "toy", "--device", "cpu", *extra], bench=bench,
              **kw)
    return rc, (json.loads(out.read_text()) if out.is_file() else None), bench


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(("argv", "message"), [
    ([], "the following arguments are required: --out"),
    (["--out", "r.json", "--steps", "0"], "--steps: '0': give an integer >= 1"),
    (["--out", "r.json", "--steps", "two"], "--steps: 'two': give an integer >= 1"),
    (["--out", "r.json", "--device", "tpu"], "--device: invalid choice: 'tpu'"),
    (["--out", "r.json", "--wheels", "no/such/dir"], "--wheels no/such/dir: no such directory"),
    (["--out", ".", "--model", "toy"], "--out .: a directory"),
])
def test_bad_arguments_exit_2_with_a_message(capsys, argv, message):
    assert main(argv, bench=FakeBench()) == 2
    assert message in capsys.readouterr().err


def test_a_device_that_cannot_measure_is_an_argument_error(tmp_path, capsys):
    rc, report, _ = _run(tmp_path, bench=FakeBench(ok=False))
    assert rc == 2 and report is None
    assert "--device cpu: no CUDA device here" in capsys.readouterr().err


def test_real_bench_refuses_cuda_without_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert main(["--out", str(tmp_path / "r.json"), "--model", "toy"]) == 2
    assert "--device cuda: no CUDA device here" in capsys.readouterr().err


def test_model_source(tmp_path):
    assert model_source("toy", None) == ("toy", None)
    assert model_source("smollm2", None, gguf_installed=True) == ("gguf", None)
    (tmp_path / "smollm2").mkdir()
    with pytest.raises(ValueError, match=r"smollm2 holds no config.json; run `make gpu-wheels`"):
        model_source("smollm2", str(tmp_path), gguf_installed=False)
    with pytest.raises(ValueError, match="no --wheels given"):
        model_source("smollm2", None, gguf_installed=False)
    (tmp_path / "smollm2" / "config.json").write_text("{}")
    assert model_source("smollm2", str(tmp_path), gguf_installed=False) == (
        "files", tmp_path / "smollm2")


# ----------------------------------------------------------------------------- the report
def test_the_report_holds_the_measurements_and_the_skipped_parts(tmp_path):
    rc, report, bench = _run(tmp_path, "--steps", "2", config_cls=TrainConfig,
                             train_pkg=NO_EXTRAS)
    assert rc == 0 and report["status"] == "ok" and report["failed"] == []
    assert report["tokens_per_s"] == 1234.5 and report["peak_memory_bytes"] == 7 * 2**30
    assert report["cost_model"] == COEFFS and report["memory_worst_ratio"] == 0.98
    assert report["parts"]["memory"]["within_10_percent"] is True
    assert report["versions"] == {"status": "ok", "torch": "2.11.0", "megatron-core": "0.16.1"}
    assert report["device"]["name"] == "Fake H200"
    parts = report["parts"]
    assert parts["train"]["precision"] == "fp32" and parts["train"]["loss"] == [1.0, None]
    assert parts["calibrate"]["heldout_r2"] is None  # NaN is written as null: strict JSON
    if not has_config_field("precision"):
        assert parts["train_bf16"] == {"status": SKIPPED,
                                       "reason": "TrainConfig has no precision field"}
    assert parts["rl_loop"] == {"status": SKIPPED, "reason": "varbatch_kit.train has no rl_loop"}
    assert "rl_loop: skipped: not available in this version (varbatch_kit.train has no " \
           "rl_loop)" in report["skipped"]
    # what the engine was asked to do: dp 1, the steps asked for, on the device asked for
    trains = [c for c in bench.calls if c[0] == "train"]
    (_, cfg, rollouts) = trains[0]
    if has_config_field("precision"):  # the same steps again in bf16
        assert [c[1].precision for c in trains] == ["fp32", "bf16"]
        assert parts["train_bf16"]["precision"] == "bf16"
    else:
        assert len(trains) == 1
    assert (cfg.world_size, cfg.run.max_steps, cfg.run.device, cfg.model.path) == (
        1, 2, "cpu", None)
    assert rollouts.num_rollouts == cfg.schedule.global_batch_size * 2
    assert report["args"] == {"steps": 2, "quick": False, "device": "cpu", "model": "toy",
                              "wheels": None}


def test_quick_defaults_to_three_steps(tmp_path):
    _, report, _ = _run(tmp_path, "--quick", train_pkg=NO_EXTRAS)
    assert report["args"]["steps"] == 3 and report["parts"]["train"]["steps"] == 3


def test_a_failing_part_is_recorded_and_the_others_still_run(tmp_path):
    rc, report, _ = _run(tmp_path, bench=FakeBench(fail_calibrate=True), train_pkg=NO_EXTRAS)
    assert rc == 1 and report["status"] == "failed" and report["failed"] == ["calibrate"]
    cal = report["parts"]["calibrate"]
    assert cal["status"] == "failed" and cal["error"] == "RuntimeError: the sweep broke"
    assert "Traceback" in cal["traceback"]
    assert report["cost_model"] is None  # never filled in
    assert report["parts"]["train"]["status"] == "ok" and report["tokens_per_s"] == 1234.5


# ----------------------------------------------------------------------------- skip logic
@dataclasses.dataclass(frozen=True)
class _Run:
    device: str = "cpu"


@dataclasses.dataclass(frozen=True)
class _RunWithPrecision:
    precision: str = "fp32"


@dataclasses.dataclass(frozen=True)
class _ConfigWithout:
    mode: str = "x"
    run: _Run = dataclasses.field(default_factory=_Run)


@dataclasses.dataclass(frozen=True)
class _ConfigWith:
    run: _RunWithPrecision = dataclasses.field(default_factory=_RunWithPrecision)


def test_has_config_field_looks_into_the_sub_configs():
    assert has_config_field("lr") and has_config_field("mode") and has_config_field("device")
    assert not has_config_field("no_such_field")
    assert has_config_field("precision", _ConfigWith)
    assert not has_config_field("precision", _ConfigWithout)
    assert has_config_field("device", _ConfigWithout)


def test_availability_names_what_is_missing():
    assert availability(_ConfigWithout, NO_EXTRAS) == {
        "train_bf16": "TrainConfig has no precision field",
        "rl_loop": "varbatch_kit.train has no rl_loop"}
    assert availability(_ConfigWith, types.SimpleNamespace(rl_loop=lambda *a: None)) == {
        "train_bf16": None, "rl_loop": None}
    import varbatch_kit.train as train_pkg

    real = availability()
    assert (real["rl_loop"] is None) == hasattr(train_pkg, "rl_loop")
    assert (real["train_bf16"] is None) == has_config_field("precision", TrainConfig)


def test_available_parts_run_and_are_never_faked(tmp_path):
    """rl_loop present: it runs. bf16 announced by the config but refused by the engine's
    TrainConfig: recorded as failed with the engine's error, not as a result."""
    seen = []
    pkg = types.SimpleNamespace(rl_loop=lambda cfg, prompts: seen.append(prompts) or "3 iters")
    rc, report, bench = _run(tmp_path, config_cls=_ConfigWith, train_pkg=pkg)
    assert report["parts"]["rl_loop"] == {"status": "ok", "iterations": 1, "result": "3 iters"}
    assert seen == [8]
    bf16 = report["parts"]["train_bf16"]
    if has_config_field("precision", TrainConfig):  # this version has bf16: it ran
        assert bf16["status"] == "ok" and bf16["precision"] == "bf16"
    else:
        assert bf16["status"] == "failed" and "precision" in bf16["error"]
        assert rc == 1 and "train_bf16" in report["failed"]


# ----------------------------------------------------------------------------- the real backend
def test_the_engine_bench_trains_on_the_cpu():
    """The measurement backend the GPU runs, here on the CPU with the toy GPT: per-step
    tokens and times from the training loop, tokens/s from the steps after the first."""
    from varbatch_kit.train import ModelConfig
    from varbatch_kit.train.measure.device_bench import EngineBench

    cfg, rollouts, _ = gpu_check.check_plan(ModelConfig(), model="toy", steps=2, quick=True,
                                            device="cpu")
    got = EngineBench("cpu").train(cfg, rollouts)
    assert got["steps"] == 2 and len(got["tokens"]) == 2 and got["peak_memory_bytes"] is None
    assert got["tokens_per_s"] == pytest.approx(got["tokens"][1] / got["step_time_s"][1])
    assert all(t > 0 for t in got["tokens"]) and got["parameters"] > 0


def test_the_engine_bench_compares_predicted_and_measured_memory_on_the_cpu(tmp_path):
    """The GPU check's memory part, here on the CPU (live tensor bytes): every rank of every
    step predicted within 10 %."""
    from varbatch_kit.train import ModelConfig
    from varbatch_kit.train.measure.device_bench import EngineBench

    cfg, rollouts, _ = gpu_check.check_plan(ModelConfig(), model="toy", steps=2, quick=True,
                                            device="cpu")
    got = EngineBench("cpu").memory(cfg, rollouts, tmp_path / "memory")
    assert len(got["rows"]) == 2 and got["within_10_percent"], got
    assert abs(got["worst_ratio"] - 1) <= 0.10


# ----------------------------------------------------------------------------- make gpu-wheels
def test_the_gpu_wheel_pins_cover_the_train_extra_except_torch():
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["train"]
    reqs = {Requirement(r).name: Requirement(r) for r in extra}
    make = (REPO / "Makefile").read_text()
    pins_text = re.search(r"^GPU_WHEEL_PINS := ((?:.*\\\n)*.*)$", make, re.M).group(1)
    pins = dict(p.split("==") for p in pins_text.replace("\\\n", " ").split())
    assert set(pins) == set(reqs) - {"torch"}
    assert pins["megatron-core"] == "0.16.1"
    for name, version in pins.items():
        assert reqs[name].specifier.contains(version), (name, version, reqs[name])


# ----------------------------------------------------------------------------- the script
@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_script_parses_and_its_dry_run_prints_the_steps(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    wheels = tmp_path / "wheels"
    got = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--wheels", str(wheels), "--out",
                          str(tmp_path / "r.json"), "--steps", "2", "--quick"],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                             "PYTHON": sys.executable})
    assert got.returncode == 0, got.stderr
    lines = [x for x in got.stdout.splitlines() if x.startswith("+ ")]
    assert lines[1] == (f"+ {sys.executable} -m pip install -q --no-index --no-deps --no-compile "
                        f"--no-cache-dir --upgrade --target /tmp/varbatch_kit_gpu_site "
                        f"{wheels}/*.whl")
    assert lines[-1] == (f"+ timeout 480 {sys.executable} -W ignore::DeprecationWarning -m "
                         f"varbatch_kit.cli.gpu_check --out {tmp_path / 'r.json'} --wheels "
                         f"{wheels} --steps 2 --quick")
    assert not (tmp_path / "r.json").exists() and not wheels.exists()  # nothing ran


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps '0': give an integer >= 1"),
    (["--bogus"], "unknown argument '--bogus'"),
    (["--wheels"], "--wheels needs a folder"),
    (["--wheels", "/no/such/folder"], "--wheels /no/such/folder: no such folder"),
])
def test_the_script_refuses_bad_arguments(argv, message):
    got = subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True)
    assert got.returncode == 2 and message in got.stderr
