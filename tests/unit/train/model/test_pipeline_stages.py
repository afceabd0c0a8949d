"""Pipeline stages (varbatch_kit.train.model.pipeline_stages): layers per chunk, names, refusals."""

from __future__ import annotations

import pytest

from varbatch_kit.train.config.pipeline_checks import pipeline_depth_problem
from varbatch_kit.train.model.pipeline_stages import full_name, stage_layers, stage_tensors


@pytest.mark.parametrize("num_layers, pp, vpp, expect", [
    (4, 2, 1, {(0, 0): [0, 1], (1, 0): [2, 3]}),
    # interleaved: chunk v of stage p holds block v * pp + p
    (4, 2, 2, {(0, 0): [0], (1, 0): [1], (0, 1): [2], (1, 1): [3]}),
    (8, 2, 2, {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}),
    (6, 3, 1, {(0, 0): [0, 1], (1, 0): [2, 3], (2, 0): [4, 5]}),
])
def test_stage_layers_cut_the_model_in_megatrons_order(num_layers, pp, vpp, expect):
    got = {(p, v): list(stage_layers(num_layers, pp, vpp, p, v))
           for p in range(pp) for v in range(vpp)}
    assert got == expect
    assert sorted(i for r in got.values() for i in r) == list(range(num_layers))


def test_stage_layers_match_megatrons_layer_offset():
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for pp, vpp in ((2, 1), (2, 2), (4, 2)):
        cfg = TransformerConfig(num_layers=8, hidden_size=8, num_attention_heads=2,
                                pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        for p in range(pp):
            for v in range(vpp):
                offset = get_transformer_layer_offset(cfg, vp_stage=v if vpp > 1 else None,
                                                      pp_rank=p)
                assert stage_layers(8, pp, vpp, p, v).start == offset, (pp, vpp, p, v)


FULL = {
    "embedding.word_embeddings.weight": "E", "embedding.position_embeddings.weight": "P",
    **{f"decoder.layers.{i}.mlp.linear_fc1.weight": f"W{i}" for i in range(4)},
    **{f"decoder.layers.{i}.input_layernorm.weight": f"N{i}" for i in range(4)},
    "decoder.final_layernorm.weight": "F", "output_layer.weight": "O",
}


@pytest.mark.parametrize("pp, vpp", [(2, 1), (2, 2), (4, 1)])
def test_chunk_names_map_to_the_full_models_and_back(pp, vpp):
    seen = {}
    for p in range(pp):
        for v in range(vpp):
            layers = stage_layers(4, pp, vpp, p, v)
            pre, post = p == 0 and v == 0, p == pp - 1 and v == vpp - 1
            local = stage_tensors(FULL, layers, pre_process=pre, post_process=post, tied=False)
            # local layers count from 0 in every chunk
            assert {n.split(".")[2] for n in local if n.startswith("decoder.layers.")} == {
                str(i) for i in range(len(layers))}
            assert ("embedding.word_embeddings.weight" in local) == pre
            assert ("output_layer.weight" in local) == post
            for n, t in local.items():
                name = full_name(n, layers, pre_process=pre, tied=False)
                assert name not in seen and FULL[name] == t
                seen[name] = t
    assert seen == FULL  # every parameter exactly once


def test_tied_embeddings_give_the_last_stage_a_copy_not_saved_twice():
    full = {k: v for k, v in FULL.items() if k != "output_layer.weight"}
    last = stage_tensors(full, range(2, 4), pre_process=False, post_process=True, tied=True)
    assert last["output_layer.weight"] == "E"  # the first stage's embeddings
    assert full_name("output_layer.weight", range(2, 4), pre_process=False, tied=True) is None
    assert full_name("decoder.layers.1.mlp.linear_fc1.weight", range(2, 4), pre_process=False,
                     tied=True) == "decoder.layers.3.mlp.linear_fc1.weight"


def test_what_the_pipeline_cannot_run_is_named():
    from varbatch_kit.train.config.parallel_layout import ParallelLayout

    assert pipeline_depth_problem(num_layers=4, pp=2, vpp=2) is None
    assert pipeline_depth_problem(num_layers=3, pp=1) is None
    msg = pipeline_depth_problem(num_layers=3, pp=2)
    assert msg.startswith("num_layers=3 does not split into pp*vpp=2 equal pipeline chunks")
    # the group rule is the layout's own (no model needed)
    assert ParallelLayout(pp=2, vpp=2, mb_group=2).unsupported() == []
    (msg,) = ParallelLayout(pp=2, vpp=2, mb_group=1).unsupported()
    assert msg.startswith("mb_group=1 with pp=2, vpp=2") and "set mb_group >= 2" in msg
    with pytest.raises(ValueError, match=r"num_layers=6 does not split into pp\*vpp=4"):
        stage_layers(6, 2, 2, 0, 0)
    with pytest.raises(ValueError, match=r"pp_rank=2, vp_stage=0: give a stage in \[0, 2\)"):
        stage_layers(4, 2, 1, 2, 0)


def test_megatrons_interleaved_micro_batch_rule():
    from varbatch_kit.train.config.pipeline_checks import interleaved_count_problem

    assert interleaved_count_problem(4, 2, 2) is None
    assert interleaved_count_problem(5, 3, 2) is None  # 5 % 3 = 2 >= pp
    assert "needs pp <= mb_group <= micro-batches" in interleaved_count_problem(1, 2, 2)
    assert "modulo mb_group to be 0 or >= pp" in interleaved_count_problem(5, 2, 2)


def test_an_interleaved_count_whose_stages_would_not_pair_up_is_refused():
    """2 micro-batches, pp 2, vpp 2, group 2: stage 0 warms up all 4 virtual micro-batches,
    stage 1 only 2, and training hung (a reproducer: the SmolLM2 matrix's short step 2)."""
    from varbatch_kit.train.config.pipeline_checks import interleaved_count_problem

    got = interleaved_count_problem(2, 2, 2, vpp=2)
    assert "keeps all 4 of stage 0's virtual micro-batches in its warm-up (4) but not the " \
           "last stage's (2)" in got and "more than 2 micro-batches per step" in got
    assert interleaved_count_problem(2, 2, 2, vpp=2, forward_only=True) is None  # all warm up
    assert interleaved_count_problem(4, 2, 2, vpp=2) is None  # stage 0 reaches its 1F1B
    assert interleaved_count_problem(3, 3, 3, vpp=2) is not None  # 4 + 3 >= 6 > 3
    assert interleaved_count_problem(6, 3, 3, vpp=2) is None


def test_run_refuses_the_hanging_interleaved_count_before_any_worker(tmp_path):
    from varbatch_kit import Rollouts as R
    from varbatch_kit.train import TrainConfig, run

    rollouts = R.synthetic(8, prompt_len=4, response_len=4, seed=0)
    cfg = TrainConfig().with_(pp=2, vpp=2, mb_group=2, num_layers=4, global_batch_size=8,
                              n_samples_per_prompt=4,
                              max_tokens_per_gpu=48, packing="first_fit")  # 2 per step
    with pytest.raises(ValueError, match=r"step 1, pool rank 0: 2 micro-batches on a rank with "
                                         r"mb_group=2, pp=2, vpp=2"):
        run(cfg, rollouts, out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
