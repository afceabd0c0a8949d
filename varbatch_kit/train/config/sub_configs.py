"""The sub-configs of a training run: the optimiser, the loss, the data, the run,
checkpoints, nodes and fault injection (each a frozen dataclass that checks its own fields;
:class:`~varbatch_kit.train.config.train_config.TrainConfig` nests them)."""

from __future__ import annotations

from dataclasses import dataclass

from varbatch_kit.train.config.field_checks import documented as _f
from varbatch_kit.train.config.field_checks import need_bool, need_choice, need_int, need_number

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ADVANTAGE_GROUPINGS",
    "CheckpointConfig",
    "DEVICES",
    "DataConfig",
    "FaultConfig",
    "KILL_POINTS",
    "KL_LOSS_TYPES",
    "LR_DECAY_STYLES",
    "LR_INCREMENTS",
    "LossConfig",
    "NodesConfig",
    "OptimConfig",
    "RunConfig",
    "TIS_FUNCTIONS",
    "TOKEN_ID_MAPS",
]

DEVICES = ("auto", "cpu", "cuda")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
LR_INCREMENTS = ("auto", "rollouts", "samples")
# where ``kill_at`` may SIGKILL a worker (see FaultConfig)
KILL_POINTS = ("before_step", "mid_step", "after_step", "ckpt_after_model", "ckpt_before_rename",
               "after_ckpt")

# --------------------------------------------------------------------------- sub-configs
@dataclass(frozen=True)
class OptimConfig:
    """megatron-core Adam and its ``OptimizerParamScheduler``."""

    lr: float = _f(3e-3, "peak learning rate")
    min_lr: float = _f(3e-4, "learning rate at the end of the decay, in [0, lr]")
    lr_decay_style: str = _f("cosine", "LR decay", choices=LR_DECAY_STYLES)
    lr_warmup_fraction: float = _f(0.0, "warm-up, a fraction in [0, 1) of the decay horizon")
    lr_increment: str = _f("auto", "what one step advances the LR schedule by: rollouts or "
                                   "samples of that step; auto = rollouts when the mode divides "
                                   "by the rollout count, samples otherwise",
                           choices=LR_INCREMENTS)
    weight_decay: float = _f(0.0, "weight decay (>= 0)")
    adam_beta1: float = _f(0.9, "Adam beta1, in [0, 1)")
    adam_beta2: float = _f(0.999, "Adam beta2, in [0, 1)")
    adam_eps: float = _f(1e-8, "Adam epsilon (> 0)")
    clip_grad: float = _f(1.0, "gradient-norm clipping (0 = off)")
    distributed: bool = _f(False, "megatron's distributed optimizer (ZeRO-1, slime's "
                                  "--use-distributed-optimizer): Adam's moments (and bf16's "
                                  "fp32 main parameters) sharded over the dp*cp ranks, "
                                  "gradients reduce-scattered, parameters all-gathered")

    def __post_init__(self) -> None:
        need_number("optim", "lr", self.lr, lo=0, lo_open=True)
        need_number("optim", "min_lr", self.min_lr, lo=0, hi=self.lr)
        need_choice("optim", "lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        need_number("optim", "lr_warmup_fraction", self.lr_warmup_fraction, lo=0, hi=1,
                     hi_open=True)
        need_choice("optim", "lr_increment", self.lr_increment, LR_INCREMENTS)
        need_number("optim", "weight_decay", self.weight_decay, lo=0)
        need_number("optim", "adam_beta1", self.adam_beta1, lo=0, hi=1, hi_open=True)
        need_number("optim", "adam_beta2", self.adam_beta2, lo=0, hi=1, hi_open=True)
        need_number("optim", "adam_eps", self.adam_eps, lo=0, lo_open=True)
        need_number("optim", "clip_grad", self.clip_grad, lo=0)
        need_bool("optim", "distributed", self.distributed)


#: slime's ``--advantage-estimator`` values the engine trains (``ppo`` needs a critic: refused)
ADVANTAGE_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus",
                        "reinforce_plus_plus_baseline")
