"""``recommend``: slime's knobs searched on a trace; the flags it prints give what it predicts."""

from __future__ import annotations

import shlex
import warnings
from pathlib import Path

import numpy as np
import pytest

from varbatch_kit import ModelShape, Rollouts, build_schedule, bundled_traces, read_trace
from varbatch_kit.analysis.candidates import candidate_figures
from varbatch_kit.analysis.simulate import simulate
from varbatch_kit.compat.slime import recommend, schedule_config_from_slime_args
from varbatch_kit.compat.slime.flag_search import _rewrite, recommended_config
from varbatch_kit.core.memory import MemoryLayout, predict_memory

DUMP = Path(__file__).parents[2] / "golden" / "dumps" / "rollout_12.pt"
MODEL = ModelShape.preset("qwen3-8b")

#: a bundled trace, 16 GPUs, only --global-batch-size given (kept), a flag slime's schedule ignores
BUNDLED_ARGS = ("--actor-num-nodes 2 --actor-num-gpus-per-node 8 --lr 1e-6 --global-batch-size 256 "
             "--use-dynamic-batch-size --max-tokens-per-gpu=16384 --seed 7")
#: a recorded slime dump (16 rollouts), the batch size derived from the rollout flags
DUMP_ARGS = ("--actor-num-gpus-per-node 2 --rollout-batch-size 4 --n-samples-per-prompt 4 "
             "--num-steps-per-rollout 2 --use-dynamic-batch-size --max-tokens-per-gpu 64 "
             "--custom-generate-function-path 'my mod.gen' --balance-data")
#: 64 prompts x 4 samples on 8 GPUs, 4 steps: about two micro-batches per rank, a poor balance
WIDE_ARGS = ("--actor-num-gpus-per-node 8 --rollout-batch-size 64 --n-samples-per-prompt 4 "
             "--num-steps-per-rollout 4 --use-dynamic-batch-size --max-tokens-per-gpu 16384 "
             "--balance-data")


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.fixture(scope="module")
def bundled_rec():
    return _quiet(recommend, read_trace(bundled_traces()["long_context"]), BUNDLED_ARGS, MODEL,
                  max_tokens_headroom=1.25)  # 7 caps: about 1.5 s


@pytest.fixture(scope="module")
def dump_rec():
    return _quiet(recommend, read_trace(DUMP), DUMP_ARGS, MODEL, max_tokens_headroom=2.0,
                  vary_global_batch_size=True)


@pytest.fixture(scope="module")
def wide():
    return Rollouts.synthetic(256, response_len=1500, max_response_len=8192, seed=3)


@pytest.fixture(scope="module")
def wide_rec(wide):
    return _quiet(recommend, wide, WIDE_ARGS, MODEL, vary_global_batch_size=True)


@pytest.mark.parametrize("case", ["bundled", "dump"])
def test_the_recommended_flags_give_the_predicted_figures(case, bundled_rec, dump_rec):
    if case == "bundled":
        rec, rollouts = bundled_rec, read_trace(bundled_traces()["long_context"])
    else:
        rec, rollouts = dump_rec, read_trace(DUMP)
    if case == "bundled":  # a plain --global-batch-size line: slime's own mapping reads it
        config = _quiet(schedule_config_from_slime_args, rec.command)
    else:  # --num-steps-per-rollout: the batch size derived as slime derives it
        config = recommended_config(rec.command)
    assert config == rec.config
    sched = _quiet(build_schedule, rollouts, config, MODEL)
    # the memory judged as recommend judges it: these command lines are fp32, tp 1
    memory = MemoryLayout(dp=config.dp, cp=config.cp, pp=config.pp, vpp=config.vpp,
                          mb_group=config.mb_group if config.vpp > 1 else None)
    fresh = candidate_figures(sched, memory_limit=rec.memory_limit, memory=memory,
                              memory_budget=rec.memory_budget)
    assert fresh == {k: rec.best[k] for k in fresh}
    assert rec.best["safe"] and rec.best["peak_gpu_bytes"] <= rec.memory_budget
    assert simulate(sched).total_time_s == pytest.approx(rec.best["time_s"], rel=1e-12)
    assert rec.table.loc[rec.table["best"], "time_s"].item() == rec.best["time_s"]
    assert rec.table["best"].sum() == 1 and rec.table["user"].sum() == 1
    assert list(rec.table["time_s"].dropna()) == sorted(rec.table["time_s"].dropna())


