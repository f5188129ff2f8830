"""Reproducer: XLA:CPU aborts a pipelined train step on simulated devices when its intra-op pool has 8 threads.

The abort of tests/test_pipeline.py::test_restores_across_pipeline_layouts (SIGABRT on the 2-core CI host). With
``--xla_force_host_platform_device_count=8`` XLA:CPU sizes its thread pools max(cores, devices) = 8 threads on a
host with 8 or fewer cores (``PJRT_NPROC`` overrides it). A collective thunk holds its intra-op thread while it waits
for the other devices in the rendezvous. When jaxpt's ``stage=4,data=2`` step is *loaded from the persistent
compilation cache* (as the tests' session-wide cache does), one device's program can have two collectives waiting at
once: the scalar loss all-reduce of the entry computation (channel 11) beside the all-reduce (channel 2) inside a
while loop nested in the pipeline's while loop, over the same pair of devices. When the first device of every data
pair enters both, those four devices hold all 8 threads, their partners never get one, and after
``--xla_cpu_collective_call_terminate_timeout_seconds`` XLA LOG(FATAL)s: "Termination timeout for `all reduce
RendezvousKey{... global_devices=[0, 1] ... op_id=2}` ... Expected 2 threads to join the rendezvous, but only 1 of
them arrived on time" -> SIGABRT. One program, every step blocked on before the next: nothing else runs.

Run from the repository root (7 to 12 minutes on a 2-core host, most of it two compiles):

    python benchmarks/repro/cpu_collective_starvation.py [--seconds 45] [--load 2] [--nproc 32]

It compiles the test's 8-layer model's step into a fresh persistent cache, then trains it on ``stage=4,data=2`` for
``--seconds`` in a child process three times beside ``--load`` busy loops: loaded from the cache with XLA's default
pools, loaded from the cache with ``PJRT_NPROC=--nproc``, and compiled in the process with the default pools. Each
line says how the child ended and, for a stuck one, each waiting thread's rendezvous (kind, devices, op id, rank).
Measured on the 2-core host under load (jax/jaxlib 0.10.2, 2026-12-07), the stage=4 step looped in a child: loaded
from the cache with the default pools, SIGABRT within 25 steps in 4 of 4 runs (all 8 waiting threads rank 0 of a
data pair, each pair's rank 0 in both op 2 and op 11); loaded from the cache with ``PJRT_NPROC=32``, 434 and 254
steps, none stuck; compiled in the process with the default pools, 177 and 255 steps, none stuck. This script's
own output there (--seconds 45):

    default pools, step loaded from the persistent cache: exit -6 (SIGABRT); 8 threads stuck: all reduce [6, 7] op 11
      rank 0; all reduce [6, 7] op 2 rank 0; collective permute [0, 1, 2, 3, 4, 5, 6, 7] op 1 rank 0 (... rank 5)
    PJRT_NPROC=32, step loaded from the persistent cache: exit 0, steps 125 loss 0.7561
    default pools, step compiled in the process (no cache): exit 0, steps 113 loss 0.8184
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ("--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_warn_stuck_timeout_seconds=5 "
         "--xla_cpu_collective_call_terminate_timeout_seconds=30 --xla_cpu_collective_timeout_seconds=30")


def child(seconds: float) -> None:
    import jax
    import numpy as np

    from jaxpt import config as C
    from jaxpt.model import ModelConfig
    from jaxpt.run import build as builder

    m = ModelConfig(vocab_size=256, d_model=32, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                    max_seq_len=32, scan_layers=True, pipeline_microbatches=4)
    cfg = C.TrainConfig(model=m, mesh="stage=4,data=2", global_batch_size=16, seq_len=32, steps=100)
    built = builder.build_for(cfg)
    rng = np.random.default_rng(1)
    batch = {"tokens": rng.integers(0, 256, (16, 32)).astype(np.int32),
             "segment_ids": np.ones((16, 32), np.int32), "positions": np.tile(np.arange(32, dtype=np.int32), (16, 1))}
    state = jax.block_until_ready(built.init_state())
    state, metrics = jax.block_until_ready(built.train_step(state, batch))  # the compile, outside the timed loop
    t0, n = time.time(), 1
    while time.time() - t0 < seconds:
        state, metrics = jax.block_until_ready(built.train_step(state, batch))
        n += 1
    print(f"steps {n} loss {float(metrics['loss']):.4f}", flush=True)


def run(seconds: float, nproc: int | None, cache: str) -> str:
    env = dict(os.environ, XLA_FLAGS=FLAGS, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", PYTHONPATH=ROOT)
    env.pop("PJRT_NPROC", None)
    env.pop("NPROC", None)
    if nproc:
        env["PJRT_NPROC"] = str(nproc)
    proc = subprocess.run([sys.executable, __file__, "--child", "--seconds", str(seconds)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=seconds + 600)
    waits = sorted(set(re.findall(r"\[id=(\d+)\] This thread has been waiting for `([a-z ]+) RendezvousKey\{.*?"
                                  r"global_devices=(\[[0-9, ]*\]).*?op_id=(\d+)\}", proc.stderr)))
    done = re.search(r"steps \d+ loss \S+", proc.stdout)
    said = f"exit {proc.returncode}" + (" (SIGABRT)" if proc.returncode == -6 else "")
    said += f", {done.group(0)}" if done else ""
    if waits:
        said += f"; {len(waits)} threads stuck: " + "; ".join(f"{k} {d} op {o} rank {r}" for r, k, d, o in waits)
    return said


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=45, help="training time per child (default 45)")
    ap.add_argument("--load", type=int, default=2, help="busy loops beside the child (default 2)")
    ap.add_argument("--nproc", type=int, default=32, help="PJRT_NPROC of the second child (default 32)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.seconds)
        return
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as empty:
            run(0, None, cache)  # compiles the step into the persistent cache
            for label, nproc, where in (("default pools, step loaded from the persistent cache", None, cache),
                                        (f"PJRT_NPROC={args.nproc}, step loaded from the persistent cache",
                                         args.nproc, cache),
                                        ("default pools, step compiled in the process (no cache)", None, empty)):
                print(f"{label}: {run(args.seconds, nproc, where)}", flush=True)
                if where == empty:
                    shutil.rmtree(empty, ignore_errors=True)
                    os.makedirs(empty)
    finally:
        for b in busy:
            b.kill()


if __name__ == "__main__":
    main()