#: slime's ``--kl-loss-type`` values
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
#: the importance corrections against rollout log-probs (slime's ``vanilla_tis_function`` and
#: ``icepop_function``, the latter chosen there by ``--custom-tis-function-path``)
TIS_FUNCTIONS = ("vanilla", "icepop")
#: how rewards form normalisation groups (see :class:`LossConfig`)
ADVANTAGE_GROUPINGS = ("slime", "prompt")
#: ``DataConfig.token_id_map``: how token ids are mapped into the model's vocabulary
#: (None: not at all, an id outside it is an error; "modulo": ``id % vocab_size``)
TOKEN_ID_MAPS = (None, "modulo")


@dataclass(frozen=True)
class LossConfig:
    """slime's RL objective; each field carries the name of slime's flag without dashes.

    The per-token terms (:mod:`varbatch_kit.report.objective`, docs/objective.md):
    PPO's clipped surrogate on ``ppo_kl = old - new`` log-probs (old from the
    forward-only log-prob pass, or the rollout log-probs with
    ``use_rollout_logprobs``), asymmetric with ``eps_clip_high`` and dual-clip
    with ``eps_clip_c``; CISPO or GSPO's sequence ratio by ``advantage_estimator``;
    times the TIS / ICEPOP weight with ``use_tis``; minus ``entropy_coef`` times
    the entropy; plus ``kl_loss_coef`` times the KL estimate to the reference
    model with ``use_kl_loss``. Every term and metric is reduced by the report
    mode. Rewards become advantages as slime's ``_post_process_rewards`` and
    ``compute_advantages_and_returns`` do (``advantage_grouping="slime"``, the
    default: consecutive groups of ``n_samples_per_prompt`` samples only when the
    batch holds ``rollout_batch_size * n_samples_per_prompt`` samples, else one
    group of the whole batch), or by prompt (``"prompt"``: the ``group_index``
    column, GRPO's intended group).
    """

    advantage_estimator: str = _f("grpo", "how rewards become per-token advantages (slime's "
                                          "--advantage-estimator; ppo needs a critic and is not "
                                          "supported)", choices=ADVANTAGE_ESTIMATORS)
    eps_clip: float = _f(0.2, "PPO clip range below: clip(ratio, 1 - eps_clip, ...)")
    eps_clip_high: float | None = _f(None, "PPO clip range above: clip(..., 1 + eps_clip_high) "
                                           "(default: eps_clip)")
    eps_clip_c: float | None = _f(None, "dual-clip PPO: negative-advantage tokens lose at most "
                                        "eps_clip_c * |A| (> 1; default off)")
    use_kl_loss: bool = _f(False, "add kl_loss_coef * KL(actor || reference) to the loss")
    kl_loss_coef: float = _f(0.0, "weight of the KL loss (>= 0)")
    kl_loss_type: str = _f("k1", "KL estimator of the KL loss (and of kl_coef's reward "
                                 "shaping)", choices=KL_LOSS_TYPES)
    use_unbiased_kl: bool = _f(False, "weight the KL estimate by the ratio actor / old policy "
                                      "(DeepSeek-V3.2's unbiased estimate)")
    kl_coef: float = _f(0.0, "KL penalty on the reward before the advantages (reinforce_plus_plus"
                             " estimators; >= 0)")
    entropy_coef: float = _f(0.0, "entropy bonus: loss -= entropy_coef * entropy (>= 0)")
    gamma: float = _f(1.0, "discount of the reinforce_plus_plus returns, in [0, 1]")
    normalize_advantages: bool = _f(False, "whiten the advantages over every loss token of the "
                                           "rollout batch")
    rewards_normalization: bool = _f(True, "group-normalise rewards (grpo, gspo, cispo, "
                                           "reinforce_plus_plus_baseline; slime's "
                                           "--disable-rewards-normalization turns it off)")
    grpo_std_normalization: bool = _f(True, "divide by the group's std too (grpo, gspo, cispo; "
                                            "--disable-grpo-std-normalization, Dr. GRPO)")
    advantage_grouping: str = _f("slime", "reward groups: slime = slime's rule, prompt = by the "
                                          "group_index column", choices=ADVANTAGE_GROUPINGS)
    use_tis: bool = _f(False, "importance-correct the loss against the rollout log-probs")
    tis_function: str = _f("vanilla", "vanilla = truncated IS, icepop = zero outside the bounds",
                           choices=TIS_FUNCTIONS)
    tis_clip: float = _f(2.0, "upper bound of the TIS weight (> 0)")
    tis_clip_low: float = _f(0.0, "lower bound of the TIS weight, in [0, tis_clip]")
    use_rollout_logprobs: bool = _f(False, "old log-probs = the rollout engine's (the rollouts' "
                                           "rollout_log_probs), not the log-prob pass's")
    reward_key: str | None = _f(None, "the key of dict rewards to train on (e.g. 'acc')")
    rollout_temperature: float = _f(1.0, "the sampling temperature of the rollouts: logits are "
                                         "divided by it before the log-probs (> 0)")
    moe_aux_loss_coeff: float = _f(0.0, "mixture of experts: weight of the router's load-"
                                        "balancing loss, per sample and MoE layer (>= 0)")
    moe_z_loss_coeff: float = _f(0.0, "mixture of experts: weight of the router's z-loss, per "
                                      "sample and MoE layer (>= 0)")

    def __post_init__(self) -> None:
        if self.advantage_estimator == "ppo":
            raise ValueError("loss.advantage_estimator='ppo' needs a critic (a value model), "
                             "which the engine does not train; choose one of "
                             f"{ADVANTAGE_ESTIMATORS}")
        need_choice("loss", "advantage_estimator", self.advantage_estimator,
                    ADVANTAGE_ESTIMATORS)
        need_number("loss", "eps_clip", self.eps_clip, lo=0, hi=1, hi_open=True)
        need_number("loss", "eps_clip_high", self.eps_clip_high, lo=0, optional=True)
        need_number("loss", "eps_clip_c", self.eps_clip_c, lo=1, lo_open=True, optional=True)
        for name in ("use_kl_loss", "use_unbiased_kl", "normalize_advantages",
                     "rewards_normalization", "grpo_std_normalization", "use_tis",
                     "use_rollout_logprobs"):
            need_bool("loss", name, getattr(self, name))
        need_number("loss", "kl_loss_coef", self.kl_loss_coef, lo=0)
        need_choice("loss", "kl_loss_type", self.kl_loss_type, KL_LOSS_TYPES)
        need_number("loss", "kl_coef", self.kl_coef, lo=0)
        need_number("loss", "entropy_coef", self.entropy_coef, lo=0)
        need_number("loss", "gamma", self.gamma, lo=0, hi=1)
        need_choice("loss", "advantage_grouping", self.advantage_grouping, ADVANTAGE_GROUPINGS)
        need_choice("loss", "tis_function", self.tis_function, TIS_FUNCTIONS)
        need_number("loss", "tis_clip", self.tis_clip, lo=0, lo_open=True)
        need_number("loss", "tis_clip_low", self.tis_clip_low, lo=0, hi=self.tis_clip)
        need_number("loss", "rollout_temperature", self.rollout_temperature, lo=0, lo_open=True)
        need_number("loss", "moe_aux_loss_coeff", self.moe_aux_loss_coeff, lo=0)
        need_number("loss", "moe_z_loss_coeff", self.moe_z_loss_coeff, lo=0)
        if self.reward_key is not None and (not isinstance(self.reward_key, str)
                                            or not self.reward_key):
            raise ValueError(f"loss.reward_key={self.reward_key!r}: give the key of the dict "
                             "rewards (a non-empty string) or None")

    @property
    def clip_high(self) -> float:
        """``eps_clip_high``, or ``eps_clip`` when unset (slime's default)."""
        return self.eps_clip if self.eps_clip_high is None else float(self.eps_clip_high)

    def objective_options(self):
        """The per-token objective's options
        (:class:`~varbatch_kit.report.objective.ObjectiveOptions`)."""
        from varbatch_kit.report.objective import ObjectiveOptions

        return ObjectiveOptions(
            advantage_estimator=self.advantage_estimator, eps_clip=self.eps_clip,
            eps_clip_high=self.clip_high, eps_clip_c=self.eps_clip_c,
            entropy_coef=self.entropy_coef, use_kl_loss=self.use_kl_loss,
            kl_loss_coef=self.kl_loss_coef, kl_loss_type=self.kl_loss_type,
            use_unbiased_kl=self.use_unbiased_kl, use_tis=self.use_tis,
            tis_function=self.tis_function, tis_clip=self.tis_clip,
            tis_clip_low=self.tis_clip_low, use_rollout_logprobs=self.use_rollout_logprobs)

    @property
    def needs_rollout_logprobs(self) -> bool:
        """Whether training needs the rollouts' own log-probs (TIS, or them as old log-probs)."""
        return self.use_tis or self.use_rollout_logprobs


