"""Real rollouts from a small model: integer arithmetic, exact-match rewards, two-turn exchanges.

For notebooks and tests: :func:`generate_rollouts` samples responses from a
Hugging Face causal LM (default: SmolLM2-135M-Instruct,
:func:`varbatch_kit.train.model.smollm2.smollm2_checkpoint`) with ``transformers``'
``generate`` (CPU, or CUDA when available) and returns a
:class:`~varbatch_kit.Rollouts` the training engine trains on directly.

The task
    :func:`arithmetic_problems`: seeded questions "What is 7 + 5?" (``+``
    and ``-`` of integers in ``[1, max_operand]``, never negative). The
    model is prompted through its chat template with a short system prompt
    ("Reply with only the number.") and one worked example. The reward of a
    response is exact match on the **first integer** it contains
    (:func:`first_integer`, :func:`exact_match_reward`): 1.0 or 0.0. It is one
    task: ``problems`` (your prompts and labels), ``reward`` (a function with
    slime's custom-RM signature, :mod:`varbatch_kit.train.rl.task`) and
    ``system_prompt`` / ``example`` make another.

Rollouts and samples
    Every prompt gets ``n_samples_per_prompt`` rollouts (one prompt group,
    ``group_index`` = the prompt's index). With ``turns=2`` a rollout is a
    two-turn exchange: the model answers, is asked "Are you sure? Answer
    again." and answers again. Each turn is one training sample (its prompt
    is the whole conversation so far, its response that turn's tokens), and
    the samples of a rollout share its rollout id, so a rollout emits one or
    two samples: with ``follow_up="if_wrong"`` only rollouts whose first
    answer was wrong get the second turn (a verifier-driven retry; steps of a
    fixed number of rollouts then hold varying numbers of samples), with
    ``"always"`` every rollout does.

Rewards, not advantages
    A rollout's reward is the mean exact-match reward over its turns
    (``turn_reward``); every sample of the rollout carries it as ``reward``,
    and its prompt group as ``group_index``. Generation writes no advantages:
    the training engine turns the rewards into advantages as
    ``TrainConfig.loss`` says (:mod:`varbatch_kit.train.data.rollout_advantages`:
    ``advantage_estimator``, ``"grpo"`` by default; ``advantage_grouping="prompt"``
    normalises per prompt group, ``"slime"`` by slime's rule). Like slime, the
    engine normalises per *sample*: a rollout of two samples counts twice in its
    group's mean and std.

``Rollouts.extra`` columns (one row per sample)
    ``tokens`` (prompt + response token ids), ``reward``,
    ``group_index``, ``turn`` (0-based), ``turn_reward``, ``question``,
    ``answer``, ``response`` (decoded text). ``trace_path=...`` writes them
    as a JSONL / Parquet trace (:func:`varbatch_kit.core.traces.write_trace`
    with ``extra=True``); :func:`varbatch_kit.core.traces.read_trace` reads
    it back for training.

Determinism: every ``generate`` call is seeded from ``(seed, prompt,
turn)``, so on CPU the same arguments give the same tokens, and a prompt's
rollouts do not depend on the other prompts. Responses end at the first
end-of-turn token (kept, it is part of the response the model produced) or
after ``max_new_tokens``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from varbatch_kit.checks import positive_int
from varbatch_kit.core.rollouts import Rollouts
from varbatch_kit.train.rl.task import Problem, resolve_function, score, slime_args

__all__ = [
    "FOLLOW_UP",
    "GenerationStats",
    "SYSTEM_PROMPT",
    "answer_and_format_reward",
    "arithmetic_problems",
    "exact_match_reward",
    "first_integer",
    "generate_rollouts",
    "load_model",
]

SYSTEM_PROMPT = "Reply with only the number."
#: one worked example shown before every question (the chat's first exchange)
EXAMPLE = ("What is 2 + 3?", "5")
FOLLOW_UP = "Are you sure? Answer again."
FOLLOW_UPS = ("always", "if_wrong")

_INT = re.compile(r"[-\u2212]?\d+")


@dataclass
class GenerationStats:
    """What a :func:`generate_rollouts` call did (pass ``stats=GenerationStats()`` to get it)."""

    prompts: int = 0
    rollouts: int = 0
    samples: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    device: str = "cpu"

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else float("nan")


def arithmetic_problems(n: int, *, seed: int = 0, max_operand: int = 9,
                        ops: tuple[str, ...] = ("+", "-")) -> list[Problem]:
    """``n`` seeded questions "What is a + b?" / "What is a - b?" with ``1 <= a, b <= max_operand``.

    Subtractions put the larger operand first (answers are never negative).
    """
    positive_int("n_prompts", n, whole_floats=True)
    positive_int("max_operand", max_operand, whole_floats=True)
    bad = [o for o in ops if o not in ("+", "-")]
    if not ops or bad:
        raise ValueError(f"ops={ops!r}: choose from '+' and '-'")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 7919]))
    out = []
    for _ in range(int(n)):
        a, b = (int(v) for v in rng.integers(1, int(max_operand) + 1, size=2))
        op = ops[int(rng.integers(len(ops)))]
        if op == "-":
            a, b = max(a, b), min(a, b)
        out.append(Problem(f"What is {a} {op} {b}?", a + b if op == "+" else a - b))
    return out


def first_integer(text: str) -> int | None:
    """The first integer in ``text`` (an optional leading minus sign), or None.

    >>> first_integer("The answer is 42."), first_integer("-3, not 3"), first_integer("none")
    (42, -3, None)
    """
    m = _INT.search(text)
    return None if m is None else int(m.group().replace("\u2212", "-"))


def exact_match_reward(response: str, answer: int) -> float:
    """1.0 when the first integer of ``response`` equals ``answer``, else 0.0."""
    value = first_integer(response)
    return float(value is not None and value == int(answer))


#: a response that is one integer and nothing else (an optional final period, spaces)
_BARE = re.compile(r"^\s*[-\u2212]?\d+\s*\.?\s*$")


def answer_and_format_reward(args, sample, **kwargs) -> float:
    """The arithmetic task's reward with a format term, slime's custom-RM signature
    (``--custom-rm-path varbatch_kit.train.rl.generate.answer_and_format_reward``): 0.75 for
    the right answer (:func:`exact_match_reward` on ``sample.response`` against
    ``sample.label``) plus 0.25 when the response is the number alone, as the system prompt
    asks. A denser signal than the exact match for a small model that is mostly wrong: the
    format is learnt first (the learning benchmark, ``benchmarks/rl_learning.py``).

    >>> from varbatch_kit.train.rl.task import Sample
    >>> [answer_and_format_reward(None, Sample(0, 0, "", r, label=5))
    ...  for r in ("5", "5.", "It is 5.", "4", "It is 4.")]
    [1.0, 1.0, 0.75, 0.25, 0.0]
    """
    text = sample.response
    return 0.75 * exact_match_reward(text, sample.label) + 0.25 * bool(_BARE.match(text))


# --------------------------------------------------------------------------- the model
def _device(device: str) -> str:
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r}; choose 'auto', 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(path: str | Path | None = None, *, device: str = "auto"):
    """``(model, tokenizer)`` from a Hugging Face checkpoint directory (default: SmolLM2).

    float32, eval mode, on ``device`` (``auto``: CUDA when available).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None:
        from varbatch_kit.train.model.smollm2 import smollm2_checkpoint

        path = smollm2_checkpoint()
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model={str(path)!r} is not a Hugging Face checkpoint directory "
                         "(no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.to(_device(device)).eval(), tokenizer


