"""A closed on-policy RL loop: generate -> score -> schedule -> train -> export -> regenerate.

:func:`rl_loop` runs ``iterations`` rounds of:

1. **generate** with the current weights (``transformers`` on CPU or CUDA,
   :func:`~varbatch_kit.train.rl.generate.generate_rollouts`: arithmetic questions,
   exact-match rewards), recording the generator's log-probability of every
   sampled token (``rollout_log_probs``);
2. **score**: the engine turns the rewards into advantages as ``TrainConfig.loss``
   says (generation records rewards and prompt groups, no advantages);
3. **schedule and train**: the batch goes to the loop's one trainer
   (:class:`~varbatch_kit.train.runs.loop_trainer.LoopTrainer`: torchrun workers started
   at the first batch and kept up to the last, one model, one optimizer whose Adam moments
   and step count go on, one LR schedule over every batch, as slime's actor): the schedule
   of the batch (variable global batch size: a step holds ``global_batch_size`` rollouts,
   each of one or two samples), its log-prob pass (old log-probs, with the trainer's
   current weights), then its steps, numbered on from the last batch's;
4. **export** the weights after the batch's last step as a Hugging Face checkpoint
   (:func:`~varbatch_kit.train.model.hf_export.export_hf`) and check the sync: the
   export read back through the loader equals the trainer's weights bitwise;
5. **reload the generator** from that export for the next round.

``mode="async"`` (slime's ``train_async.py``): batch ``k + 1`` is generated (here, in this
process) while the trainer (its own processes) trains batch ``k``, so it comes from the
weights before batch ``k``: one rollout batch of policy lag, paid for with staleness, which
the per-step ``policy_lag``, ``ppo_kl``, ``train_rollout_logprob_abs_diff`` and (with
``loss.use_tis``) the TIS weights show. ``train_s`` is then only what generation did not hide.

Each iteration logs its reward mean, response lengths, samples per step, the
steps the batch took and the trainer's step numbers, ``ppo_kl``, the clip fraction, the
train-vs-rollout log-prob difference, and the hash of the weights the generator used (and
of those the trainer produced); each step its ``policy_lag``: the optimizer steps between
the generator's weights and the weights the step starts from (:class:`RLLoopResult`).

Iteration 0's generator is the trainer's initial model exported the same way
(for a truncated model, ``num_layers`` < the checkpoint's, that is the only
generator that samples from the policy being trained); the trainer starts from it, and it
stays the reference model of a KL loss for the whole loop.

Resumable: every finished iteration leaves ``iterNN/record.json`` and its
export; ``resume=True`` continues after the last finished one: generation is
seeded by ``(seed, iteration)``, so an unfinished iteration regenerates the same rollouts
(checked against the batch the trainer was given), and the trainer resumes from its newest
checkpoint (``config.checkpoint.save_every``; without one it trains every batch again), so a
killed loop ends with the weights of one that was not, bitwise on the CPU.

Your task (:mod:`varbatch_kit.train.rl.task`): ``prompts`` is a number of seeded
arithmetic questions per iteration, a list of
:class:`~varbatch_kit.train.rl.task.Problem`, or a JSONL file (slime's
``--prompt-data``, read with ``input_key`` / ``label_key``); ``reward`` a function with
slime's custom-RM signature (``--custom-rm-path``; ``group_reward``: ``--group-rm``), by
default the arithmetic task's exact match. ``dynamic_sampling_filter`` (slime's
``--dynamic-sampling-filter-path``; ``"nonzero_std"``: DAPO's) drops prompt groups, and
generation goes on in rounds of ``over_sampling_batch_size`` prompts until
``rollout_batch_size`` groups are kept (:mod:`varbatch_kit.train.rl.dynamic_sampling`), so
the samples per step vary with what the filter kept; each iteration logs the groups
generated, kept and dropped (with the reasons). A list or file of prompts is drawn from in
order, cyclically, where the last iteration stopped.

It does nothing silently: an iteration whose advantages are all zero (nothing to learn:
every group's rewards equal) and one whose training left the weights unchanged are counted,
and the loop warns once for each, with the iterations, when it ends.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from varbatch_kit.checks import positive_int

__all__ = ["RLLoopResult", "rl_loop", "weights_hash"]

#: the per-step metrics an iteration averages (when the run reports them)
STEP_METRICS = ("loss", "pg_loss", "ppo_kl", "pg_clipfrac", "train_rollout_logprob_abs_diff",
                "entropy_loss", "grad_norm", "kl_loss", "ois", "tis", "tis_clipfrac", "tis_abs",
                "lr")
#: the loop's modes: generation one rollout batch behind training or not
MODES = ("sync", "async")


def weights_hash(state: dict) -> str:
    """A short SHA-256 of a state dict's names, dtypes, shapes and bytes (sorted by name)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class RLLoopResult:
    """What :func:`rl_loop` measured: one row per iteration and one per training step.

    ``iterations`` (pandas): iteration, generator_hash (the weights that generated),
    trained_hash (the weights after training, which generate next), sync_exact, reward_mean,
    response_len_mean / _max, rollouts, samples, steps (steps the rollout batch took),
    samples_per_step, the step metrics' means (ppo_kl, pg_clipfrac,
    train_rollout_logprob_abs_diff, ...), and wall times. ``steps`` (pandas): one row per
    training step with its iteration, ``policy_lag`` (optimizer steps between the
    generator's weights and the weights this step starts from) and its metrics.
    ``exports``: the generator checkpoint of each iteration, then the last export.
    """

    iterations: Any
    steps: Any
    exports: list[Path] = field(default_factory=list)
    out_dir: Path | None = None

    def __repr__(self) -> str:
        return f"RLLoopResult({len(self.iterations)} iterations, out_dir={str(self.out_dir)!r})"