@dataclass(frozen=True)
class DataConfig:
    """Seeds and the reward groups (slime's ``--n-samples-per-prompt`` and
    ``--rollout-batch-size``)."""

    seed: int = _f(1234, "model init and toy-task seed")
    n_samples_per_prompt: int = _f(1, "slime's group size, in samples: the reward groups are "
                                      "consecutive runs of this many samples when the batch "
                                      "holds rollout_batch_size * n_samples_per_prompt samples "
                                      "(slime's default 1)")
    rollout_batch_size: int | None = _f(None, "prompts per rollout batch (default: the number "
                                              "of prompt groups, group_index, else rollouts / "
                                              "n_samples_per_prompt)")

    num_steps_per_rollout: int | None = _f(None, "training steps per rollout batch: the log-prob "
                                                 "pass and the advantages cover that many "
                                                 "consecutive steps (default: the whole run is "
                                                 "one rollout batch)")
    token_id_map: str | None = _f(None, "map real token ids into a small model's vocabulary: "
                                        "None = off (an id >= model.vocab_size is an error), "
                                        "'modulo' = id modulo vocab_size (a slime dump's ids "
                                        "of a 151936-token vocabulary on the toy GPT's 64); "
                                        "for trying the engine on real dumps, not for real "
                                        "training (it merges tokens)", choices=TOKEN_ID_MAPS)

    def __post_init__(self) -> None:
        need_int("data", "seed", self.seed, 0)
        need_choice("data", "token_id_map", self.token_id_map, TOKEN_ID_MAPS)
        need_int("data", "n_samples_per_prompt", self.n_samples_per_prompt, 1)
        need_int("data", "rollout_batch_size", self.rollout_batch_size, 1, optional=True)
        need_int("data", "num_steps_per_rollout", self.num_steps_per_rollout, 1, optional=True)


