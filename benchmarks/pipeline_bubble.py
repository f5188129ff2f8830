"""The pipeline bubble, measured: train-step time with S stages and M micro-batches against the same model
unpipelined on the same devices, beside the theory ``(S - 1) / (M R + S - 1)`` (Huang et al. 2019 sec. 2.3).

Model: 8 scanned layers, d_model 256, MLP 1024, vocab 256 (so the layer stack, the pipelined part, dominates
the step), sequence 128, global batch 32, fp32, on 4 simulated CPU devices: ``stage=4`` (GPipe, and the
circular schedule with ``R = 2``) against ``data=4``.

Measured bubble = ``1 - 1 / median_rounds(t_pipelined / t_unpipelined)``, each ratio from a pipelined step timed
right after an unpipelined one (alternating, so load changes on a shared host cancel within a pair; the median
over rounds, with its interquartile range printed, discards pairs the load split). Each stage runs its layer
group in all ``M R + S - 1`` iterations (in the bubble on a placeholder), so on simulated devices that share
the host's cores a pipelined step does ``(M R + S - 1) / (M R)`` times the unpipelined compute and the measured share matches the idle
share a real pipeline has, less the embedding, head and optimizer (not pipelined, equal in both), which pull
it under theory by their share of the step, while a micro-batch's smaller matmuls (``B / M`` rows) run less
efficiently than whole-batch ones and push it over theory as M grows.

    python benchmarks/pipeline_bubble.py [--microbatches 4 8 16] [--repeats 1 2] [--steps 7]

Figures only; never part of the test pass/fail. The host is shared: one run's ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpt.run import build as builder  # noqa: E402
from jaxpt.config import TrainConfig  # noqa: E402
from jaxpt.model import ModelConfig  # noqa: E402
from jaxpt.model.pipeline import bubble_fraction  # noqa: E402

STAGES, SEQ, BATCH, LAYERS = 4, 128, 32, 8


def config(mesh: str, microbatches: int = 0, repeats: int = 1) -> TrainConfig:
    m = ModelConfig(vocab_size=256, d_model=256, num_layers=LAYERS, num_heads=4, num_kv_heads=4, head_dim=64,
                    mlp_dim=1024, max_seq_len=SEQ, scan_layers=True, pipeline_microbatches=microbatches,
                    pipeline_repeats=repeats)
    return TrainConfig(model=m, mesh=mesh, global_batch_size=BATCH, seq_len=SEQ, steps=100)


def compiled_step(cfg: TrainConfig):
    """``(run one step and wait, state holder)`` for ``cfg`` on 4 devices, compiled by one warm-up step."""
    built = builder.build_for(cfg, devices=jax.devices()[:STAGES])
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 256, (BATCH, SEQ)).astype(np.int32),
             "segment_ids": np.ones((BATCH, SEQ), np.int32),
             "positions": np.tile(np.arange(SEQ, dtype=np.int32), (BATCH, 1))}
    holder = [built.init_state()]

    def one():
        holder[0], m = built.train_step(holder[0], batch)
        jax.block_until_ready(m)

    one()
    return one


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--repeats", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=7, help="rounds (each pipelined config paired per round)")
    args = p.parse_args()
    runs = {("base", 0, 0): compiled_step(config(f"data={STAGES}"))}
    for r in args.repeats:
        for mb in args.microbatches:
            runs[("pipe", mb, r)] = compiled_step(config(f"stage={STAGES}", mb, r))
    # Paired, alternating measurements: in each round every pipelined configuration is timed right after an
    # unpipelined step, and its bubble comes from the ratio of that pair, so a change in the shared host's load
    # between rounds cancels; the median over rounds drops rounds where the load changed within a pair.
    base = runs.pop(("base", 0, 0))
    ratios = {k: [] for k in runs}
    base_times = []
    for _ in range(args.steps):
        for k, one in runs.items():
            tb = _timed(base)
            tp = _timed(one)
            base_times.append(tb)
            ratios[k].append(tp / tb)
    print(f"unpipelined data={STAGES}: median {np.median(base_times) * 1e3:.1f} ms/step ({LAYERS} layers, batch "
          f"{BATCH} x {SEQ}); {args.steps} rounds, each pipelined step paired with an unpipelined one")
    print(f"{'S':>2} {'M':>3} {'R':>2} {'ratio med':>9} {'ratio IQR':>13} {'measured':>9} {'theory':>7} "
          f"{'diff (pts)':>10}")
    for (kind, mb, r), rs in ratios.items():
        med = float(np.median(rs))
        q1, q3 = np.percentile(rs, [25, 75])
        measured, theory = 1 - 1 / med, bubble_fraction(STAGES, mb, r)
        print(f"{STAGES:>2} {mb:>3} {r:>2} {med:>9.3f} {q1:>6.3f}-{q3:<6.3f} {measured:>9.1%} {theory:>7.1%} "
              f"{100 * (measured - theory):>+10.1f}")


def _timed(one) -> float:
    t = time.perf_counter()
    one()
    return time.perf_counter() - t

if __name__ == "__main__":
    main()
