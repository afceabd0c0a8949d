"""The memory model (varbatch_kit.core.memory) on numbers derived by hand, against the
engine's own slicing (report.cp) and as properties. The model against measured peaks of real
training runs: tests/integration/test_train_memory.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from varbatch_kit import ModelShape, Rollouts, ScheduleConfig, build_schedule
from varbatch_kit.core.memory import (
    MemoryLayout,
    activation_bytes_per_token,
    micro_batch_memory,
    micro_batch_share,
    parameter_count,
    pipeline_in_flight,
    predict_memory,
    static_memory,
)
from varbatch_kit.report.cp import zigzag_slice

#: the engine's toy GPT: LayerNorm, GeLU MLP of 4h, biases, a learned position table
TOY = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                 vocab_size=64, gated_mlp=False, norm="layernorm", linear_bias=True,
                 position_embedding="learned", learned_positions=100)
#: a Llama-style model: RMSNorm, SwiGLU, rotary, grouped-query attention, no biases
LLAMA = ModelShape(num_layers=4, hidden_size=48, num_attention_heads=6, num_query_groups=2,
                   kv_channels=8, ffn_hidden_size=80, vocab_size=96)


def test_parameter_count_by_hand():
    h, f, v = 64, 256, 64
    layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 2 * 2 * h
    whole = 2 * layer + v * h + 100 * h + 2 * h + v * h
    assert parameter_count(TOY, MemoryLayout()) == whole
    # tp 2: the column/row-parallel weights and the column biases halve, the row biases
    # (proj, fc2), the norms and the position table do not
    split = (3 * h * h + 3 * h) / 2 + (h * h) / 2 + h + (h * f + f) / 2 + (f * h) / 2 + h + 4 * h
    assert parameter_count(TOY, MemoryLayout(tp=2)) == 2 * split + v * h / 2 + 100 * h \
        + 2 * h + v * h / 2
    # pp 2: a layer each; the embeddings on the first stage, final norm and output on the last
    assert parameter_count(TOY, MemoryLayout(pp=2), 0) == layer + v * h + 100 * h
    assert parameter_count(TOY, MemoryLayout(pp=2), 1) == layer + 2 * h + v * h


def test_tied_embeddings_are_counted_once_but_twice_across_a_pipeline():
    tied = ModelShape(**{**LLAMA.to_dict(), "tied_embeddings": True})
    assert parameter_count(LLAMA, MemoryLayout()) - parameter_count(tied, MemoryLayout()) \
        == 96 * 48
    # megatron keeps a copy of the shared embedding on the last stage
    assert parameter_count(tied, MemoryLayout(pp=2), 1) == parameter_count(
        LLAMA, MemoryLayout(pp=2), 1)


def test_static_memory_per_precision_and_the_distributed_optimizer():
    n = parameter_count(TOY, MemoryLayout())
    assert static_memory(TOY, MemoryLayout()) == {"params": 4 * n, "grads": 4 * n,
                                                  "optimizer": 8 * n}
    # bf16: bf16 parameters, fp32 gradient buffer, fp32 main parameters and moments
    assert static_memory(TOY, MemoryLayout(precision="bf16")) == {
        "params": 2 * n, "grads": 4 * n, "optimizer": 12 * n}
    assert static_memory(TOY, MemoryLayout(precision="fp64"))["optimizer"] == 16 * n
    sharded = static_memory(TOY, MemoryLayout(dp=2, cp=2, distributed_optimizer=True))
    assert sharded["optimizer"] == -(-n // 4) * 8 and sharded["grads"] == 4 * n


def test_toy_layer_activations_by_hand():
    """Per token and layer (fp32, several samples per row): the two norms' inputs and
    outputs (4h) with mean and rstd (4 floats), query/key/value copies (3h), attention output
    and projection input (2h), log-sum-exp (4 heads), GeLU's input and output (2 x 4h):
    17 h + 8 floats = 4384 bytes, what autograd saves in the engine's layer (measured 17.125
    units of h in the memory trace of a toy run: 17 + 8/64)."""
    per = activation_bytes_per_token(TOY, MemoryLayout())
    assert per == {"residual": 2 * (2 * 64 * 4 + 8), "attention": 5 * 64 * 4 + 4 * 4,
                   "mlp": 2 * 256 * 4}
    assert sum(per.values()) == (17 * 64 + 8) * 4
    # one sample: views of the QKV output instead of copies, the same bytes (no rotary)
    assert activation_bytes_per_token(TOY, MemoryLayout(), one_sample=True) == per
    # tp 2 halves attention and MLP; the residual stream only with sequence parallelism
    tp = activation_bytes_per_token(TOY, MemoryLayout(tp=2, sequence_parallel=False))
    assert tp["attention"] == per["attention"] / 2 and tp["mlp"] == per["mlp"] / 2
    assert tp["residual"] == per["residual"]
    assert activation_bytes_per_token(TOY, MemoryLayout(tp=2))["residual"] == \
        per["residual"] / 2


def test_llama_layer_activations_by_hand():
    """RMSNorm keeps its input, normalised copy (float32 at least) and output; rotary
    positions keep cos and sin for query and key (4 d); SwiGLU keeps fc1's output (2f), the
    activation, the up half and the product (3f); one sample adds the rotated query and key
    beside the QKV output they view."""
    h, q, kv, d, f = 48, 48, 16, 8, 80
    per = activation_bytes_per_token(LLAMA, MemoryLayout())
    assert per["residual"] == 2 * (3 * h * 4 + 4)
    assert per["attention"] == ((q + 2 * kv) + 2 * q) * 4 + 6 * 4 + 4 * d * 4
    assert per["mlp"] == 5 * f * 4
    one = activation_bytes_per_token(LLAMA, MemoryLayout(), one_sample=True)
    assert one["attention"] - per["attention"] == (q + kv) * 4
    bf16 = activation_bytes_per_token(LLAMA, MemoryLayout(precision="bf16"))
    assert bf16["residual"] == 2 * ((2 * 4 + 2) * h + 4)  # the norm upcasts to float32


def test_zigzag_share_matches_the_engines_slicing():
    total, prompt = np.array([12, 7, 30]), np.array([4, 2, 11])
    for cp in (2, 3):
        rows = tokens = 0
        for r in range(cp):
            share = micro_batch_share(total, prompt, cp_size=cp, cp_rank=r)
            expected_rows = sum(sum(b - a for a, b in zigzag_slice(
                int(t), int(t - p), cp_rank=r, cp_size=cp).logits_ranges)
                for t, p in zip(total, prompt))
            assert share.response_rows == expected_rows
            rows += share.response_rows
            tokens += share.tokens
        assert rows == int((total - prompt).sum()) and tokens == int(total.sum())
    # by hand: 12 tokens, prompt 4, cp 2: chunks of 3; rank 0 keeps [0, 3) and [9, 12)
    # (logit rows 9, 10), rank 1 [3, 9) (rows 3 .. 8)
    assert micro_batch_share([12], [4], cp_size=2, cp_rank=0).response_rows == 2
    assert micro_batch_share([12], [4], cp_size=2, cp_rank=1).response_rows == 6
    assert micro_batch_share([12], [4], cp_size=2, cp_rank=1).row_tokens == 12


def test_pipeline_in_flight_follows_megatrons_schedules():
    # 1F1B, pp 2: stage 0 holds two micro-batches before each backward, stage 1 one
    assert pipeline_in_flight(4, MemoryLayout(pp=2), 0) == [
        [(0, 0), (1, 0)], [(1, 0), (2, 0)], [(2, 0), (3, 0)], [(3, 0)]]
    assert pipeline_in_flight(3, MemoryLayout(pp=2), 1) == [[(0, 0)], [(1, 0)], [(2, 0)]]
    assert pipeline_in_flight(3, MemoryLayout(pp=4), 0)[0] == [(0, 0), (1, 0), (2, 0)]
    # interleaved pp 2 x vpp 2, groups of 2: stage 0 warms up with 2 + 2 = 4 chunk forwards
    # (mb 0, 1 on chunk 0, then on chunk 1) and runs a fifth before the first backward
    first = pipeline_in_flight(4, MemoryLayout(pp=2, vpp=2, mb_group=2), 0)[0]
    assert first == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert len(pipeline_in_flight(4, MemoryLayout(pp=2, vpp=2, mb_group=2), 1)[0]) == 3


def _schedule(dp=1, cp=1, cap=400, n=24, seed=0):
    rng = np.random.default_rng(seed)
    resp = np.minimum(rng.pareto(1.2, n) * 30 + 8, 300).astype(int)
    ro = Rollouts(prompt_len=rng.integers(4, 20, n), response_len=resp,
                  rollout_id=np.arange(n) // 3)
    return build_schedule(ro, ScheduleConfig(dp=dp, cp=cp, global_batch_size=4,
                                             max_tokens_per_gpu=cap))


def test_predict_memory_table():
    sched = _schedule(dp=2)
    table = predict_memory(sched, TOY, MemoryLayout(dp=2), hardware_memory_gib=80)
    assert len(table) == 2 * len(sched.steps) and set(table["rank"]) == {0, 1}
    first, later = table[table.step == 0], table[table.step == 1]
    assert (first["optimizer"] == 0).all()  # Adam's moments come with the first update
    assert (later["optimizer"] == static_memory(TOY, MemoryLayout())["optimizer"]).all()
    kinds = ["params", "grads", "optimizer", "activations", "cp_kv", "logits", "backward",
             "buffers"]
    assert (table[kinds].sum(axis=1) == table["peak_bytes"]).all()
    assert (~table["over_memory"]).all() and (table["headroom_bytes"] > 0).all()
    tiny = predict_memory(sched, TOY, MemoryLayout(dp=2), hardware_memory_gib=1e-3)
    assert tiny["over_memory"].all()
    # the micro-batch that sets a rank's peak is one the rank trains
    for _, row in table[table.peak_phase != "update"].iterrows():
        step = sched.steps[row.step]
        assert set(row.peak_micro_batches) <= set(step.rank_bins[row.pool_rank])
    bf16 = predict_memory(sched, TOY, MemoryLayout(dp=2, precision="bf16"))
    assert (bf16[bf16.step == 0]["optimizer"] == 4 * parameter_count(TOY, MemoryLayout())).all()


def test_the_peak_micro_batch_is_the_largest_and_pp_holds_several():
    sched = _schedule()
    table = predict_memory(sched, TOY, MemoryLayout())
    for k, step in enumerate(sched.steps):
        sizes = [int(sched.rollouts.total_len[mb].sum()) for mb in step.micro_batches]
        row = table[table.step == k].iloc[0]
        assert row.peak_micro_batches == (int(np.argmax(sizes)),)
    piped = predict_memory(sched, TOY, MemoryLayout(pp=2))
    assert max(len(m) for m in piped[piped.pp_rank == 0].peak_micro_batches) == 2


def test_bad_inputs_say_what_is_allowed():
    with pytest.raises(ValueError, match="recompute='some': choose one of none, selective"):
        MemoryLayout(recompute="some")
    with pytest.raises(ValueError, match="vpp=2 needs pp > 1"):
        MemoryLayout(vpp=2)
    with pytest.raises(ValueError, match="the schedule is dp 1 x cp 1, the layout dp 2"):
        predict_memory(_schedule(), TOY, MemoryLayout(dp=2))
    with pytest.raises(ValueError, match="3 layers do not split evenly over pp \\* vpp = 2"):
        MemoryLayout(pp=2).stage_layers(ModelShape(**{**LLAMA.to_dict(), "num_layers": 3}))
    with pytest.raises(ValueError, match="model must be a ModelShape"):
        predict_memory(_schedule(), "toy", MemoryLayout())


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 5000), more=st.integers(1, 5000),
       model=st.sampled_from([TOY, LLAMA]), tp=st.sampled_from([1, 2]),
       recompute=st.sampled_from(["none", "selective", "full"]))
def test_more_tokens_never_need_less_and_recomputation_never_more(tokens, more, model, tp,
                                                                   recompute):
    layout = MemoryLayout(tp=tp, recompute=recompute)

    def total(n, lay):
        mb = micro_batch_share([n], [1])
        m = micro_batch_memory(model, lay, mb, layers=model.num_layers, last=True)
        return m["activations"] + max(m["logits"], m["backward"])

    assert total(tokens + more, layout) >= total(tokens, layout)
    assert total(tokens, layout) <= total(tokens, MemoryLayout(tp=tp))
    assert total(tokens, MemoryLayout(tp=2, recompute=recompute)) <= total(
        tokens, MemoryLayout(tp=1, recompute=recompute))


def test_schedule_stats_gain_the_predicted_peak_per_rank():
    sched = build_schedule(_schedule(dp=2).rollouts, ScheduleConfig(
        dp=2, global_batch_size=4, max_tokens_per_gpu=400), TOY)
    stats = sched.stats(MemoryLayout(dp=2, tp=2, pp=2), hardware_memory_gib=1e-3)
    pred = predict_memory(sched, TOY, MemoryLayout(dp=2, tp=2, pp=2))
    for _, row in stats.iterrows():
        mine = pred[(pred.step == row.step) & (pred.pool_rank == row["rank"])]
        assert row.peak_bytes == mine["peak_bytes"].max()  # the busiest of its tp x pp GPUs
    assert stats["over_memory"].all()
    assert "peak_bytes" not in sched.stats().columns
    with pytest.raises(ValueError, match="needs a schedule built with a model shape"):
        _schedule().stats(MemoryLayout())


def test_policy_tables_say_in_bytes_where_a_policy_breaks_the_cap():
    """slime's --balance-by-flops packs by FLOPs and may break the token cap (its docs: "may
    OOM if the cap is tight"): the policy table shows it as a higher predicted peak than
    first-fit at the same cap, and as GPUs over a memory between the two."""
    from varbatch_kit.analysis.sweeps import policy_table

    ro = _schedule(n=48, seed=0).rollouts  # by FLOPs: a 435-token micro-batch, cap 400
    # one step (every rollout): its peak is its largest micro-batch, as the cap intends
    config = ScheduleConfig(dp=2, global_batch_size=ro.num_rollouts, max_tokens_per_gpu=400)
    table = policy_table(ro, config, TOY, [("first_fit", "strided"), ("flops_kk", "flops_kk")],
                         memory=MemoryLayout(dp=2)).set_index("packing")
    capped, by_flops = table.loc["first_fit"], table.loc["flops_kk"]
    assert by_flops["cap_violations"] > 0 and capped["cap_violations"] == 0
    assert by_flops["peak_gib"] > capped["peak_gib"]
    between = (capped["peak_gib"] + by_flops["peak_gib"]) / 2
    over = policy_table(ro, config, TOY, [("first_fit", "strided"), ("flops_kk", "flops_kk")],
                        memory=MemoryLayout(dp=2), hardware_memory_gib=between)
    assert list(over["over_memory"] > 0) == [False, True]
    with pytest.raises(ValueError, match="memory= needs a model shape"):
        policy_table(ro, config, None, memory=MemoryLayout(dp=2))


def test_policy_tables_by_trace_pass_the_memory_layout_at_their_dp():
    from varbatch_kit.analysis.sweeps import policy_table_by_trace

    traces = {"a": _schedule(n=24, seed=0).rollouts, "b": _schedule(n=24, seed=1).rollouts}
    table = policy_table_by_trace(traces, TOY, dp=2, max_tokens_per_gpu=400, steps=2,
                                  policies=[("first_fit", "strided")],
                                  memory=MemoryLayout(dp=7), hardware_memory_gib=1e-3)
    assert (table["peak_gib"] > 0).all() and (table["over_memory"] > 0).all()
    assert list(table["trace"]) == ["a", "b"]


def test_shapes_the_model_does_not_cover_are_refused_not_under_predicted():
    """Multi-latent attention, shared experts, layers mixing dense and MoE MLPs and a mixture
    of experts under tensor parallelism would be mis-counted (DeepSeek-V3 as a dense model:
    39 billion parameters instead of 671): every entry point refuses them, naming what is
    missing; dense shapes and a mixture of experts in every layer pass."""
    from dataclasses import replace

    from varbatch_kit.core.memory import (
        activation_bytes_per_token,
        not_modelled,
        parameter_count,
        static_memory,
    )

    dense = ModelShape.preset("qwen3-8b")
    assert not_modelled(dense) is None
    moe = replace(dense, num_experts=8, moe_ffn_hidden_size=512, name="tiny-moe")
    assert not_modelled(moe) is None and not_modelled(moe, MemoryLayout(dp=2, ep=2)) is None
    assert "tensor parallelism (tp=2)" in not_modelled(moe, MemoryLayout(tp=2))
    shared = replace(moe, moe_shared_expert_intermediate_size=256)
    mixed = replace(moe, moe_layer_freq=tuple([0] + [1] * (moe.num_layers - 1)))
    assert "shared experts" in not_modelled(shared)
    assert "layers mixing dense and mixture-of-experts MLPs" in not_modelled(mixed)
    mla = ModelShape.preset("deepseek-v3")
    assert "multi-latent attention" in not_modelled(mla)
    one = MemoryLayout()
    for fn in (parameter_count, static_memory, activation_bytes_per_token):
        with pytest.raises(ValueError, match=r"'tiny-moe' has shared experts"):
            fn(replace(shared, name="tiny-moe"), one)


def test_a_mixture_of_experts_counts_its_router_and_this_ranks_experts():
    """Parameters by hand: per layer the router [E, h] and E / ep experts of 3 f h (gated),
    no dense MLP; the distributed optimizer shards the experts over dp * cp / ep ranks."""
    from dataclasses import replace

    from varbatch_kit.core.memory import _layer_params, parameter_count, static_memory

    moe = replace(ModelShape.preset("qwen3-8b"), num_experts=8, moe_ffn_hidden_size=512,
                  name="tiny-moe")
    h, f, e = moe.hidden_size, 512, 8
    dense = replace(moe, num_experts=None, ffn_hidden_size=1)
    attention_and_norms = _layer_params(dense, 1) - 3 * h  # less its [gate; up] and down of f=1
    assert _layer_params(moe, 1, 1) == attention_and_norms + e * h + e * 3 * f * h
    assert _layer_params(moe, 1, 4) == attention_and_norms + e * h + 2 * 3 * f * h
    one, four = parameter_count(moe, MemoryLayout(dp=4)), parameter_count(moe, MemoryLayout(
        dp=4, ep=4))
    assert one - four == moe.num_layers * 6 * 3 * f * h
    # the distributed optimizer: the experts over their dp*cp/ep = 1 replica (no sharding),
    # the rest over the 4 ranks
    dist = MemoryLayout(dp=4, ep=4, distributed_optimizer=True)
    experts = moe.num_layers * 2 * 3 * f * h
    want = (-(-(four - experts) // 4) + experts) * 8  # fp32: two Adam moments of 4 bytes
    assert static_memory(moe, dist)["optimizer"] == want
