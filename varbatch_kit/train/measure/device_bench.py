"""Measure the engine on one device, in this process: tokens/s, peak memory, the cost model.

The measurement backend of the GPU check (:mod:`varbatch_kit.cli.gpu_check`,
``scripts/gpu_check.sh``): :class:`EngineBench` trains a configuration at dp 1
with the worker's own training loop (:func:`varbatch_kit.train.runs.worker.train`
inside :func:`~varbatch_kit.train.parallel.process_setup.single_process`, no torchrun), so
``torch.cuda.max_memory_allocated`` of this process is the training's peak; it
calibrates the micro-batch cost model (:func:`varbatch_kit.train.measure.calibration.calibrate`)
on the same device; and it reports the versions. On the CPU the same code runs
(the tests), with no memory figure.

:func:`smollm2_files_checkpoint` writes a SmolLM2 checkpoint from its
``config.json`` (and tokenizer files) with **random** weights, for a machine
that cannot receive the 98 MB GGUF (the device machine takes 64 MiB per call):
speed and memory do not depend on the weights' values, and the report says
which weights were used.
"""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path

__all__ = ["SMOLLM2_FILES", "EngineBench", "copy_smollm2_files", "smollm2_files_checkpoint"]

#: the files of the SmolLM2 checkpoint besides its weights (what ``make gpu-wheels`` copies)
SMOLLM2_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja")


