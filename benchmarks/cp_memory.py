"""Peak activation memory per rank under all-gather CP: one 8k-token sample at cp 1 / 2 / 4.

One sample of ``--tokens`` tokens (default 8192: a 1024-token prompt and the
rest response) on a small megatron-core GPT (``--layers`` layers of
``--hidden`` width, learned absolute positions, per-sample attention). For
each CP degree ``c`` in ``--cps``, ``c`` forked gloo processes run one forward
+ backward of the training path: at ``c = 1`` the whole row
(:func:`varbatch_kit.train.step.packed_batch.response_logits`), at ``c > 1`` each rank its
zigzag share (:mod:`varbatch_kit.train.parallel.cp_attention`: K/V all-gathered per
layer, the response values all-gathered for the loss), the loss on the rank's
zigzag slice of the response's log-probs.

**Method** (CPU: there is no allocator counter as ``torch.cuda.max_memory_allocated``):
a ``TorchDispatchMode`` sees every tensor an aten (or c10d) op creates during
the forward + backward and follows its storage with a weak reference; the
peak of the live bytes of those storages is the rank's peak activation memory
(every tensor made in the step: saved activations, temporaries, the gathered
K/V, the logits, and the parameter gradients, which are the same at every
``c``; the parameters themselves and the input are outside). Per degree the
table gives the busiest rank's peak, its ratio to ``c = 1``, the forward +
backward wall time of the slowest rank, and the loss summed over the group
(equal at every ``c``: the same computation split). Writes
``build/bench/cp_memory.json``.

Run ``python -m benchmarks.cp_memory`` (``--quick``: 4096 tokens); ``make bench``
runs it as section ``c`` of ``benchmarks.run``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import time
from pathlib import Path

OUT = Path("build/bench/cp_memory.json")


class LiveBytes:
    """Peak live bytes of the storages the ops inside ``with`` create (see the docstring)."""

    def __init__(self) -> None:
        self.live: dict = {}
        self.current = 0
        self.peak = 0

    def __enter__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._sweep()
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        tracker._add(t)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)

    def _add(self, t) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        st = t.untyped_storage()
        key, n = st.data_ptr(), st.nbytes()
        if n == 0 or (key in self.live and not self.live[key][0].expired()):
            return
        self.live[key] = (StorageWeakRef(st), n)
        self.current += n
        self.peak = max(self.peak, self.current)

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]


def _worker(rank: int, size: int, port: int, kw: dict, queue) -> None:
    import numpy as np
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size), LOCAL_RANK=str(rank))
    from varbatch_kit.report.cp import slice_flat_responses_for_cp
    from varbatch_kit.train.parallel.cp_attention import CPShare
    from varbatch_kit.train.parallel.process_setup import setup_process
    from varbatch_kit.train.step.cp_response import cp_response_logits, cp_response_stats
    from varbatch_kit.train.step.packed_batch import pack, response_logits, response_token_stats

    try:
        device = setup_process("cpu", threads=1)
        model = _model(kw, device)
        rng = np.random.default_rng(0)
        tokens, prompt = kw["tokens"], kw["prompt"]
        batch = pack([rng.integers(0, kw["vocab"], tokens)], [prompt], device=device)
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        with LiveBytes() as mem:
            if size == 1:
                stats = response_token_stats(response_logits(model, batch), batch,
                                             at_response_rows=True)
                local = stats["logprob"]
            else:
                share = CPShare(group=dist.group.WORLD, rank=rank, size=size,
                                lengths=batch.lengths, prompt_lens=batch.prompt_lens,
                                slot_ranks=tuple(range(size)))
                stats = cp_response_stats(cp_response_logits(model, batch, share), batch, share)
                local = slice_flat_responses_for_cp(stats["logprob"], batch.lengths,
                                                    batch.response_lens, cp_rank=rank,
                                                    cp_size=size)
            loss = -local.sum()
            loss.backward()
        wall = time.perf_counter() - t0
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        queue.put((rank, {"peak_bytes": mem.peak, "wall_s": wall, "loss": float(total),
                          "local_tokens": int(tokens if size == 1 else share.local_row.numel())}))
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        queue.put((rank, {"error": repr(err)}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _model(kw: dict, device):
    import torch
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from varbatch_kit.train import ModelConfig
    from varbatch_kit.train.config.model_config import resolve_model
    from varbatch_kit.train.model.attention import local_layer_spec
    from varbatch_kit.train.model.gpt import transformer_config

    cfg = resolve_model(ModelConfig(num_layers=kw["layers"], hidden_size=kw["hidden"],
                                    num_attention_heads=kw["heads"], vocab_size=kw["vocab"]))
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
    return GPTModel(config=transformer_config(cfg), transformer_layer_spec=local_layer_spec(),
                    vocab_size=kw["vocab"], max_sequence_length=kw["tokens"],
                    position_embedding_type="learned_absolute",
                    share_embeddings_and_output_weights=False, parallel_output=True).to(device)


def run_degree(size: int, kw: dict) -> list[dict]:
    """One forward + backward on ``size`` forked ranks; each rank's figures, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, size, port, kw, queue)) for r in range(size)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=kw["timeout_s"]) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    errors = {r: g["error"] for r, g in got.items() if "error" in g}
    if errors:
        raise RuntimeError(f"cp={size}: {errors}")
    return [got[r] for r in range(size)]


def measure(tokens: int = 8192, prompt: int = 1024, cps=(1, 2, 4), layers: int = 2,
            hidden: int = 128, heads: int = 4, vocab: int = 1024,
            timeout_s: float = 600) -> list[dict]:
    """Rows of the table (see the module docstring)."""
    import megatron.core  # noqa: F401 - imported once in the parent, before the forks

    import varbatch_kit.train.model.attention  # noqa: F401

    kw = dict(tokens=tokens, prompt=prompt, layers=layers, hidden=hidden, heads=heads,
              vocab=vocab, timeout_s=timeout_s)
    rows, base = [], None
    for c in cps:
        ranks = run_degree(c, kw)
        peak = max(r["peak_bytes"] for r in ranks)
        base = peak if base is None else base
        rows.append({"cp": c, "tokens_per_rank": max(r["local_tokens"] for r in ranks),
                     "peak_activation_mib": peak / 2**20, "vs_cp1": peak / base,
                     "per_rank_mib": [round(r["peak_bytes"] / 2**20, 1) for r in ranks],
                     "fwd_bwd_s": max(r["wall_s"] for r in ranks), "loss": ranks[0]["loss"]})
    return rows


def main(argv=None) -> list[dict]:
    import pandas as pd

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4096 tokens")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--cps", default="1,2,4", help="CP degrees, comma-separated")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    args = ap.parse_args(argv)
    tokens = 4096 if args.quick else args.tokens
    rows = measure(tokens=tokens, prompt=tokens // 8, layers=args.layers, hidden=args.hidden,
                   cps=tuple(int(c) for c in args.cps.split(",")))
    print(f"all-gather CP, one {tokens}-token sample, {args.layers} layers x {args.hidden} "
          "(peak live bytes of the tensors the forward + backward creates, busiest rank)")
    with pd.option_context("display.width", 200):
        print(pd.DataFrame(rows).to_string(index=False, float_format="{:.4g}".format))
    peaks = [r["peak_activation_mib"] for r in rows]
    print("falls with cp:", all(b < a for a, b in zip(peaks, peaks[1:])))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"tokens": tokens, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
