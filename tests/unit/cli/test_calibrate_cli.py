"""``varbatch-kit calibrate`` on a tiny sweep: the model JSON, the CSV, the calibration record."""

import json

import numpy as np
import pandas as pd
import pytest

from varbatch_kit.analysis.cost_model import MicroBatchCostModel
from varbatch_kit.cli.main import main
from varbatch_kit.train.measure.calibration import grid_compositions, random_compositions


def test_compositions_vary_sum_l_and_sum_l_sq_independently():
    grid = grid_compositions(512, budgets=3, splits=(1, 2, 4), min_len=32)
    assert [512] in grid and [128] * 4 in grid and [256, 256] in grid
    sums = {(sum(c), sum(x * x for x in c)) for c in grid}
    assert len(sums) == len(grid)  # every composition differs in (sum L, sum L^2)
    assert len({s for s, _ in sums}) == 3  # three budgets, each split several ways
    held = random_compositions(5, 512, min_len=32, seed=1)
    assert len(held) == 5 and all(sum(c) <= 512 and min(c) >= 32 for c in held)
    with pytest.raises(ValueError, match="max_tokens"):
        grid_compositions(16, min_len=16)


def test_cli_calibrate_writes_the_model(tmp_path, capsys):
    out, csv = tmp_path / "cm.json", tmp_path / "cal.csv"
    rc = main(["calibrate", "--model.num-layers", "1", "--model.hidden-size", "16",
               "--model.num-attention-heads", "2", "--model.vocab-size", "32",
               "--max-tokens", "128", "--budgets", "2", "--splits", "1", "2", "4",
               "--min-len", "8", "--heldout", "3", "--repeats", "1", "--warmup", "1",
               "--device", "cpu", "--quiet", "--out", str(out), "--csv", str(csv),
               "--record", str(tmp_path / "record.json")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "held-out R2" in text and str(out) in text
    model = MicroBatchCostModel.load(out)
    assert model.source == "calibrate" and model.device == "cpu" and model.n_fit == 6
    assert min(model.c0, model.c1, model.c2) >= 0 and 0 < model.forward_share < 1
    table = pd.read_csv(csv)
    assert len(table) == 9 and table["heldout"].sum() == 3
    assert (table["time_s"] > 0).all()
    np.testing.assert_allclose(table["time_s"], table["fwd_s"] + table["bwd_s"])
    np.testing.assert_allclose(table["predicted_s"],
                               model.seconds(table["sum_len"], table["sum_len_sq"]))
    record = json.loads((tmp_path / "record.json").read_text())
    assert len(record["measurements"]) == 9 and record["model"]["c2"] == model.c2
    assert record["info"]["repeats"] == 1 and record["info"]["device"] == "cpu"
    assert main(["calibrate", "--repeats", "0", "--quiet", "--out", str(out)]) == 2
    assert "repeats" in capsys.readouterr().err
