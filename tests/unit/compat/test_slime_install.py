"""``compat.slime.install()`` replaces the function slime's rollout manager calls.

slime's ``slime.ray.rollout`` imports ray and sglang, which this environment does not
have, so this test builds a **stand-in module registered under slime's exact module
path** ``slime.ray.rollout``: like slime's, it binds ``build_dp_schedule`` by
``from slime.utils.dp_schedule import build_dp_schedule`` (a stand-in
``slime.utils.dp_schedule`` whose function returns a marker) and its
``split_train_data_by_dp`` calls the name through the module's globals, as
``RolloutManager._split_train_data_by_dp`` does. The real module, imported from slime's
checkout with ray/sglang/wandb stubbed, is patched the same way by
``scripts/record_slime_invariants.py`` (its result:
``tests/golden/invariants/slime_invariants.json``,
checked in ``test_slime_policy_invariants.py``).
"""

import importlib
import sys
import types
from types import SimpleNamespace

import pytest
from _factories import SLIME_MODEL_ARGS as MODEL_ARGS

from varbatch_kit.compat import slime as compat
from varbatch_kit.compat.slime import SlimeCompatError, SlimeNotImportableError
from varbatch_kit.compat.slime.patch import CALL_SITE

ARGS = SimpleNamespace(use_dynamic_batch_size=True, max_tokens_per_gpu=100, micro_batch_size=1,
                       balance_data=False, balance_by_flops=False, global_batch_size=6,
                       **MODEL_ARGS)
TPC = dict(dp_size=2, cp_size=1, vpp_size=1, microbatch_group_size_per_vp_stage=1)
LENGTHS = [90, 90, 10, 10, 50, 50]

CALLER_SOURCE = '''
from slime.utils.dp_schedule import build_dp_schedule

def split_train_data_by_dp(args, train_parallel_config, data):
    total_lengths = [len(t) for t in data["tokens"]]
    return build_dp_schedule(args, train_parallel_config, total_lengths,
                             global_batch_size=args.global_batch_size,
                             rollout_indices=data["rollout_ids"])
'''


def slimes_own(args, train_parallel_config, total_lengths, *, global_batch_size,
               rollout_indices):
    return "slime's own schedule"