def _check(config, iterations, prompts) -> None:
    from varbatch_kit.train.config.train_config import TrainConfig

    if not isinstance(config, TrainConfig):
        raise ValueError(f"config={config!r}: give a TrainConfig")  # noqa: TRY004
    if config.model.path is None:
        raise ValueError("config.model.path=None: the RL loop generates with transformers and "
                         "exports the trained weights back, so it needs a Hugging Face "
                         "checkpoint (ModelConfig(path=DIR), e.g. smollm2_checkpoint())")
    positive_int("iterations", iterations)
    if not (isinstance(prompts, int) and not isinstance(prompts, bool) and prompts > 0) \
            and not (isinstance(prompts, (list, tuple)) and prompts) \
            and not isinstance(prompts, (str, Path)):
        raise ValueError(f"prompts={prompts!r}: give a number of questions per iteration "
                         "(> 0), a non-empty list of task.Problem or a JSONL file")


class _PromptSource:
    """The prompts of the loop: seeded arithmetic questions (``prompts`` an int), or a list /
    file drawn from in order, cyclically, from ``cursor`` on."""

    def __init__(self, prompts, seed: int, input_key: str, label_key: str | None) -> None:
        from varbatch_kit.train.rl.task import Problem, read_prompts

        self.seed, self.cursor = seed, 0
        if isinstance(prompts, int):
            self.rows, self.batch = None, prompts
            return
        rows = (read_prompts(prompts, input_key=input_key, label_key=label_key)
                if isinstance(prompts, (str, Path)) else list(prompts))
        if not all(isinstance(p, Problem) for p in rows):
            raise ValueError("prompts: a list of task.Problem(question, answer)")
        self.rows, self.batch = rows, len(rows)

    def draw(self, count: int, iteration: int, round_: int) -> list:
        """The next ``count`` prompts (round ``round_`` of iteration ``iteration``)."""
        from varbatch_kit.train.rl.generate import arithmetic_problems

        if self.rows is None:
            return arithmetic_problems(count, seed=self.seed + 1000 * iteration
                                       + 100_003 * round_)
        out = [self.rows[(self.cursor + i) % len(self.rows)] for i in range(count)]
        self.cursor = (self.cursor + count) % len(self.rows)
        return out