def test_recommended_is_never_slower_and_keeps_the_world_size(bundled_rec, dump_rec, wide_rec):
    for rec in (bundled_rec, dump_rec, wide_rec):
        assert rec.best["time_s"] <= rec.user["time_s"]
        assert rec.speedup >= 1.0
        u, c = rec.user_config, rec.config
        assert (c.dp, c.cp, c.pp, c.vpp) == (u.dp, u.cp, u.pp, u.vpp)
        for flag in ("--actor-num", "--tensor-", "--pipeline-", "--context-", "--dp-size"):
            assert not rec.table["changed"].str.contains(flag).any(), flag


def _kept(tokens, changes):
    """``tokens`` without the changed flags (and their values)."""
    out, skip = [], False
    for t in tokens:
        name = t.split("=", 1)[0]
        if skip:
            skip = False
        elif name in changes:
            skip = "=" not in t and not isinstance(changes[name], bool)
        else:
            out.append(t)
    return out


def test_flags_that_shape_nothing_are_kept_verbatim_and_in_order(bundled_rec, dump_rec):
    for rec, args in ((bundled_rec, BUNDLED_ARGS), (dump_rec, DUMP_ARGS)):
        assert _kept(shlex.split(rec.command), rec.changes) == _kept(shlex.split(args),
                                                                     rec.changes)
    assert "--lr 1e-6" in bundled_rec.command and "--seed 7" in bundled_rec.command
    assert "'my mod.gen'" in dump_rec.command


def test_the_cap_stays_within_the_headroom(bundled_rec, dump_rec, wide_rec):
    assert bundled_rec.memory_limit == int(16384 * 1.25)
    assert dump_rec.memory_limit == 128
    assert wide_rec.memory_limit == 16384  # default headroom 1.0: never raised
    for rec in (bundled_rec, dump_rec, wide_rec):
        caps = rec.table["max_tokens_per_gpu"].dropna()
        assert (caps <= rec.memory_limit).all()
        assert rec.best["over_limit"] == 0 or rec.changes == {}
    absolute = _quiet(recommend, read_trace(DUMP), DUMP_ARGS, MODEL, max_tokens_limit=96)
    assert absolute.memory_limit == 96
    assert absolute.table["max_tokens_per_gpu"].dropna().max() == 96


def test_the_global_batch_size_is_kept_unless_allowed(bundled_rec, dump_rec, wide):
    assert set(bundled_rec.table["global_batch_size"]) == {256}  # --global-batch-size only
    assert len(set(dump_rec.table["global_batch_size"])) > 1  # asked: --num-steps-per-rollout
    # not asked: --num-steps-per-rollout 4 stays, though 1 would be 10 % faster (below)
    kept = _quiet(recommend, wide, WIDE_ARGS, MODEL)
    assert set(kept.table["num_steps_per_rollout"]) == {4}
    assert "--num-steps-per-rollout 4" in kept.command
    # every batch size tried trains the same 16 rollouts
    assert all(16 % g == 0 for g in dump_rec.table["global_batch_size"])
    varied = _quiet(recommend, read_trace(DUMP), DUMP_ARGS.replace(
        "--rollout-batch-size 4 --n-samples-per-prompt 4 --num-steps-per-rollout 2",
        "--global-batch-size 8"), MODEL, vary_global_batch_size=True)
    assert set(varied.table["global_batch_size"]) > {8}


def test_a_known_better_setting_is_found(wide_rec):
    """Four steps of 64 rollouts on 8 ranks: about two micro-batches per rank, 13 % above the
    bound; one step per rollout batch (or static batches of two) packs the ranks evenly."""
    u, b = wide_rec.user, wide_rec.best
    assert u["mb_per_rank"] == pytest.approx(2.0)
    assert u["above_bound"] > 1.10
    assert b["time_s"] < 0.9 * u["time_s"]
    assert b["above_bound"] < 1.01
    assert "--num-steps-per-rollout 1" in wide_rec.command
    assert recommended_config(wide_rec.command).global_batch_size == 256
    assert wide_rec.balanced is not None and wide_rec.balanced["time_s"] < u["time_s"]
    assert "beyond slime" in wide_rec.explain()


def test_vpp_searches_the_group_size(wide):
    args = ("--actor-num-gpus-per-node 8 --pipeline-model-parallel-size 2 "
            "--virtual-pipeline-model-parallel-size 2 --global-batch-size 64 "
            "--use-dynamic-batch-size --max-tokens-per-gpu 16384")
    rec = _quiet(recommend, wide, args, MODEL)
    assert set(rec.table["mb_group"]) == {2, 3, 4}  # 2: unset, Megatron's default pp
    assert rec.config.pp == 2 and rec.config.vpp == 2 and rec.config.dp == 4