@pytest.fixture
def rollout_module(monkeypatch):
    """Stand-ins for ``slime``, ``slime.utils.dp_schedule`` and ``slime.ray.rollout``."""
    for name in ("slime", "slime.utils", "slime.ray"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    dp = types.ModuleType("slime.utils.dp_schedule")
    dp.build_dp_schedule = slimes_own
    monkeypatch.setitem(sys.modules, "slime.utils.dp_schedule", dp)
    mod = types.ModuleType("slime.ray.rollout")
    monkeypatch.setitem(sys.modules, "slime.ray.rollout", mod)
    exec(compile(CALLER_SOURCE, "slime/ray/rollout.py", "exec"), mod.__dict__)
    return mod


DATA = {"tokens": [[1] * n for n in LENGTHS], "rollout_ids": list(range(6))}


def test_call_site_is_slimes_rollout_module():
    assert CALL_SITE == ("slime.ray.rollout", "build_dp_schedule")


def test_install_balanced_then_uninstall(rollout_module):
    assert rollout_module.split_train_data_by_dp(ARGS, TPC, DATA) == "slime's own schedule"
    uninstall = compat.install()  # packing="balanced"
    assert compat.installed_policy() == ("balanced", None)
    got = rollout_module.split_train_data_by_dp(ARGS, TPC, DATA)
    want = compat.build_dp_schedule(SimpleNamespace(**vars(ARGS), varbatch_packing="balanced"),
                                    TPC, LENGTHS, global_batch_size=6,
                                    rollout_indices=list(range(6)))
    assert got == want
    assert [sum(LENGTHS[i] for i in p) for p in got[0]] == [150, 150]
    # slime's args namespace is not modified
    assert not hasattr(ARGS, "varbatch_packing")
    uninstall()
    assert rollout_module.build_dp_schedule is slimes_own
    assert compat.installed_policy() is None
    uninstall()  # twice: still slime's
    assert rollout_module.split_train_data_by_dp(ARGS, TPC, DATA) == "slime's own schedule"


def test_install_is_idempotent(rollout_module):
    u1 = compat.install("balanced")
    first = rollout_module.build_dp_schedule
    u2 = compat.install("balanced")
    assert rollout_module.build_dp_schedule is first  # same policy: unchanged
    compat.install("ffd", "flops_kk")  # another policy replaces it; slime's stays underneath
    assert compat.installed_policy() == ("ffd", "flops_kk")
    assert rollout_module.build_dp_schedule.__wrapped_original__ is slimes_own
    u2()
    assert rollout_module.build_dp_schedule is slimes_own
    u1()
    assert rollout_module.build_dp_schedule is slimes_own


def test_install_none_is_slimes_schedule_through_varbatch_kit(rollout_module):
    compat.install(packing=None)
    got = rollout_module.split_train_data_by_dp(ARGS, TPC, DATA)
    assert got == compat.build_dp_schedule(ARGS, TPC, LENGTHS, global_batch_size=6,
                                           rollout_indices=list(range(6)))
    # slime's first fit: [90,10] [90,10] [50,50] -> split to 4, strided over 2 ranks
    assert got == ([[0, 2, 4], [1, 3, 5]], [[[0, 1], [2]], [[0, 1], [2]]], [2], [6])


def test_bad_name_lists_the_choices(rollout_module):
    with pytest.raises(SlimeCompatError, match=r"install\(packing='balancd'\).*'balanced'"):
        compat.install("balancd")
    with pytest.raises(SlimeCompatError, match=r"install\(distribution='x'\).*'strided'"):
        compat.install("ffd", "x")
    assert rollout_module.build_dp_schedule is slimes_own


def test_without_slime_a_clear_import_error(monkeypatch):
    monkeypatch.delitem(sys.modules, "slime.ray.rollout", raising=False)
    monkeypatch.setitem(sys.modules, "slime", None)  # import slime fails here
    with pytest.raises(SlimeNotImportableError,
                       match=r"slime\.ray\.rollout cannot be imported.*"
                             r"--custom-rollout-log-function-path"):
        compat.install()
    assert issubclass(SlimeNotImportableError, ImportError)


def test_a_slime_without_the_call_site_is_refused(rollout_module):
    del rollout_module.build_dp_schedule
    with pytest.raises(SlimeCompatError, match="has no attribute 'build_dp_schedule'"):
        compat.install()


def test_hook_module_installs_on_import(rollout_module, monkeypatch):
    """What ``--custom-rollout-log-function-path ...slime_hook.log_rollout_data`` does."""
    monkeypatch.setenv("VARBATCH_KIT_PACKING", "bfd")
    monkeypatch.delitem(sys.modules, "varbatch_kit.compat.slime.slime_hook", raising=False)
    module_path, _, attr = "varbatch_kit.compat.slime.slime_hook.log_rollout_data".rpartition(".")
    hook = getattr(importlib.import_module(module_path), attr)  # slime's load_function
    assert compat.installed_policy() == ("bfd", None)  # on import, slime.ray.rollout loaded
    assert hook(0, ARGS, [], None, 1.0) is False  # slime's own logging still runs
    assert compat.installed_policy() == ("bfd", None)
    sys.modules[module_path].uninstall()
    assert rollout_module.build_dp_schedule is slimes_own
    hook(1, ARGS, [], None, 1.0)  # uninstalled: the hook does not install again
    assert rollout_module.build_dp_schedule is slimes_own
    monkeypatch.delitem(sys.modules, module_path)


def test_hook_module_imported_without_slime_does_nothing(monkeypatch):
    monkeypatch.delitem(sys.modules, "slime.ray.rollout", raising=False)
    monkeypatch.delitem(sys.modules, "varbatch_kit.compat.slime.slime_hook", raising=False)
    monkeypatch.setenv("VARBATCH_KIT_PACKING", "slime")
    hook_mod = importlib.import_module("varbatch_kit.compat.slime.slime_hook")
    assert hook_mod._policy_from_env() == (None, None)  # "slime": slime's own schedule
    monkeypatch.setitem(sys.modules, "slime", None)
    with pytest.raises(SlimeNotImportableError):  # called outside slime: the clear error
        hook_mod.log_rollout_data(0, ARGS, [], None, 1.0)
    monkeypatch.delitem(sys.modules, "varbatch_kit.compat.slime.slime_hook")