@dataclass(frozen=True)
class RunConfig:
    """How long, where and under which name one run trains."""

    max_steps: int | None = _f(None, "train at most this many steps (default: every step of "
                                     "the schedule)")
    device: str = _f("auto", "auto: CUDA + NCCL when each node has a GPU per local rank, "
                             "else CPU + gloo (docs/gpu.md)", choices=DEVICES)
    timeout_s: float = _f(600.0, "seconds the whole run may take")
    step_timeout_s: float | None = _f(None, "seconds a step may take after the previous report "
                                            "(default: only timeout_s)")
    threads_per_worker: int = _f(1, "CPU torch threads per worker")
    save_params_at: tuple[int, ...] = _f((), "1-based steps after whose optimiser step rank 0 "
                                             "saves the parameters")
    save_grads_at: tuple[int, ...] = _f((), "1-based steps after whose backward (reduced over "
                                            "the ranks, before clipping and the optimiser step) "
                                            "rank 0 saves the gradients")
    label: str | None = _f(None, "the run's name (default: layout and mode)")
    track_memory: bool = _f(False, "record each rank's peak memory per step on CPU too (live "
                                   "tensor bytes, train/step/peak_memory.py; slows the CPU "
                                   "step); CUDA runs always record the allocator's peak")

    def __post_init__(self) -> None:
        need_int("run", "max_steps", self.max_steps, 1, optional=True)
        need_choice("run", "device", self.device, DEVICES)
        need_number("run", "timeout_s", self.timeout_s, lo=0, lo_open=True)
        need_number("run", "step_timeout_s", self.step_timeout_s, lo=0, lo_open=True,
                     optional=True)
        need_int("run", "threads_per_worker", self.threads_per_worker, 1)
        for name in ("save_params_at", "save_grads_at"):
            given = getattr(self, name)
            try:
                steps = tuple(int(s) for s in given)
            except (TypeError, ValueError):
                steps = None
            if steps is None or any(s < 1 for s in steps):
                raise ValueError(f"run.{name}={given!r}: give 1-based steps")
            object.__setattr__(self, name, steps)