def _messages(problem: Problem, turns: list[str], system: str | None = SYSTEM_PROMPT,
              example: tuple[str, str] | None = EXAMPLE) -> list[dict[str, str]]:
    """The chat so far: system prompt, the worked example (each when given), the question,
    earlier answers."""
    msgs = [] if system is None else [{"role": "system", "content": system}]
    if example is not None:
        msgs += [{"role": "user", "content": example[0]},
                 {"role": "assistant", "content": example[1]}]
    msgs.append({"role": "user", "content": problem.question})
    for answer in turns:
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    return msgs


def _prompt(tokenizer, messages) -> tuple[str, list[int]]:
    """The chat as text (the template applied, generation prompt added) and its token ids."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _task_sample(rollout_id: int, group: int, prompt_text: str, prompt: list[int],
                 response: list[int], text: str, problem: Problem):
    """A response as the reward function sees it (:class:`~varbatch_kit.train.rl.task.Sample`)."""
    from varbatch_kit.train.rl.task import Sample

    return Sample(index=rollout_id, group_index=group, prompt=prompt_text, response=text,
                  label=problem.answer, metadata=dict(problem.metadata),
                  tokens=list(prompt) + list(response), response_length=len(response))


def _exact_match(args, sample) -> float:
    """The arithmetic task's reward with slime's reward signature: exact match of the first
    integer of the response against the label."""
    return exact_match_reward(sample.response, sample.label)


def _stop_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def _seed(seed: int, prompt: int, turn: int) -> int:
    return int(np.random.SeedSequence([int(seed), int(prompt), int(turn)]).generate_state(1)[0])


def _sample(model, tokenizer, prompts: list[list[int]], *, seed: int, temperature: float,
            max_new_tokens: int, stop: set[int], log_probs: list | None = None
            ) -> list[list[int]]:
    """One seeded ``generate`` over left-padded prompts; each response cut after its stop token.

    ``log_probs`` (a list): receives, per response, the generator's log-probability of each
    sampled token under the distribution it was sampled from (``log_softmax(logits /
    temperature)``: plain temperature sampling, no top-k / top-p), float64.
    """
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), int(pad), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0,
                             max_new_tokens=int(max_new_tokens), pad_token_id=int(pad),
                             eos_token_id=sorted(stop), return_dict_in_generate=True,
                             output_scores=log_probs is not None)
    new_tokens = out.sequences[:, width:]
    if log_probs is not None:  # scores: per new token [rows, vocab], the logits / temperature
        scores = torch.stack(out.scores, dim=1).double()  # [rows, new tokens, vocab]
        chosen = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens[..., None])[..., 0]
    responses = []
    for r, row in enumerate(new_tokens.tolist()):
        cut = next((j + 1 for j, t in enumerate(row) if t in stop), len(row))
        responses.append(row[:cut])
        if log_probs is not None:
            log_probs.append(chosen[r, :cut].cpu().numpy())
    return responses


def generate_rollouts(
    model: Any = None,
    *,
    tokenizer: Any = None,
    n_prompts: int = 4,
    n_samples_per_prompt: int = 4,
    turns: int = 2,
    follow_up: str = "always",
    max_new_tokens: int = 12,
    temperature: float = 0.7,
    seed: int = 0,
    max_operand: int = 9,
    problems: list[Problem] | None = None,
    device: str = "auto",
    trace_path: str | Path | None = None,
    progress: bool = True,
    stats: GenerationStats | None = None,
    threads: int | None = 1,
    rollout_log_probs: bool = False,
    reward: Any = None,
    group_reward: bool = False,
    reward_args: Any = None,
    system_prompt: str | None = SYSTEM_PROMPT,
    example: tuple[str, str] | None = EXAMPLE,
) -> Rollouts:
    """Sample a rollout batch of arithmetic questions from a causal LM (see the module docstring).

    Parameters
    ----------
    model:
        A checkpoint directory, or a loaded ``transformers`` model (then pass
        ``tokenizer`` too); default: SmolLM2-135M-Instruct.
    n_prompts, n_samples_per_prompt:
        Questions, and rollouts per question (one prompt group each, ``group_index``).
    turns, follow_up:
        ``turns=1``: one sample per rollout. ``turns=2``: after the answer the
        model is asked "Are you sure? Answer again." — ``follow_up="always"``
        in every rollout, ``"if_wrong"`` only where the first answer was wrong.
    max_new_tokens, temperature, seed:
        Sampling (plain temperature sampling, no top-k / top-p). Same seed,
        same tokens on CPU.
    max_operand, problems:
        The questions: seeded ones up to ``max_operand``, or your own
        :class:`~varbatch_kit.train.rl.task.Problem` list (then ``n_prompts`` is its length).
    device:
        ``auto`` (CUDA when available), ``cpu`` or ``cuda``; for a loaded
        model its own device is used.
    trace_path:
        Write the rollouts with their extra columns as a ``.jsonl`` /
        ``.parquet`` trace.
    progress:
        A tqdm bar over the prompts.
    stats:
        A :class:`GenerationStats` to fill in (prompts, rollouts, samples,
        generated tokens, wall time, ``tokens_per_s``).
    threads:
        torch CPU threads while generating on the CPU (restored afterwards);
        default 1: the small model gains little from more, and OpenMP slows
        down badly when the cores are busy with anything else. ``None`` keeps
        torch's setting.
    rollout_log_probs:
        Also record, per sample, the generator's log-probability of every
        response token at the sampling ``temperature`` (the ``rollout_log_probs``
        column the engine reads: slime's ``train_rollout_logprob_abs_diff``,
        TIS and ``use_rollout_logprobs`` use it).
    reward, group_reward, reward_args:
        The reward of each sample (each turn): None is the arithmetic task's exact
        match on the first integer; else a function with slime's custom-RM
        signature ``rm(args, sample)`` (``async`` or not), or ``rm(args,
        samples)`` over a prompt group's samples with ``group_reward=True``
        (slime's ``--group-rm``), as a callable or a ``"module.func"`` path
        (:mod:`varbatch_kit.train.rl.task`). ``reward_args`` is the ``args`` it
        receives (default :func:`~varbatch_kit.train.rl.task.slime_args` with
        ``n_samples_per_prompt``). With ``follow_up="if_wrong"`` a first answer
        is wrong when its reward is not positive.
    system_prompt, example:
        The chat before the question: a system prompt and one worked
        ``(question, answer)`` exchange (the arithmetic task's by default;
        None leaves either out).

    Sampling reseeds torch's global RNG (``torch.manual_seed``) before every
    ``generate`` call.

    Returns ``Rollouts`` with ``extra`` columns tokens, reward, group_index,
    turn, turn_reward, question, answer, response (and rollout_log_probs when
    asked); no advantages (the engine computes them from the rewards,
    ``TrainConfig.loss``). Rollout ids are ``prompt * n_samples_per_prompt + k``.
    """
    import pandas as pd

    for name, v in (("n_samples_per_prompt", n_samples_per_prompt),
                    ("max_new_tokens", max_new_tokens)):
        positive_int(name, v, whole_floats=True)
    if turns not in (1, 2):
        raise ValueError(f"turns={turns!r}; use 1 (one answer) or 2 (answer, then the "
                         f"follow-up {FOLLOW_UP!r})")
    if follow_up not in FOLLOW_UPS:
        raise ValueError(f"follow_up={follow_up!r}; choose one of {FOLLOW_UPS}")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be > 0 (sampling), got {temperature!r}")
    if threads is not None:
        positive_int("threads", threads, note=" or None", whole_floats=True)
    if problems is None:
        problems = arithmetic_problems(n_prompts, seed=seed, max_operand=max_operand)
    elif not problems or not all(isinstance(p, Problem) for p in problems):
        raise ValueError("problems must be a non-empty list of Problem(question, answer)")
    reward_fn = resolve_function(reward, "reward") or _exact_match
    if reward_fn is _exact_match:
        bad = [p for p in problems if isinstance(p.answer, bool)
               or not isinstance(p.answer, (int, np.integer))]
        if bad:
            raise ValueError(f"the default reward (exact match on the first integer) needs "
                             f"integer answers; {bad[0]!r} has none: give reward=... (a "
                             "function with slime's custom-RM signature)")
    if example is not None and (not isinstance(example, (tuple, list)) or len(example) != 2):
        raise ValueError(f"example={example!r}: give (question, answer) or None")
    args = reward_args if reward_args is not None else slime_args(
        n_samples_per_prompt=int(n_samples_per_prompt), group_rm=bool(group_reward))
    if model is None or isinstance(model, (str, Path)):
        model, tokenizer = load_model(model, device=device)
    elif tokenizer is None:
        raise ValueError("pass tokenizer=... with a loaded model (or a checkpoint directory)")
    stop = _stop_ids(model, tokenizer)
    n = int(n_samples_per_prompt)

    rows: list[dict[str, Any]] = []
    stats = GenerationStats() if stats is None else stats
    stats.prompts, stats.generated_tokens = len(problems), 0
    stats.device = str(next(model.parameters()).device)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(problems), desc="generating", unit="prompt")
    import torch

    saved_threads = torch.get_num_threads()
    if threads is not None and stats.device == "cpu":
        torch.set_num_threads(int(threads))
    t0 = time.perf_counter()
    try:
        for k, problem in enumerate(problems):
            kw = dict(temperature=temperature, max_new_tokens=max_new_tokens, stop=stop)
            chat = dict(system=system_prompt, example=example)
            first_text, first = _prompt(tokenizer, _messages(problem, [], **chat))
            lp0: list | None = [] if rollout_log_probs else None
            answers = _sample(model, tokenizer, [first] * n, seed=_seed(seed, k, 0),
                              log_probs=lp0, **kw)
            texts = [tokenizer.decode(a, skip_special_tokens=True).strip() for a in answers]
            turn0 = [_task_sample(k * n + j, k, first_text, first, answers[j], texts[j],
                                  problem) for j in range(n)]
            rewards = score(reward_fn, args, turn0, group=group_reward)
            per_rollout: list[list[dict[str, Any]]] = []
            for j in range(n):
                per_rollout.append([dict(prompt=first, response=answers[j], text=texts[j],
                                         reward=rewards[j],
                                         log_probs=None if lp0 is None else lp0[j])])
            if turns == 2:
                again = [j for j in range(n)
                         if follow_up == "always" or per_rollout[j][0]["reward"] <= 0.0]
                if again:
                    chats = [_prompt(tokenizer, _messages(problem, [texts[j]], **chat))
                             for j in again]
                    prompts = [ids for _, ids in chats]
                    lp1: list | None = [] if rollout_log_probs else None
                    seconds = _sample(model, tokenizer, prompts, seed=_seed(seed, k, 1),
                                      log_probs=lp1, **kw)
                    decoded = [tokenizer.decode(a, skip_special_tokens=True).strip()
                               for a in seconds]
                    turn1 = [_task_sample(k * n + j, k, c[0], p, a, text, problem)
                             for j, c, p, a, text in zip(again, chats, prompts, seconds, decoded)]
                    rewards1 = score(reward_fn, args, turn1, group=group_reward)
                    for i, (j, p, a) in enumerate(zip(again, prompts, seconds)):
                        per_rollout[j].append(dict(prompt=p, response=a, text=decoded[i],
                                                   reward=rewards1[i],
                                                   log_probs=None if lp1 is None else lp1[i]))
            for j, samples in enumerate(per_rollout):
                reward = float(np.mean([s["reward"] for s in samples]))
                for t, s in enumerate(samples):
                    stats.generated_tokens += len(s["response"])
                    rows.append(dict(
                        rollout_id=k * n + j, prompt_len=len(s["prompt"]),
                        response_len=len(s["response"]), tokens=s["prompt"] + s["response"],
                        reward=reward, group_index=k, turn=t, turn_reward=s["reward"],
                        question=problem.question, answer=problem.answer,
                        response=s["text"], rollout_log_probs=s["log_probs"]))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{np.mean([r['reward'] for r in rows]):.2f}")
    finally:
        torch.set_num_threads(saved_threads)
        if bar is not None:
            bar.close()
    stats.wall_s = time.perf_counter() - t0

    frame = pd.DataFrame(rows)
    columns = ["tokens", "reward", "group_index", "turn", "turn_reward", "question", "answer",
               "response"]
    extra = frame[columns + (["rollout_log_probs"] if rollout_log_probs else [])]
    rollouts = Rollouts(prompt_len=frame["prompt_len"].to_numpy(),
                        response_len=frame["response_len"].to_numpy(),
                        rollout_id=frame["rollout_id"].to_numpy(), extra=extra)
    stats.rollouts, stats.samples = rollouts.num_rollouts, len(rollouts)
    if trace_path is not None:
        from varbatch_kit.core.traces import write_trace

        write_trace(rollouts, trace_path, extra=True)
    return rollouts