def smollm2_files_checkpoint(files_dir: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """A Hugging Face checkpoint in ``out_dir``: ``files_dir``'s config and tokenizer files,
    weights drawn at random by ``transformers`` from that config (float32, seeded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    files_dir, out_dir = Path(files_dir), Path(out_dir)
    if not (files_dir / "config.json").is_file():
        raise ValueError(f"{files_dir} holds no config.json: give the folder `make gpu-wheels` "
                         "filled (WHEELS/smollm2)")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(str(files_dir))
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for name in SMOLLM2_FILES:
        if name != "config.json" and (files_dir / name).is_file():
            shutil.copy2(files_dir / name, out_dir / name)
    return out_dir


def copy_smollm2_files(dest: Path, models_dir: Path | None = None) -> Path:
    """Copy SmolLM2's config and tokenizer files (not its weights) into ``dest`` (what
    ``make gpu-wheels`` puts in ``WHEELS/smollm2``); the checkpoint is built first if needed
    (:func:`~varbatch_kit.train.model.smollm2.smollm2_checkpoint`, in ``models_dir``, default
    ``$VARBATCH_KIT_MODELS`` or ``build/models``)."""
    import os

    from varbatch_kit.train.model.smollm2 import smollm2_checkpoint

    src = smollm2_checkpoint(models_dir or os.environ.get("VARBATCH_KIT_MODELS", "build/models"))
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in SMOLLM2_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
    return dest


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class EngineBench:
    """The engine measured on ``device`` (``"cuda"`` or ``"cpu"``) in this process."""

    def __init__(self, device: str = "cuda", *, threads: int = 1) -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: give 'cuda' or 'cpu'")
        self.device = device
        self.threads = threads

    # ------------------------------------------------------------------ the machine
    def available(self) -> tuple[bool, str]:
        """Whether this process can measure on the device, and if not why."""
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            return False, ("no CUDA device here (torch.cuda.is_available() is False); the check "
                           "needs a GPU, or --device cpu for the same path on the CPU")
        return True, ""

    def device_info(self) -> dict:
        import torch

        if self.device == "cuda":
            props = torch.cuda.get_device_properties(0)
            return {"type": "cuda", "name": props.name, "count": torch.cuda.device_count(),
                    "memory_bytes": int(props.total_memory),
                    "capability": f"{props.major}.{props.minor}"}
        return {"type": "cpu", "name": platform.processor() or platform.machine(),
                "count": 1, "threads": self.threads}

    def versions(self) -> dict:
        import torch

        from varbatch_kit._version import __version__

        return {"python": platform.python_version(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "megatron-core": _version("megatron-core"),
                "transformers": _version("transformers"), "varbatch_kit": __version__}

    # ------------------------------------------------------------------ measurements
    def train(self, cfg, rollouts) -> dict:
        """Train ``cfg`` (dp 1) on ``rollouts``: per-step tokens, times and losses, tokens/s
        (steps after the first: the first pays for allocation and first calls) and the peak
        memory of the process on CUDA (None on the CPU)."""
        import torch

        from varbatch_kit.train.parallel.process_setup import single_process
        from varbatch_kit.train.runs.plan import plan_runs
        from varbatch_kit.train.runs.step_log import read_records
        from varbatch_kit.train.runs.worker import train

        if cfg.world_size != 1:
            raise ValueError(f"dp*cp*pp*tp={cfg.world_size}: the bench trains one rank "
                             "(dp=cp=pp=tp=1)")
        plan = plan_runs([cfg], rollouts)[0]
        out = Path(tempfile.mkdtemp(prefix="varbatch_bench_"))
        try:
            t0 = time.perf_counter()
            with single_process(self.device, self.threads) as dev:
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(dev)
                train(cfg, plan.model, plan.steps, plan.log_prob_steps, rollouts, out, dev)
                peak = int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None
            wall = time.perf_counter() - t0
            records = read_records(out / "steps.jsonl", warn=False)
            meta = json.loads((out / "meta.json").read_text())
        finally:
            shutil.rmtree(out, ignore_errors=True)
        tokens = [int(r["tokens"]) for r in records]
        times = [float(r["step_time_s"]) for r in records]
        timed = slice(1, None) if len(records) > 1 else slice(None)
        return {"steps": len(records), "tokens": tokens, "step_time_s": times,
                "loss": [float(r["loss"]) for r in records],
                "tokens_per_s": sum(tokens[timed]) / sum(times[timed]),
                "tokens_per_s_counts": "steps after the first" if len(records) > 1
                else "the only step",
                "peak_memory_bytes": peak, "parameters": int(meta["parameters"]),
                "wall_s": wall}

    def memory(self, cfg, rollouts, work_dir: Path) -> dict:
        """The memory model against this device: ``cfg`` trained in torchrun workers with each
        rank's peak recorded (CUDA's allocator peak; on CPU live tensor bytes), beside
        :mod:`varbatch_kit.core.memory`'s prediction for the same schedule, per step and
        rank, and the worst ratio (predicted / measured)."""
        from varbatch_kit.train import run
        from varbatch_kit.train.runs.memory_report import memory_table

        r = run(cfg.with_(track_memory=True, device=self.device), rollouts,
                out_dir=work_dir, progress=False)
        table = memory_table(r, rollouts)
        worst = table.loc[(table["ratio"] - 1).abs().idxmax()]
        return {"rows": [{"step": int(t.step), "rank": int(t.rank),
                          "predicted_bytes": int(t.predicted_bytes),
                          "measured_bytes": int(t.measured_bytes), "ratio": float(t.ratio),
                          "phase": t.peak_phase} for t in table.itertuples()],
                "worst_ratio": float(worst.ratio), "within_10_percent": bool(
                    ((table["ratio"] - 1).abs() <= 0.10).all())}

    def calibrate(self, cfg, **kwargs) -> dict:
        """The cost model fitted on this device (``kwargs``: :func:`calibrate`'s sweep)."""
        from varbatch_kit.train.measure.calibration import calibrate

        cal = calibrate(cfg, device=self.device, threads=self.threads, progress=False, **kwargs)
        return {"coefficients": cal.model.to_dict(), "heldout_r2": cal.fit.heldout_r2,
                "device": cal.info["device"], "compositions": len(cal.measurements),
                "wall_s": cal.info["wall_s"]}

    def rl_iteration(self, rl_loop, cfg, work_dir: Path, *, prompts: int) -> dict:
        """One iteration of ``rl_loop`` (the issue's ``rl_loop(config, prompts, iterations=K)``,
        on :func:`~varbatch_kit.train.rl.generate.arithmetic_problems`), timed."""
        import inspect

        from varbatch_kit.train.rl.generate import arithmetic_problems

        kwargs: dict = {"iterations": 1}
        params = inspect.signature(rl_loop).parameters
        if "out_dir" in params:
            kwargs["out_dir"] = str(work_dir)
        if "device" in params:
            kwargs["device"] = self.device
        t0 = time.perf_counter()
        result = rl_loop(cfg, arithmetic_problems(prompts, seed=0), **kwargs)
        return {"iterations": 1, "prompts": prompts, "wall_s": time.perf_counter() - t0,
                "result": repr(result)[:2000]}