def _initial_generator(resolved, out: Path) -> Path:
    """The trainer's initial weights (the first ``num_layers`` layers) as a checkpoint."""
    from varbatch_kit.train.model.hf_export import export_hf
    from varbatch_kit.train.model.hf_import import megatron_state_dict

    if (out / "config.json").is_file():
        return out
    return export_hf(megatron_state_dict(resolved.hf, resolved.num_layers), resolved, out,
                     overwrite=True)


def _loader_view(export_dir: Path) -> dict:
    """The export read back as the engine's loader reads a checkpoint (megatron names)."""
    from varbatch_kit.train.config.hf_checkpoint import read_hf_model
    from varbatch_kit.train.model.hf_import import megatron_state_dict

    return megatron_state_dict(read_hf_model(export_dir))


def _sync_exact(trained: dict, exported: dict) -> bool:
    import torch

    names = set(exported)
    if not names <= set(trained):
        return False
    return all(torch.equal(exported[n], trained[n].to(exported[n].dtype)) and
               trained[n].dtype == exported[n].dtype for n in names)


def rl_loop(config, prompts, *, iterations: int = 2, out_dir, n_samples_per_prompt: int = 4,
            turns: int = 2, follow_up: str = "if_wrong", max_new_tokens: int = 8,
            seed: int = 0, device: str = "auto", resume: bool = False,
            progress: bool = True, reward=None, group_reward: bool = False,
            dynamic_sampling_filter=None, rollout_batch_size: int | None = None,
            over_sampling_batch_size: int | None = None, system_prompt: Any = "arithmetic",
            example: Any = "arithmetic", input_key: str = "input",
            label_key: str | None = "label", mode: str = "sync") -> RLLoopResult:
    """Run ``iterations`` rounds of generate -> train -> export (see the module docstring).

    ``config``: the :class:`~varbatch_kit.train.TrainConfig` of the loop's trainer
    (its ``model.path`` a Hugging Face checkpoint, ``num_layers`` optional; the
    sampling temperature is ``config.loss.rollout_temperature``; its
    ``data.n_samples_per_prompt`` is set to ``n_samples_per_prompt``). ``prompts``:
    questions per iteration (seeded anew each iteration) or a fixed list of
    :class:`~varbatch_kit.train.rl.task.Problem`. ``turns`` / ``follow_up``: as in
    :func:`~varbatch_kit.train.rl.generate.generate_rollouts` (``"if_wrong"``: a rollout
    emits one or two samples, so steps of a fixed number of rollouts vary in
    samples). ``device``: where the generator runs (``auto``: CUDA when available);
    training uses ``config.run.device``. ``out_dir``: one folder per iteration
    (``iterNN/``: generator, rollouts trace, run, export, record.json).

    ``prompts`` may also be a JSONL file (``input_key`` / ``label_key``, as slime's
    ``--input-key`` / ``--label-key``). ``reward`` / ``group_reward``: the reward function
    (slime's custom-RM signature, a callable or ``"module.func"``; default the exact match
    of the arithmetic task). ``dynamic_sampling_filter``: a group filter with slime's
    signature, ``"nonzero_std"`` (DAPO) or None; ``rollout_batch_size``: prompt groups per
    iteration (default: ``prompts`` if a number, else the list's length);
    ``over_sampling_batch_size``: prompts generated per round (default
    ``rollout_batch_size``). ``system_prompt`` / ``example``: the chat before each question
    (``"arithmetic"``: the arithmetic task's; None: none). ``mode``: ``"sync"`` or
    ``"async"`` (generation one batch behind, overlapping training). The trainer's LR
    schedule spans ``iterations`` batches (their rollouts; with an LR counted in samples, at
    most ``turns`` a rollout), its ``run.timeout_s`` bounds each iteration. See the module
    docstring.
    """
    import pandas as pd

    from varbatch_kit.core.traces import write_trace
    from varbatch_kit.train.config.model_config import resolve_model
    from varbatch_kit.train.model.hf_export import export_hf
    from varbatch_kit.train.rl import generate as gen
    from varbatch_kit.train.rl.dynamic_sampling import collect_groups
    from varbatch_kit.train.rl.generate import GenerationStats, generate_rollouts, load_model
    from varbatch_kit.train.rl.task import FILTERS, resolve_function, slime_args
    from varbatch_kit.train.runs.loop_trainer import LoopTrainer
    from varbatch_kit.train.runs.run_export import saved_weights

    _check(config, iterations, prompts)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: give one of {MODES} ('sync': each batch generated "
                         "with the weights the last one trained; 'async': generated while the "
                         "last one trains, one batch behind, as slime's train_async.py)")
    positive_int("n_samples_per_prompt", n_samples_per_prompt)
    source = _PromptSource(prompts, seed, input_key, label_key)
    batch = source.batch if rollout_batch_size is None else rollout_batch_size
    positive_int("rollout_batch_size", batch)
    over = batch if over_sampling_batch_size is None else over_sampling_batch_size
    positive_int("over_sampling_batch_size", over)
    reward_fn = resolve_function(reward, "reward")
    if isinstance(dynamic_sampling_filter, str) and "." not in dynamic_sampling_filter \
            and dynamic_sampling_filter not in FILTERS:
        raise ValueError(f"dynamic_sampling_filter={dynamic_sampling_filter!r}: give one of "
                         f"{sorted(FILTERS)}, a 'module.function' path or a callable")
    group_filter = resolve_function(FILTERS.get(dynamic_sampling_filter, dynamic_sampling_filter)
                                    if isinstance(dynamic_sampling_filter, str)
                                    else dynamic_sampling_filter, "dynamic_sampling_filter")
    chat = dict(system_prompt=gen.SYSTEM_PROMPT if system_prompt == "arithmetic"
                else system_prompt, example=gen.EXAMPLE if example == "arithmetic" else example)
    args = slime_args(n_samples_per_prompt=n_samples_per_prompt, rollout_batch_size=batch,
                      over_sampling_batch_size=over, group_rm=bool(group_reward),
                      rollout_max_response_len=max_new_tokens)
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()) and not resume:
        raise ValueError(f"out_dir={str(out)!r} is not empty: give a new folder, or "
                         "resume=True to continue the loop it holds")
    out.mkdir(parents=True, exist_ok=True)
    lag = MODES.index(mode)  # rollout batches between a batch's generator and its trainer
    resolved = resolve_model(config.model)
    temperature = config.loss.rollout_temperature
    generator0 = _initial_generator(resolved, out / "iter00" / "generator")
    # one trainer for the whole loop, from generator 0's weights (the truncated model when
    # num_layers is set); its LR schedule spans every batch (rollouts; samples: at most
    # `turns` a rollout)
    per_batch = batch * n_samples_per_prompt
    unit = config.lr_increment_unit()
    horizon = iterations * per_batch * (turns if unit == "samples" else 1)
    trainer_cfg = config.with_(path=str(generator0), num_layers=None,
                               n_samples_per_prompt=n_samples_per_prompt, label="rl_loop",
                               timeout_s=config.run.timeout_s * (iterations + 1))
    trainer = LoopTrainer(trainer_cfg, out / "trainer", horizon=horizon, resume=resume)
    exports, records, step_rows = [generator0], [], []
    generated: dict[int, dict] = {}  # batches generated, not yet recorded
    last_steps: dict[int, int] = {}  # the trainer's last step after each batch

    def source_batch(j: int) -> int:  # the batch whose weights generate batch j (-1: initial)
        return j - 1 - lag  # sync: the last batch; async: the one before

    def generator_of(j: int) -> Path:
        return generator0 if source_batch(j) < 0 else Path(exports[source_batch(j) + 1])

    def generate_batch(j: int) -> None:  # batch j, with its generator's weights; then put
        generator = generator_of(j)
        gen_hash = weights_hash(_loader_view(generator))
        t0 = time.perf_counter()
        model, tokenizer = load_model(generator, device=device)
        stats = GenerationStats()

        def generate(count, round_, model=model, tokenizer=tokenizer):
            part = GenerationStats()
            rolled = generate_rollouts(
                model, tokenizer=tokenizer, problems=source.draw(count, j, round_),
                n_samples_per_prompt=n_samples_per_prompt, turns=turns,
                follow_up=follow_up, max_new_tokens=max_new_tokens,
                temperature=temperature, seed=seed + j + 7919 * round_, progress=False,
                stats=part, rollout_log_probs=True, reward=reward_fn,
                group_reward=group_reward, reward_args=args, **chat)
            stats.generated_tokens += part.generated_tokens
            return rolled

        rollouts, sampling = collect_groups(
            generate, batch_size=batch, n_samples_per_prompt=n_samples_per_prompt,
            over_sampling_batch_size=over, group_filter=group_filter, args=args)
        del model
        it_dir = out / f"iter{j:02d}"
        it_dir.mkdir(parents=True, exist_ok=True)
        write_trace(rollouts, it_dir / "rollouts.jsonl", extra=True)
        trainer.put(j, rollouts)  # the trainer takes it when it is done with the one before
        generated[j] = dict(rollouts=rollouts, sampling=sampling, stats=stats,
                            generator=generator, gen_hash=gen_hash,
                            gen_s=time.perf_counter() - t0, cursor=source.cursor)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=iterations, desc=f"RL loop ({mode})", unit="iteration")
    try:
        for k in range(iterations):
            it_dir = out / f"iter{k:02d}"
            done = it_dir / "record.json"
            if done.is_file():  # finished before: resume after it
                rec = json.loads(done.read_text())
                source.cursor = rec["iteration"].get("prompt_cursor", 0)
                records.append(rec["iteration"])
                step_rows += rec["steps"]
                exports.append(Path(rec["iteration"]["export"]))
                last_steps[k] = int(rec["iteration"]["last_step"])
                if bar is not None:
                    bar.update(1)
                continue
            # 1. generate batch k (unless generated while batch k - 1 trained), and under
            # async batch k + 1 too, from the weights before batch k: it generates while
            # the trainer trains batch k
            for j in range(k, min(k + lag, iterations - 1) + 1):
                if j not in generated:
                    generate_batch(j)
            g = generated.pop(k)
            rollouts, sampling, stats = g["rollouts"], g["sampling"], g["stats"]
            # 2. score (the engine's advantages, TrainConfig.loss) and 3. train: the trainer's
            # next steps, the same model and optimizer
            t1 = time.perf_counter()
            trained_batch = trainer.wait(k)
            train_s = time.perf_counter() - t1
            first, last = int(trained_batch["first_step"]), int(trained_batch["last_step"])
            last_steps[k] = last
            # 4. export, and the sync check: the export as the loader reads it == the trainer's
            t2 = time.perf_counter()
            _, trained = saved_weights(trainer.run_dir, last)
            export = export_hf(trained, resolve_model(trainer_cfg.model), it_dir / "export",
                               overwrite=True)
            exported = _loader_view(export)
            export_s = time.perf_counter() - t2
            step_records = trained_batch["records"]
            metrics = {m: float(np.mean([r[m] for r in step_records]))
                       for m in STEP_METRICS if step_records and m in step_records[0]}
            # the generator's weights: after the trainer's step `born` (0: the initial ones)
            born = 0 if source_batch(k) < 0 else last_steps[source_batch(k)]
            rec = {
                "iteration": k, "mode": mode, "generator_hash": g["gen_hash"],
                "trained_hash": weights_hash(exported),
                "sync_exact": _sync_exact(trained, exported),
                "reward_mean": float(np.mean(rollouts.extra["reward"])),
                "response_len_mean": float(np.mean(rollouts.response_len)),
                "response_len_max": int(np.max(rollouts.response_len)),
                "rollouts": int(rollouts.num_rollouts), "samples": int(len(rollouts)),
                "steps": len(step_records), "first_step": first, "last_step": last,
                "samples_per_step": [int(r["samples"]) for r in step_records],
                # rollout batches trained between the generator's weights and this batch's
                "policy_lag_batches": min(lag, k),
                **metrics,
                # train_s: how long the loop waited for the trainer (sync: the batch's
                # training; async: what generating the next batch did not hide); trainer_s:
                # the trainer's own time on the batch (its log-prob pass and steps)
                "generate_s": g["gen_s"], "train_s": train_s,
                "trainer_s": float(sum(r.get("step_time_s", 0.0) + r.get("log_prob_pass_s", 0.0)
                                       for r in step_records)),
                "export_s": export_s,
                "generated_tokens": int(stats.generated_tokens),
                **sampling.as_dict(), "prompt_cursor": g["cursor"],
                "zero_advantages": _all_advantages_zero(trainer_cfg, rollouts),
                "generator": str(g["generator"]), "export": str(export),
            }
            rows = [{"iteration": k, "step": int(r["step"]),
                     "policy_lag": int(r["step"]) - 1 - born,
                     "samples": int(r["samples"]), "generator_hash": g["gen_hash"],
                     **{m: float(r[m]) for m in STEP_METRICS if m in r}}
                    for r in step_records]
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps({"iteration": rec, "steps": rows}, indent=1))
            tmp.rename(done)  # the iteration is finished once its record exists
            if last not in config.run.save_params_at:  # the export holds the same weights
                Path(trained_batch["params"]).unlink(missing_ok=True)
            records.append(rec)
            step_rows += rows
            exports.append(export)  # 5. the weights the next batches generate with
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{rec['reward_mean']:.2f}")
        trainer.close()
    except BaseException:
        trainer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    _warn_idle(records)
    return RLLoopResult(iterations=pd.DataFrame(records), steps=pd.DataFrame(step_rows),
                        exports=exports, out_dir=out)



