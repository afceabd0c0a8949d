"""Layout invariance with real torch.distributed (gloo) worker processes.

Worlds of 1, 2 and 4 ranks cover (dp, cp) in {(1,1), (1,2), (2,1), (1,4), (2,2),
(4,1)}; the reference gradient is the in-process dp=1, cp=1 one. Every rank computes
only its own share;
reports, gradients and logs meet through real all_reduce / all_gather_object, and
advantages whitened over the group (``masked_whiten``) match one process's whitening.
"""


import pytest
import torch
from _report_cases import emulated_gradient, mixed_case, relative_difference, report_gradient
from _spawn import run_ranks

from varbatch_kit.report import get_report_mode
from varbatch_kit.report.objective import masked_whiten

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

WORKER_TIMEOUT_S = 120



def run_world(world: int, outdir) -> list[dict]:
    """Spawn ``world`` gloo ranks, wait with a deadline, return each rank's results."""
    from _report_dist_worker import run

    return run_ranks(run, world, outdir, timeout_s=WORKER_TIMEOUT_S)


@pytest.fixture(scope="module")
def reference_gradients():
    case = mixed_case()
    out = {}
    for name in ("per_rollout_mean", "per_token"):
        mode = get_report_mode(name)
        out[name] = emulated_gradient(mode, case, [[list(range(case.n))]], 1)
        assert relative_difference(out[name], report_gradient(mode, case)) < 1e-12
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_reports_gradients_and_logs_across_real_ranks(world, tmp_path, reference_gradients):
    ranks = run_world(world, tmp_path)
    layouts = [(dp, world // dp) for dp in (1, 2, 4) if world % dp == 0]
    expected = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(1, 4), (2, 2), (4, 1)]}
    assert layouts == expected[world]
    from _report_dist_worker import whiten_share  # as run_world: the worker module, lazily

    case = mixed_case()
    values, masks = whiten_share(case, 0, 1)
    whole = masked_whiten(values, masks).split([int(m.numel()) for m in case.loss_masks])
    for rank, results in enumerate(ranks):
        assert "error" not in results
        want = torch.cat([whole[i] for i in range(rank, case.n, world)])
        torch.testing.assert_close(results["whiten"], want, rtol=1e-5, atol=1e-5)
        for dp, cp in layouts:
            out = results[(dp, cp)]
            where = f"rank {rank}, dp={dp}, cp={cp}"
            for name in ("per_rollout_mean", "per_token"):
                # §5: 1249.875 from the core (divisor) and the slime compat (slot 0) paths
                for core, compat in out[("1249.875", name)]:
                    assert core == pytest.approx(1249.875, rel=1e-14), where
                    assert compat == pytest.approx(1249.875, rel=1e-14), where
                expected = 8.0 if name == "per_rollout_mean" else 6.5
                for core, compat in out[("small", name)]:
                    assert core == pytest.approx(expected, rel=1e-14), where
                    assert compat == pytest.approx(expected, rel=1e-14), where
                assert out[("unit_grad", name)] == pytest.approx(1249.875, rel=1e-14), where
                grad = out[("mlp_grad", name)]
                assert relative_difference(grad, reference_gradients[name]) < 1e-6, where
            reduced, error = out["rollout_log"]
            if rank == 0:
                assert reduced["log_probs"] == pytest.approx(1249.875, rel=1e-14)
                assert reduced["rank_id"] == pytest.approx((world - 1) / 2)
            else:
                assert reduced is None
            if world == 1:  # one rank cannot disagree with itself
                assert error is None
            else:
                assert error is not None and "'kl' is a (sum, count) pair on ranks [0]" in error