def test_rewrite_replaces_in_place_and_appends():
    tokens = ["--a", "1", "--max-tokens-per-gpu=100", "--balance-data", "--b", "x y"]
    out = _rewrite(tokens, {"--max-tokens-per-gpu": 200, "--balance-data": False,
                            "--balance-by-flops": True})
    assert out == ["--a", "1", "--max-tokens-per-gpu", "200", "--b", "x y",
                   "--balance-by-flops"]


@pytest.mark.parametrize("args, kwargs, match", [
    ("--global-batch-size 8 --use-dynamic-batch-size --max-tokens-per-gpu ten", {},
     "--max-tokens-per-gpu"),
    ("--global-batch-size 8 --use-dynamic-batch-size --max-tokens 64", {}, "abbreviations"),
    ("--num-steps-per-rollout 2 --use-dynamic-batch-size --max-tokens-per-gpu 64", {},
     "--rollout-batch-size"),
    ("--rollout-batch-size 4 --n-samples-per-prompt 4 --num-steps-per-rollout 2 "
     "--global-batch-size 4 --use-dynamic-batch-size --max-tokens-per-gpu 64", {},
     "--global-batch-size 4 is not"),
    ("--global-batch-size 8 --use-dynamic-batch-size --max-tokens-per-gpu 64",
     {"max_tokens_headroom": 0.5}, "max_tokens_headroom"),
    ("--global-batch-size 8 --use-dynamic-batch-size --max-tokens-per-gpu 64",
     {"max_tokens_limit": 32}, "max_tokens_limit=32"),
    ("--global-batch-size 8 --use-dynamic-batch-size --max-tokens-per-gpu 64",
     {"vary_global_batch_size": "yes"}, "vary_global_batch_size"),
])
def test_bad_input_is_a_value_error_naming_it(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _quiet(recommend, read_trace(DUMP), args, MODEL, **kwargs)


def test_bad_rollouts_or_model():
    with pytest.raises(ValueError, match="rollouts must be a Rollouts"):
        recommend([1, 2], "--global-batch-size 8", MODEL)
    with pytest.raises(ValueError, match="model must be a ModelShape, a preset name or a "):
        recommend(read_trace(DUMP), "--global-batch-size 8", 3.5)


def test_a_static_user_gets_the_limit_of_their_own_largest_micro_batch():
    """Static batching has no cap: the memory limit is the largest micro-batch the user's run
    holds; ``balanced`` (a token-cap packing) is not compared."""
    dump = read_trace(DUMP)
    rec = _quiet(recommend, dump, "--actor-num-gpus-per-node 1 --global-batch-size 8 "
                 "--micro-batch-size 2", MODEL)
    sched = _quiet(build_schedule, dump, rec.user_config, MODEL)
    assert rec.memory_limit == candidate_figures(sched)["peak_mb_tokens"]
    assert rec.user["over_limit"] == 0 and rec.balanced is None
    assert "needs a token cap" in rec.explain()
    assert rec.best["time_s"] <= rec.user["time_s"]
    assert (rec.table["max_tokens_per_gpu"].dropna() <= rec.memory_limit).all()


def test_a_preset_name_is_a_model_in_the_api_as_on_the_command_line():
    """recommend(..., "qwen3-8b") is recommend(..., ModelShape.preset("qwen3-8b")); a name that
    is neither a preset nor a file lists the presets."""
    from varbatch_kit.core.flops import ModelShape

    r = read_trace(DUMP)
    by_name = _quiet(recommend, r, DUMP_ARGS, "qwen3-8b")
    by_shape = _quiet(recommend, r, DUMP_ARGS, ModelShape.preset("qwen3-8b"))
    assert by_name.command == by_shape.command
    np.testing.assert_array_equal(by_name.table["time_s"], by_shape.table["time_s"])
    with pytest.raises(ValueError, match=r"model 'qwen9' is neither a preset \(.*qwen3-8b"):
        recommend(r, DUMP_ARGS, "qwen9")


def test_under_context_parallelism_the_memory_limit_is_per_gpu():
    """cp 2 with --max-tokens-per-gpu 64: slime's cap is 128 tokens per micro-batch, 64 on each
    of the two GPUs; the user's own flags are safe (issue 31: they showed over_limit > 0)."""
    r = read_trace(DUMP)
    rec = _quiet(recommend, r, DUMP_ARGS.replace("--actor-num-gpus-per-node 2",
                                                 "--actor-num-gpus-per-node 4 "
                                                 "--context-parallel-size 2"), MODEL)
    u = rec.user
    assert rec.memory_limit == 64 and u["over_limit"] == 0
    assert u["peak_mb_tokens"] > 64 and u["peak_gpu_tokens"] == -(-u["peak_mb_tokens"] // 2)
    # safety is the predicted bytes per GPU (issue 31): the user's own flags are safe, and
    # the recommendation's predicted peak fits the budget
    assert u["safe"] and u["peak_gpu_bytes"] <= rec.memory_budget
    sched = build_schedule(r, recommended_config(rec.command), MODEL)
    peak = predict_memory(sched, MODEL, MemoryLayout(dp=sched.config.dp, cp=2))["peak_bytes"]
    assert peak.max() == rec.best["peak_gpu_bytes"] <= rec.memory_budget


# slime's own MODEL_ARGS (scripts/models/qwen3-8B.sh and qwen2.5-0.5B.sh, THUDM/slime at
# 624b824a898ab0ec1fcb4d373004c7f3852bf515, the rotary base's shell default filled in)
QWEN3_8B_FLAGS = ("--swiglu --num-layers 36 --hidden-size 4096 --ffn-hidden-size 12288 "
                  "--num-attention-heads 32 --group-query-attention --num-query-groups 8 "
                  "--use-rotary-position-embeddings --disable-bias-linear "
                  "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 "
                  "--vocab-size 151936 --kv-channels 128 --qk-layernorm "
                  "--untie-embeddings-and-output-weights")
QWEN25_05B_FLAGS = ("--swiglu --num-layers 24 --hidden-size 896 --ffn-hidden-size 4864 "
                    "--num-attention-heads 14 --use-rotary-position-embeddings "
                    "--disable-bias-linear --add-qkv-bias --normalization RMSNorm "
                    "--norm-epsilon 1e-6 --rotary-base 1000000 --group-query-attention "
                    "--num-query-groups 2 --vocab-size 151936")


@pytest.mark.parametrize("flags,preset", [(QWEN3_8B_FLAGS, "qwen3-8b"),
                                          (QWEN25_05B_FLAGS, "qwen2.5-0.5b")])
def test_slimes_model_scripts_give_the_presets_shape_and_make_up(flags, preset):
    """Every field of the shape, the layer's make-up the memory model reads included (gated
    MLP, RMSNorm, biases, q/k norm, tied embeddings, rotary positions), is the Hugging Face
    config's: the memory model predicts the same bytes from slime's flags as from the
    preset."""
    from dataclasses import asdict

    from varbatch_kit.compat.slime.model_flags import model_shape_from_slime_args
    from varbatch_kit.core.flops import ModelShape
    from varbatch_kit.core.memory import MemoryLayout, parameter_count

    shape, want = model_shape_from_slime_args(flags), ModelShape.preset(preset)
    got = {k: v for k, v in asdict(shape).items() if k != "name"}
    assert got == {k: v for k, v in asdict(want).items() if k != "name"}
    assert parameter_count(shape, MemoryLayout()) == parameter_count(want, MemoryLayout())


def test_absent_make_up_flags_take_megatrons_defaults():
    """Without --swiglu, --normalization, --disable-bias-linear, --untie-... or a rotary
    flag, Megatron builds a GeLU MLP, LayerNorm, biases, tied embeddings and a learned
    position table of --max-position-embeddings (else --seq-length) rows; each flag turns its
    default over, and a choice Megatron does not have is refused."""
    from varbatch_kit.compat.slime.model_flags import model_shape_from_slime_args
    from varbatch_kit.core.memory import MemoryLayout, parameter_count

    base = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --vocab-size 128"
    plain = model_shape_from_slime_args(base + " --seq-length 512")
    assert (plain.gated_mlp, plain.norm, plain.linear_bias, plain.qkv_bias, plain.qk_norm,
            plain.tied_embeddings, plain.position_embedding, plain.learned_positions) == (
        False, "layernorm", True, True, False, True, "learned", 512)
    assert model_shape_from_slime_args(
        base + " --seq-length 512 --max-position-embeddings 1024").learned_positions == 1024
    assert model_shape_from_slime_args(base).learned_positions == 0  # rows unknown
    for flag, field, value in [("--swiglu", "gated_mlp", True),
                               ("--normalization RMSNorm", "norm", "rmsnorm"),
                               ("--qk-layernorm", "qk_norm", True),
                               ("--untie-embeddings-and-output-weights", "tied_embeddings",
                                False),
                               ("--position-embedding-type rope", "learned_positions", 0),
                               ("--use-rotary-position-embeddings", "position_embedding",
                                "rope")]:
        shape = model_shape_from_slime_args(f"{base} --seq-length 512 {flag}")
        assert getattr(shape, field) == value, flag
        one = MemoryLayout()
        assert parameter_count(shape, one) != parameter_count(plain, one), flag
    off = model_shape_from_slime_args(base + " --disable-bias-linear")
    assert not off.linear_bias and not off.qkv_bias
    assert model_shape_from_slime_args(base + " --disable-bias-linear --add-qkv-bias").qkv_bias
    with pytest.raises(SystemExit):  # argparse: invalid choice
        model_shape_from_slime_args(base + " --normalization BatchNorm")


def test_slimes_model_flags_are_the_model_and_not_ignored():
    """slime's MODEL_ARGS for Qwen3-8B give the preset's FLOPs shape; recommend reads them
    (no model argument), lists none of them as ignored, and refuses a different model given
    beside them."""
    from varbatch_kit.compat.slime.model_flags import model_shape_from_slime_args
    from varbatch_kit.core.flops import ModelShape

    shape = model_shape_from_slime_args(QWEN3_8B_FLAGS)
    preset = ModelShape.preset("qwen3-8b")
    for f in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "kv_channels", "vocab_size"):
        assert getattr(shape, f) == getattr(preset, f), f
    assert model_shape_from_slime_args("--global-batch-size 4") is None
    with pytest.raises(ValueError, match=r"--hidden-size, --vocab-size missing"):
        model_shape_from_slime_args("--num-layers 2 --num-attention-heads 4")
    r = read_trace(DUMP)
    with pytest.warns(UserWarning) as got:
        rec = recommend(r, DUMP_ARGS + " " + QWEN3_8B_FLAGS)
    ignored = " ".join(str(w.message) for w in got)
    # the make-up flags are read (the memory model); the rotary base and the norm's epsilon
    # change neither FLOPs nor bytes
    assert "--num-layers" not in ignored and "--swiglu" not in ignored
    assert "--rotary-base" in ignored and "--norm-epsilon" in ignored
    by_preset = _quiet(recommend, r, DUMP_ARGS, "qwen3-8b")
    np.testing.assert_allclose(rec.table["time_s"], by_preset.table["time_s"], rtol=1e-12)
    with pytest.raises(ValueError, match="describe different models"):
        _quiet(recommend, r, DUMP_ARGS + " " + QWEN3_8B_FLAGS, "qwen2.5-0.5b")
    with pytest.raises(ValueError, match="no model: give model="):
        _quiet(recommend, r, DUMP_ARGS)


def test_a_model_the_memory_model_does_not_cover_is_judged_by_tokens_and_says_so():
    """DeepSeek-V3 (shared experts, dense first layers, multi-latent attention): the memory
    model would mis-count it and refuses;
    recommend warns once and judges safety by the tokens a GPU holds against the limit (the
    user's own peak: no candidate may exceed it), with no predicted bytes; the planner,
    which has no other measure, refuses with the same reason."""
    from varbatch_kit.compat.slime.planner import plan_layouts
    from varbatch_kit.core.memory import MemoryLayout, parameter_count

    deepseek = ModelShape.preset("deepseek-v3")
    with pytest.raises(ValueError, match=r"shared experts and layers mixing dense and "
                                         r"mixture-of-experts MLPs and multi-latent attention"):
        parameter_count(deepseek, MemoryLayout())
    r = read_trace(bundled_traces()["agentic"])
    with pytest.warns(UserWarning, match=r"safety is judged by the tokens a GPU holds") as got:
        rec = recommend(r, BUNDLED_ARGS, deepseek)
    assert sum("memory model covers dense transformers and mixtures of experts" in
               str(w.message) for w in got) == 1
    table = rec.table
    assert table["peak_gpu_bytes"].isna().all()
    assert table["safe"].sum() > 1 and (table.loc[table["safe"], "over_limit"] == 0).all()
    assert (~table.loc[table["over_limit"] > 0, "safe"]).all()
    assert rec.best["over_limit"] == 0
    with pytest.raises(ValueError, match=r"memory model covers dense transformers"):
        plan_layouts(r, deepseek, 64, hardware="H100")