def _all_advantages_zero(cfg, rollouts) -> bool:
    """Whether the engine's advantages of the batch (``cfg.loss``'s estimator, as the run
    computes them) are zero on every token: nothing to learn from it."""
    from varbatch_kit.train.data.rollout_advantages import token_advantages
    from varbatch_kit.train.data.rollout_data import make_training_data

    data = make_training_data(rollouts, vocab_size=cfg.resolve_model().vocab_size,
                              seed=cfg.data.seed, data=cfg.data, loss=cfg.loss)
    adv = token_advantages(data, rollouts, loss=cfg.loss, data_cfg=cfg.data)
    return all(float(np.abs(np.asarray(a)).max(initial=0.0)) == 0.0 for a in adv)


def _warn_idle(records: list[dict]) -> None:
    """One warning each, with a count, for iterations with nothing to learn and iterations
    that left the weights unchanged."""
    import warnings

    n = len(records)
    zero = [r["iteration"] for r in records if r.get("zero_advantages")]
    still = [r["iteration"] for r in records if r["trained_hash"] == r["generator_hash"]]
    if zero:
        warnings.warn(f"rl_loop: {len(zero)} of {n} iterations had every advantage zero "
                      f"(iterations {zero}: each prompt group's rewards all equal, so the "
                      "policy gradient is zero): give a reward the model can earn, or a "
                      "dynamic_sampling_filter such as 'nonzero_std'", UserWarning, stacklevel=3)
    if still:
        warnings.warn(f"rl_loop: {len(still)} of {n} iterations left the weights unchanged "
                      f"(iterations {still}: trained hash == generator hash): the loop did not "
                      "learn there", UserWarning, stacklevel=3)
