"""The SmolLM2 checkpoint's default models folder: ``$VARBATCH_KIT_MODELS``, else
``~/.cache/varbatch_kit/models`` (the one call notebooks 05-07 make, without a path)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("filelock")
from varbatch_kit.train.model import smollm2  # noqa: E402


def _complete(folder: Path) -> Path:
    """A finished checkpoint folder as smollm2_checkpoint leaves it (nothing to build)."""
    target = folder / smollm2.MODEL_DIR_NAME
    target.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (target / name).write_text("{}")
    (target / smollm2.MANIFEST).write_text(json.dumps({"source": smollm2.GGUF_NAME}))
    return target


def test_models_dir_reads_the_environment_else_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("VARBATCH_KIT_MODELS", str(tmp_path / "models"))
    assert smollm2.models_dir() == tmp_path / "models"
    monkeypatch.delenv("VARBATCH_KIT_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert smollm2.models_dir() == tmp_path / "home" / ".cache" / "varbatch_kit" / "models"
    monkeypatch.setenv("VARBATCH_KIT_MODELS", "")  # empty: unset
    assert smollm2.models_dir() == tmp_path / "home" / ".cache" / "varbatch_kit" / "models"


def test_checkpoint_without_a_folder_is_the_one_in_the_models_dir(monkeypatch, tmp_path):
    target = _complete(tmp_path / "models")
    monkeypatch.setenv("VARBATCH_KIT_MODELS", str(tmp_path / "models"))
    assert smollm2.smollm2_checkpoint() == target
    # an explicit folder still wins over the environment
    other = _complete(tmp_path / "elsewhere")
    assert smollm2.smollm2_checkpoint(tmp_path / "elsewhere") == other
    # and with the environment unset, the user cache (under HOME)
    monkeypatch.delenv("VARBATCH_KIT_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = _complete(tmp_path / "home" / ".cache" / "varbatch_kit" / "models")
    assert smollm2.smollm2_checkpoint() == home
