"""Expensive experiments computed once and read back: comparisons and generated rollouts.

A test and a notebook that run the *same* experiment (the SmolLM2 layout matrix,
SmolLM2's generations) share one computation through a cache directory:

- :func:`cached_compare`: :func:`varbatch_kit.train.compare`'s table, stored
  as a pickle;
- :func:`cached_rollouts`: :func:`varbatch_kit.train.rl.generate.generate_rollouts`'
  rollouts, stored as a JSONL trace (with the generation's statistics beside it);
- :func:`cached_rl_loop`: :func:`varbatch_kit.train.rl_loop`'s iterations, kept in
  their own loop folder (read back by resuming the finished loop).

The cache directory is the ``cache_dir`` argument, else the environment
variable ``VARBATCH_KIT_CACHE``; without either, caching is off and every call
computes afresh. An entry is named by a sha256 over **all** its inputs: every
field of every configuration (``repr``), every per-sample field of the rollouts,
the checkpoint's ``config.json``, source manifest and weight-file size, the
versions of varbatch_kit, torch, megatron-core and transformers, and the hash of
the package's source files and model presets (:func:`source_hash`). So a change
of code, configuration, data or library never returns a stale result: it names
another entry. Entries appear atomically (written beside, then renamed) under a
lock, so concurrent callers share one computation.

The notebooks call the real :func:`varbatch_kit.train.compare`,
:func:`varbatch_kit.train.rl_loop` and
:func:`~varbatch_kit.train.rl.generate.generate_rollouts`; the caching is the
harness's. :func:`install_cached_twins` (run in a notebook's kernel before its
cells by :data:`KERNEL_SETUP`: ``make demo``'s kernel setup and the nbval tests'
IPython startup file) replaces those three by their cached twins when
``$VARBATCH_KIT_CACHE`` is set, so a notebook and a test that make the same call
share one computation under the same key.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["CACHE_ENV", "KERNEL_SETUP", "cache_dir", "cache_key", "cached_compare",
           "cached_rl_loop", "cached_rollouts", "install_cached_twins", "source_hash"]

#: the environment variable naming the cache directory (unset: no caching)
CACHE_ENV = "VARBATCH_KIT_CACHE"
_PACKAGE = Path(__file__).resolve().parents[1]


def _lock(path):
    """A file lock (filelock is imported only when a cache is used: the [train] extra)."""
    from filelock import FileLock as _FileLock

    return _FileLock(path)


def cache_dir(path: str | os.PathLike | None = None) -> Path | None:
    """``path``, else ``$VARBATCH_KIT_CACHE``, else ``None`` (caching off)."""
    if path is None:
        path = os.environ.get(CACHE_ENV) or None
    return None if path is None else Path(path).expanduser()


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """sha256 over the package's ``.py`` files and its model presets (path and content)."""
    from varbatch_kit.resources import data_dir

    h = hashlib.sha256()
    for p in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(p.relative_to(_PACKAGE)).encode() + b"\0" + p.read_bytes() + b"\0")
    models = data_dir("models")
    for p in sorted((q for q in models.iterdir() if q.name.endswith(".json")),
                    key=lambda q: q.name):
        h.update(b"models/" + p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _versions() -> dict[str, str]:
    out = {}
    for dist in ("varbatch_kit", "torch", "megatron-core", "transformers"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = ""
    from varbatch_kit._version import __version__

    out["varbatch_kit_source"] = __version__
    return out


def _checkpoint_key(path: Any) -> dict[str, Any]:
    """What identifies a checkpoint directory's content (cheaply: no weight hashing)."""
    if path is None:
        return {}
    d = Path(str(path))
    key: dict[str, Any] = {"path": str(path)}
    for name in ("config.json", "varbatch_kit_source.json"):
        if (d / name).is_file():
            key[name] = (d / name).read_text()
    for p in sorted(d.glob("*.safetensors")):
        key[p.name] = p.stat().st_size
    return key


def cache_key(kind: str, **inputs: Any) -> str:
    """sha256 (hex) of ``kind``, ``inputs`` (JSON, ``repr`` for the rest), versions and source."""
    payload = {"kind": kind, "inputs": inputs, "versions": _versions(),
               "source": source_hash()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=repr).encode()).hexdigest()


def cached_compare(configs: Sequence, rollouts, *, cache_dir: str | os.PathLike | None = None,
                   reference: int | None = None, progress: bool = True, out_dir=None,
                   runs: list | None = None, keep_params=True):
    """:func:`varbatch_kit.train.compare` of ``configs`` on ``rollouts``, computed once per cache.

    The table is read back from the cache when the same configurations (every field), the
    same rollouts, the same ``reference``, versions and package source were compared before;
    else computed and stored. ``runs`` (a list) receives the :class:`Run` objects when the
    table is computed here, nothing when it is read back. Without ``out_dir`` and ``runs``
    the runs' folders (steps, saved parameters) are removed once the table is made; the
    table is the result, so only the references write parameter files
    (``keep_params=False``, the same table). ``keep_params`` otherwise as in :func:`compare`
    (files only: not part of the key). Caching off (no ``cache_dir``, no
    ``$VARBATCH_KIT_CACHE``): plain :func:`compare`.
    """
    import pandas as pd

    from varbatch_kit.train.runs.checkpoint import rollouts_hash

    configs = list(configs)
    where = _resolve(cache_dir)
    if where is None:
        return _compare(configs, rollouts, reference, progress, out_dir, runs, keep_params)
    key = cache_key("compare", configs=[repr(c) for c in configs],
                    models=[_checkpoint_key(c.model.path) for c in configs],
                    rollouts=rollouts_hash(rollouts), reference=reference)
    path = where / f"compare-{key[:24]}.pkl"
    with _lock(where / ".compare.lock"):
        if path.is_file():
            return pd.read_pickle(path)
        table = _compare(configs, rollouts, reference, progress, out_dir, runs, keep_params)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        table.to_pickle(tmp)
        tmp.replace(path)
    return table


def cached_rollouts(checkpoint: str | os.PathLike, *,
                    cache_dir: str | os.PathLike | None = None, stats=None,
                    **generate_kwargs: Any):
    """:func:`~varbatch_kit.train.rl.generate.generate_rollouts` of ``checkpoint``, made once.

    Stored as a JSONL trace (``extra=True``) keyed by the generation arguments, the
    checkpoint, versions and package source; every call, the first included, returns the
    rollouts read back from that trace, so all callers get the same object. ``stats``
    (a :class:`~varbatch_kit.train.rl.generate.GenerationStats`) receives the statistics of
    the generation that made the trace. Caching off: plain ``generate_rollouts``.
    """
    from varbatch_kit.core.traces import read_trace
    from varbatch_kit.train.rl.generate import GenerationStats
    from varbatch_kit.train.rl.generate import generate_rollouts as _maybe_twin

    generate_rollouts = _unwrapped(_maybe_twin)  # never a twin installed in this process
    bad = sorted(set(generate_kwargs) & {"trace_path", "stats", "progress"})
    if bad:
        raise ValueError(f"cached_rollouts sets {bad} itself; pass the generation arguments only")
    where = _resolve(cache_dir)
    if where is None:
        return generate_rollouts(checkpoint, stats=stats, progress=False, **generate_kwargs)
    key = cache_key("rollouts", checkpoint=_checkpoint_key(checkpoint),
                    generate=generate_kwargs)
    path = where / f"rollouts-{key[:24]}.jsonl"
    info = path.with_suffix(".stats.json")
    with _lock(where / ".rollouts.lock"):
        if not path.is_file():
            made = GenerationStats()
            tmp = path.with_suffix(f".{os.getpid()}.jsonl")
            generate_rollouts(checkpoint, trace_path=tmp, stats=made, progress=False,
                              **generate_kwargs)
            info.write_text(json.dumps(vars(made)) + "\n")
            tmp.replace(path)
    if stats is not None and info.is_file():
        for k, v in json.loads(info.read_text()).items():
            setattr(stats, k, v)
    return read_trace(path)


def cached_rl_loop(config, prompts, *, cache_dir: str | os.PathLike | None = None,
                   progress: bool = True, **kwargs: Any):
    """:func:`varbatch_kit.train.rl_loop` of ``config`` on ``prompts``, computed once per cache.

    The loop runs in ``<cache>/rl_loop-<key>`` (the key: every field of ``config``, the
    checkpoint, ``prompts``, every other argument, versions and package source), resumed
    there: a finished loop is read back from its iteration records, an interrupted one
    continues. Caching off: ``kwargs`` must hold ``out_dir`` (plain :func:`rl_loop`).
    """
    from varbatch_kit.train.rl.rl_loop import rl_loop as _maybe_twin

    rl_loop = _unwrapped(_maybe_twin)
    where = _resolve(cache_dir)
    if where is None:
        return rl_loop(config, prompts, progress=progress, **kwargs)
    if "out_dir" in kwargs or "resume" in kwargs:
        raise ValueError("cached_rl_loop: out_dir and resume are the cache's (give cache_dir, "
                         "or call rl_loop)")
    key = cache_key("rl_loop", config=repr(config), model=_checkpoint_key(config.model.path),
                    prompts=repr(prompts), arguments=kwargs)
    with _lock(where / ".rl_loop.lock"):
        return rl_loop(config, prompts, out_dir=where / f"rl_loop-{key[:24]}", resume=True,
                       progress=progress, **kwargs)


def _compare(configs, rollouts, reference, progress, out_dir, runs, keep_params):
    from varbatch_kit.train.runs import comparison

    compare = _unwrapped(comparison.compare)
    if out_dir is not None or runs is not None:
        return compare(configs, rollouts, reference=reference, out_dir=out_dir,
                       progress=progress, runs=runs, keep_params=keep_params)
    with tempfile.TemporaryDirectory(prefix="varbatch_compare_") as tmp:  # files: none kept
        return compare(configs, rollouts, reference=reference, out_dir=tmp, progress=progress,
                       keep_params=False)


# ------------------------------------------------------------------ the notebooks' harness
#: the code a notebook kernel runs before the notebook's cells (``make demo`` puts it in its
#: kernel setup cell; the nbval tests in an IPython startup file): the cached twins when
#: ``$VARBATCH_KIT_CACHE`` is set, nothing otherwise (nor without the [train] extra)
KERNEL_SETUP = """\
try:
    from varbatch_kit.cli.experiment_cache import install_cached_twins as _vbk_twins
    _vbk_twins()
    del _vbk_twins
except ImportError:  # no [train] extra: the notebooks that need it say so themselves
    pass
"""


def _unwrapped(fn):
    """``fn`` itself, or the function a cached twin (:func:`install_cached_twins`) stands for."""
    return getattr(fn, "__vbk_original__", fn)


def _twin(original, cached):
    @functools.wraps(original)
    def twin(*args, **kwargs):
        return cached(original, *args, **kwargs)

    twin.__vbk_original__ = original
    return twin


def _compare_twin(original, configs, rollouts, *, reference=None, out_dir=None, progress=True,
                  runs=None, keep_params=True):
    return cached_compare(configs, rollouts, reference=reference, out_dir=out_dir,
                          progress=progress, runs=runs, keep_params=keep_params)


def _rl_loop_twin(original, config, prompts, *, out_dir=None, resume=False, progress=True,
                  **kwargs):
    # the loop runs in the cache's folder for its key (resumed there), not in out_dir
    return cached_rl_loop(config, prompts, progress=progress, **kwargs)


def _generate_twin(original, model=None, *args, **kwargs):
    # only a checkpoint folder named by path is cached (a loaded model, a trace file to
    # write, a progress bar, a tokenizer: the real call; the RL loop passes a loaded model)
    if args or not isinstance(model, (str, os.PathLike)) or (
            set(kwargs) & {"trace_path", "progress", "tokenizer"}):
        return original(model, *args, **kwargs)
    return cached_rollouts(model, **kwargs)


def install_cached_twins(cache_dir: str | os.PathLike | None = None) -> bool:
    """Replace :func:`varbatch_kit.train.compare`, :func:`varbatch_kit.train.rl_loop` and
    :func:`varbatch_kit.train.rl.generate.generate_rollouts` (where a notebook imports them
    from) by :func:`cached_compare`, :func:`cached_rl_loop` and :func:`cached_rollouts`.

    The twins take the originals' arguments and make the same cache call a test makes, so
    the keys match: ``compare(configs, rollouts, ...)`` is ``cached_compare(configs,
    rollouts, ...)``; ``rl_loop(config, prompts, out_dir=D, **kw)`` runs in the cache's loop
    folder (``out_dir`` and ``resume`` are the cache's); ``generate_rollouts(path, **kw)`` is
    ``cached_rollouts(path, **kw)`` when the model is a checkpoint path and no
    ``trace_path``, ``progress`` or ``tokenizer`` is given (else the real call). Only in the
    process that calls it (a notebook's kernel); ``cache_dir`` (else
    ``$VARBATCH_KIT_CACHE``) is exported to the environment. Returns False (and changes
    nothing) when caching is off; installing twice keeps one layer of twins.
    """
    where = _resolve(cache_dir)
    if where is None:
        return False
    os.environ[CACHE_ENV] = str(where)
    import varbatch_kit.train as train
    from varbatch_kit.train.rl import generate

    train.compare = _twin(_unwrapped(train.compare), _compare_twin)
    train.rl_loop = _twin(_unwrapped(train.rl_loop), _rl_loop_twin)
    generate.generate_rollouts = _twin(_unwrapped(generate.generate_rollouts), _generate_twin)
    return True


def _resolve(path) -> Path | None:
    where = cache_dir(path)
    if where is not None:
        where.mkdir(parents=True, exist_ok=True)
    return where