@dataclass(frozen=True)
class CheckpointConfig:
    """Training checkpoints (:mod:`varbatch_kit.train.runs.checkpoint`, docs/checkpoints.md)."""

    save_every: int = _f(0, "rank 0 saves a full checkpoint after every N-th step (0 = off)")
    keep_last: int = _f(2, "complete checkpoints kept")

    def __post_init__(self) -> None:
        need_int("checkpoint", "save_every", self.save_every, 0)
        need_int("checkpoint", "keep_last", self.keep_last, 1)


@dataclass(frozen=True)
class NodesConfig:
    """Several nodes: torchrun's c10d rendezvous, node 0 hosting its store."""

    nnodes: int = _f(1, "nodes of the job; each starts dp*cp*pp*tp/nnodes workers")
    node_rank: int = _f(0, "this launcher's node (0 hosts the rendezvous)")
    rdzv_endpoint: str | None = _f(None, "'host:port' of node 0, needed with nnodes > 1")
    rdzv_timeout_s: float = _f(300.0, "seconds a node waits for the others to join")

    def __post_init__(self) -> None:
        need_int("nodes", "nnodes", self.nnodes, 1)
        need_int("nodes", "node_rank", self.node_rank, 0)
        if self.node_rank >= self.nnodes:
            raise ValueError(f"nodes.node_rank={self.node_rank}: give a node in "
                             f"[0, nnodes={self.nnodes})")
        if self.rdzv_endpoint is not None:
            host, _, port = str(self.rdzv_endpoint).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"nodes.rdzv_endpoint={self.rdzv_endpoint!r}: give "
                                 "'host:port' (node 0's address)")
        elif self.nnodes > 1:
            raise ValueError(f"nodes.nnodes={self.nnodes} needs nodes.rdzv_endpoint='host:port' "
                             "(node 0's address, the same on every node)")
        need_number("nodes", "rdzv_timeout_s", self.rdzv_timeout_s, lo=0, lo_open=True)


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection for tests of failure handling; the hooks act on rank ``fail_rank``.

    ``kill_at="POINT:STEP"`` SIGKILLs that rank at POINT of that step, POINT one
    of :data:`KILL_POINTS` (``mid_step``: in the first forward of the step;
    ``after_step``: after the optimiser step, before the report;
    ``ckpt_after_model`` / ``ckpt_before_rename``: while writing the checkpoint
    after that step). ``disk_full_at_step``: that step's checkpoint is written
    under a 64 KiB file-size limit, so its writes fail like on a full disk.
    ``cp_swap_chunks_rank`` (all-gather CP): every rank's K/V reassembly reads
    that CP rank's share with its two zigzag chunks in swapped order, a wrong
    exchange the CP invariance tests must catch (refused where it would act on nothing:
    cp 1, emulated CP, a rank not below cp).

    Four more injected bugs, each one the layout-invariance matrix must catch
    (``tests/integration/test_train_parallel.py``), each refused where it would
    change nothing:

    ``stale_loss_prescale``: the loss prescale of every step uses the micro-batch
    count of the first step this rank trained (a count not refreshed); inert for
    ``per_token`` (its prescale ignores the count).
    ``cp_duplicate_token_counts`` (``per_token``, cp > 1): every CP rank's token
    count is taken as distinct tokens, so the gradient and the reported
    per-token metrics are divided by cp x N instead of N.
    ``microbatch_denominators`` (modes with per-rollout denominators): each
    micro-batch builds its samples' denominators over its own samples, not over
    the step (a rollout split over micro-batches gets too small a denominator).
    ``sp_norm_grads_unreduced`` (sequence parallelism): the norms' parameters are not marked
    sequence-parallel, so their gradients, each TP rank's from its slice of the sequence,
    are not summed over the TP group (the bug of megatron's torch norm, which cannot be
    marked). ``moe_aux_per_row`` (a mixture of experts): the router's load-balancing loss and
    z-loss over each packed row, as megatron's per-micro-batch loss computes them, not per
    sample (:mod:`~varbatch_kit.train.step.router_losses`).
    """

    fail_at_step: int | None = _f(None, "rank fail_rank raises at the start of this 1-based step")
    fail_rank: int = _f(0, "the rank the hooks act on")
    hang_at_step: int | None = _f(None, "rank fail_rank sleeps forever at this step")
    kill_at: str | None = _f(None, f"'POINT:STEP', POINT one of {', '.join(KILL_POINTS)}")
    disk_full_at_step: int | None = _f(None, "the checkpoint after this step hits a 64 KiB "
                                             "file-size limit")
    cp_swap_chunks_rank: int | None = _f(None, "all-gather CP: the K/V exchange reads this CP "
                                               "rank's two chunks swapped (a wrong exchange)")
    stale_loss_prescale: bool = _f(False, "the loss prescale uses the first step's micro-batch "
                                          "count in every step (an injected bug)")
    cp_duplicate_token_counts: bool = _f(False, "per_token, cp > 1: each CP rank's token count "
                                                "counted as distinct tokens (an injected bug)")
    microbatch_denominators: bool = _f(False, "per-rollout denominators built per micro-batch, "
                                              "not per step (an injected bug)")
    sp_norm_grads_unreduced: bool = _f(False, "sequence parallelism: the norms' gradients not "
                                              "summed over the TP ranks (an injected bug)")
    moe_aux_per_row: bool = _f(False, "mixture of experts: the router losses over each packed "
                                      "row, not per sample (megatron's per-micro-batch loss; "
                                      "an injected bug)")

    def __post_init__(self) -> None:
        for name in ("fail_at_step", "hang_at_step", "disk_full_at_step"):
            need_int("faults", name, getattr(self, name), 1, optional=True)
        need_int("faults", "fail_rank", self.fail_rank, 0)
        need_int("faults", "cp_swap_chunks_rank", self.cp_swap_chunks_rank, 0, optional=True)
        for name in ("stale_loss_prescale", "cp_duplicate_token_counts", "microbatch_denominators",
                     "sp_norm_grads_unreduced", "moe_aux_per_row"):
            need_bool("faults", name, getattr(self, name))
        if self.kill_at is not None:
            point, _, step = str(self.kill_at).partition(":")
            if point not in KILL_POINTS or not step.isdigit() or int(step) < 1:
                raise ValueError(f"faults.kill_at={self.kill_at!r}: give 'POINT:STEP' with POINT "
                                 f"one of {KILL_POINTS} and a 1-based STEP")

    def kill_point(self) -> tuple[str, int] | None:
        """``kill_at`` parsed: ``(point, step)``, or None."""
        if self.kill_at is None:
            return None
        point, _, step = self.kill_at.partition(":")
        return point, int(step)
