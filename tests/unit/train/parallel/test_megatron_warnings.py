"""megatron-core's "Transformer Engine / Apex is not installed" notices: a fresh interpreter
imports what the workers import, with and without
:func:`~varbatch_kit.train.parallel.megatron_warnings.quiet_optional_dependency_warnings`,
and counts what is said. Only those notices go; other warnings and log lines stay."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
from _paths import REPO

from varbatch_kit.train.parallel.megatron_warnings import (
    OPTIONAL_DEPENDENCY_LOGGERS,
    OPTIONAL_DEPENDENCY_MESSAGES,
    quiet_optional_dependency_warnings,
)

pytestmark = pytest.mark.timeout(300)

FSDP_LOGGER = next(iter(OPTIONAL_DEPENDENCY_LOGGERS))
#: the modules the workers import (train/runs/worker.py, train/model, train/step, ...)
WORKER_IMPORTS = """
    import megatron.core
    from megatron.core import parallel_state, pipeline_parallel, tensor_parallel, transformer
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
"""

SCRIPT = """
    import json, logging, sys, warnings

    logs = []

    class Keep(logging.Handler):
        def emit(self, record):
            logs.append(record.getMessage())

    logging.basicConfig(level=logging.DEBUG, handlers=[Keep()])
    warnings.simplefilter("always")  # every warning, each time (no "default" dedup)
    if QUIET:
        from varbatch_kit.train.parallel.megatron_warnings import (
            quiet_optional_dependency_warnings)
        quiet_optional_dependency_warnings()
    with warnings.catch_warnings(record=True) as caught:
    {imports}
        # controls: another megatron warning, the same words from another module, another
        # line of the FSDP logger: all still said
        warnings.warn_explicit("some other megatron notice", UserWarning, "m.py", 1,
                               module="megatron.core.other")
        warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm",
                               UserWarning, "mine.py", 1, module="my_project")
        logging.getLogger("{fsdp}").warning("another FSDP line")
    print(json.dumps({{"warnings": [str(w.message) for w in caught], "logs": logs}}))
"""


def said(quiet: bool) -> dict:
    code = f"QUIET = {quiet}\n" + textwrap.dedent(SCRIPT).format(
        imports=textwrap.indent(textwrap.dedent(WORKER_IMPORTS), " " * 4), fsdp=FSDP_LOGGER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def notices(out: dict) -> list[str]:
    """The optional-dependency notices among what was said."""
    log_patterns = list(OPTIONAL_DEPENDENCY_LOGGERS.values())
    return ([w for w in out["warnings"] if any(re.match(p, w, re.I)
                                               for p in OPTIONAL_DEPENDENCY_MESSAGES)]
            + [m for m in out["logs"] if any(re.match(p, m) for p in log_patterns)])


CONTROLS = ("some other megatron notice", "Apex is not installed. Falling back to Torch Norm",
            "another FSDP line")


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed (the [train] extra)")
def test_the_filter_hides_the_optional_dependency_notices_and_nothing_else():
    loud, quiet = said(False), said(True)
    before = notices(loud)
    # without: every notice kind, several times (one per megatron module that checks)
    for pattern in (*OPTIONAL_DEPENDENCY_MESSAGES, *OPTIONAL_DEPENDENCY_LOGGERS.values()):
        assert any(re.match(pattern, m) for m in before), (pattern, before)
    assert len(before) >= 6, before
    # with: none of them; the controls, and megatron's other warnings, still said
    mine = "Apex is not installed. Falling back to Torch Norm"
    assert [m for m in notices(quiet) if m != mine] == []
    assert quiet["warnings"].count(mine) == 1  # the control from my_project alone
    for control in CONTROLS:
        assert control in quiet["warnings"] + quiet["logs"], control
    assert (set(loud["warnings"]) - {m for m in before}) <= set(quiet["warnings"])


def test_calling_it_twice_adds_no_second_filter():
    with warnings.catch_warnings():
        quiet_optional_dependency_warnings()
        n = len(warnings.filters)
        quiet_optional_dependency_warnings()
        assert len(warnings.filters) == n
        logger = logging.getLogger(FSDP_LOGGER)
        assert len(logger.filters) == 1
    logger.filters.clear()
