"""Muon against AdamW on the quickstart model (#37): held-out loss at equal tokens, each optimizer at the best
learning rate of a small sweep; optimizer-state bytes per device; the step-time ratio measured side by side.

    python -m jaxpt.data.prepare --output artifacts/sample      # once
    python benchmarks/muon.py [--steps 150] [--adamw-lrs 1e-3,3e-3,1e-2] [--muon-lrs 1e-3,3e-3,1e-2]

Every run is ``configs/quickstart.gin`` (data=2,fsdp=2,tensor=2 on 8 simulated CPU devices) shortened to
``--steps`` (``OptimizerConfig.decay_steps`` = steps, warmup 10% of them), trained by ``jaxpt.train.run_training``
in this process, and scored by its final full held-out evaluation (``heldout_loss``, nats per token). The step
times are measured afterwards on one synthetic batch, alternating AdamW and Muon steps (``--timing-rounds``
rounds of one step each, after a warm-up), so both see the same machine load; the ratio is of the medians.
Muon uses ``OptimizerConfig.muon_consistent_rms = 0.2`` (Liu et al. 2025), so both sweeps cover the same range.
Figures only, never pass/fail.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def _cfg(alg: str, lr: float, steps: int, workdir: pathlib.Path, data: pathlib.Path):
    from jaxpt import config as C
    b = [f"OptimizerConfig.algorithm = {alg!r}", f"OptimizerConfig.peak_learning_rate = {lr}",
         f"OptimizerConfig.decay_steps = {steps}", f"OptimizerConfig.warmup_steps = {max(steps // 10, 1)}",
         f"DataConfig.train_path = {str(data / 'train.jsonl.gz')!r}",
         f"DataConfig.heldout_path = {str(data / 'heldout.jsonl.gz')!r}",
         f"DataConfig.tokenizer_path = {str(data / 'tokenizer.model')!r}",
         "TrainConfig.eval_every = 0", "TrainConfig.progress_bar = False", "CheckpointConfig.enabled = False",
         f"TrainConfig.workdir = {str(workdir)!r}"]
    return C.parse([str(REPO / "configs/quickstart.gin")], b, steps=steps)


def sweep(alg: str, lrs: list[float], steps: int, out: pathlib.Path, data: pathlib.Path) -> dict[float, float]:
    from jaxpt import train as T
    losses = {}
    for lr in lrs:
        final = T.run_training(_cfg(alg, lr, steps, out / f"{alg}-lr{lr:g}", data))
        losses[lr] = float(final["heldout_loss"])
        print(f"{alg:>5} lr {lr:<8g} held-out loss {losses[lr]:.4f} (train loss {final['train_loss']:.4f}, "
              f"{final['train_time_s']:.0f} s)", flush=True)
    return losses


def state_bytes_per_device(built) -> int:
    import jax
    import numpy as np
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
               for x in jax.tree.leaves(built.spec.abstract.opt_state))


def side_by_side(lrs: dict[str, float], steps: int, out: pathlib.Path, data: pathlib.Path, rounds: int) -> None:
    import jax
    from conftest import packed_batch
    from jaxpt.run import build as builder
    built, state, times = {}, {}, {}
    for alg, lr in lrs.items():
        cfg = _cfg(alg, lr, steps, out / f"timing-{alg}", data)
        built[alg] = builder.build_for(cfg)  # the vocabulary from DataConfig.tokenizer_path
        state[alg], times[alg] = built[alg].init_state(), []
        print(f"{alg:>5}: optimizer state {state_bytes_per_device(built[alg]) / 2**20:.2f} MiB per device "
              f"({len(built[alg].mesh.devices.flat)} devices, {built[alg].cfg.mesh})", flush=True)
    b = built["adamw"]
    batch = packed_batch(b, b.cfg.global_batch_size, b.cfg.seq_len, b.cfg.model.vocab_size, seed=0)
    for r in range(rounds + 3):  # 3 warm-up rounds (compile, caches)
        for alg in lrs:
            t0 = time.perf_counter()
            state[alg], m = built[alg].train_step(state[alg], batch)
            jax.block_until_ready(m["loss"])
            if r >= 3:
                times[alg].append(time.perf_counter() - t0)
    med = {alg: statistics.median(t) for alg, t in times.items()}
    print(f"step time, median of {rounds} alternating steps: AdamW {med['adamw'] * 1e3:.0f} ms, Muon "
          f"{med['muon'] * 1e3:.0f} ms, Muon / AdamW = {med['muon'] / med['adamw']:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--muon-lrs", default="1e-3,3e-3,1e-2")
    ap.add_argument("--data", default=str(REPO / "artifacts/sample"))
    ap.add_argument("--output", default=str(REPO / "workdirs/bench-muon"))
    ap.add_argument("--timing-rounds", type=int, default=20)
    args = ap.parse_args()
    out, data = pathlib.Path(args.output), pathlib.Path(args.data)
    tokens = args.steps * 16 * 128
    print(f"quickstart model, {args.steps} steps x 16 x 128 = {tokens} tokens per run", flush=True)
    best = {}
    for alg, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)):
        losses = sweep(alg, [float(x) for x in lrs.split(",")], args.steps, out, data)
        best[alg] = min(losses, key=losses.get)
        print(f"{alg:>5}: best lr {best[alg]:g}, held-out loss {losses[best[alg]]:.4f} at {tokens} tokens",
              flush=True)
    side_by_side(best, args.steps, out, data, args.timing_rounds)


if __name__ == "__main__":
    main()
