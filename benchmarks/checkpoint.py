"""How long a checkpoint save blocks the train loop, asynchronous against synchronous, and restore time.

Builds the quickstart model (or a bigger one with ``--d-model/--layers/--mlp-dim``) with its AdamW state,
sharded over the mesh (default data=2,fsdp=2,tensor=2 on 8 simulated CPU devices), runs train steps on
synthetic packed batches, and in the same process measures, per save mode (median over ``--repeats``):

* ``save call blocks loop``: how long ``Checkpointer.save`` blocks, the state being ready (async: the
  device-to-host copy and bookkeeping; sync: the whole write and commit);
* ``loop overhead``: wall time of ``--window`` steps with a save made as the train loop makes it (right
  after dispatching a step), minus the same steps without one; on this CPU host an async save's writer
  threads also compete with the steps for the cores;
* ``committed after``: from the save call until the checkpoint is committed on disk;

then the restore time of the full train state onto the same mesh, onto a different mesh (resharding,
fsdp over all devices), and of the params alone onto one device (what ``jaxpt.restore`` does).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/checkpoint.py [--d-model 512 --layers 8]

Needs the quickstart tokenizer (``make prepare``) for the config. Figures only, never pass/fail; these
2-core machines are noisy, so compare the rows of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpt import config as config_lib  # noqa: E402
from jaxpt import mesh as mesh_lib  # noqa: E402
from jaxpt.training import state as state_lib  # noqa: E402
from jaxpt.data import stream  # noqa: E402
from jaxpt import train as train_lib  # noqa: E402
from jaxpt.checkpoint import CheckpointConfig, Checkpointer  # noqa: E402


def make_run(args):
    bindings = [f"ModelConfig.d_model = {args.d_model}", f"ModelConfig.num_layers = {args.layers}",
                f"ModelConfig.mlp_dim = {args.mlp_dim}", "TrainConfig.progress_bar = False",
                f"TrainConfig.global_batch_size = {args.batch}", f"TrainConfig.seq_len = {args.seq_len}"]
    if args.tokenizer:
        bindings.append(f"DataConfig.tokenizer_path = {args.tokenizer!r}")
    cfg = config_lib.parse(["configs/quickstart.gin"], bindings, mesh=args.mesh, workdir=args.workdir)
    return train_lib.setup(cfg)


def synthetic_batch(run, rng):
    cfg = run.cfg
    b, n = cfg.global_batch_size // jax.process_count(), cfg.seq_len
    half = n // 2
    local = {"tokens": rng.integers(4, cfg.model.vocab_size, (b, n)).astype(np.int32),
             "segment_ids": np.repeat(np.array([1, 2], np.int32), [half, n - half])[None].repeat(b, 0),
             "positions": np.concatenate([np.arange(half), np.arange(n - half)]).astype(np.int32)[None].repeat(b, 0)}
    return stream.to_device(run.mesh, cfg.logical_axis_rules, local)


def steps(run, batch, n: int, save=None) -> tuple[float, float | None]:
    """Run ``n`` train steps (``save()`` called after the first); returns (wall s, save-call s)."""
    t0 = time.perf_counter()
    save_s = None
    for i in range(n):
        run.state, metrics = run.train_step(run.state, batch)
        if i == 0 and save is not None:
            t = time.perf_counter()
            save()
            save_s = time.perf_counter() - t
    jax.block_until_ready(metrics)
    return time.perf_counter() - t0, save_s


def measure_saves(run, batch, ckpt: Checkpointer, args, labels) -> dict[str, list[float]]:
    """Per repeat: the loop overhead of a save made as the train loop makes it (right after dispatching a
    step), then, with the state ready, how long the save call blocks and when the save is committed."""
    import grain
    data_it = iter(grain.MapDataset.range(10).to_iter_dataset())
    out = {"call": [], "overhead": [], "committed": []}
    for _ in range(args.repeats):
        base, _ = steps(run, batch, args.window)
        wall, _ = steps(run, batch, args.window,
                        lambda: ckpt.save(next(labels), run.state, data_it, {"benchmark": True}, force=True))
        ckpt.wait()
        out["overhead"].append(wall - base)
        jax.block_until_ready(run.state)
        t = time.perf_counter()
        ckpt.save(next(labels), run.state, data_it, {"benchmark": True}, force=True)
        out["call"].append(time.perf_counter() - t)
        ckpt.wait()
        out["committed"].append(time.perf_counter() - t)
    return out


def measure_restores(run, ckpt: Checkpointer, step: int, repeats: int) -> dict[str, float]:
    times = {"full state, same mesh": [], "full state, fsdp over all devices": [], "params only, 1 device": []}
    other = mesh_lib.make_mesh({"fsdp": jax.device_count()})
    one = mesh_lib.make_mesh("data=1", devices=jax.devices()[:1])
    abs_params_1 = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), run.spec.abstract.params,
        state_lib.param_shardings(run.spec.abstract.params, one, run.cfg.logical_axis_rules))
    abs_other = _reshard_abstract(run, other)
    for _ in range(repeats):
        for name, fn in (("full state, same mesh", lambda: ckpt.restore(step, run.spec.abstract, None)),
                         ("full state, fsdp over all devices", lambda: ckpt.restore(step, abs_other, None)),
                         ("params only, 1 device", lambda: _params_only(ckpt.directory, step, abs_params_1))):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def _reshard_abstract(run, mesh):
    """The run's abstract state with every leaf's PartitionSpec kept but placed on ``mesh``."""
    def move(a):
        spec = a.sharding.spec
        spec = jax.sharding.PartitionSpec(*[s if _fits(s, mesh) else None for s in spec])
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
    return jax.tree.map(move, run.spec.abstract)


def _fits(entry, mesh) -> bool:
    names = entry if isinstance(entry, tuple) else (entry,)
    return all(n is None or mesh.shape[n] > 1 for n in names)


def _params_only(directory: str, step: int, abstract_params):
    ckpt = Checkpointer(os.path.dirname(directory), CheckpointConfig(enabled=False), read_only=True)
    try:
        return ckpt.restore_params(step, abstract_params)["params"]
    finally:
        ckpt.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="data=2,fsdp=2,tensor=2")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mlp-dim", type=int, default=768)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--window", type=int, default=4, help="steps per timed loop (a save after the first)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokenizer", help="tokenizer model (default: the quickstart's artifacts/sample)")
    p.add_argument("--workdir", help="where to write checkpoints (default: a temporary directory, removed)")
    args = p.parse_args()
    tmp = None
    if args.workdir is None:
        tmp = args.workdir = tempfile.mkdtemp(prefix="jaxpt_ckpt_bench_")
    try:
        run_benchmark(args)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def run_benchmark(args) -> None:
    run = make_run(args)
    batch = synthetic_batch(run, np.random.default_rng(0))
    n_params = state_lib.num_params(run.spec)
    state_mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run.spec.abstract)) / 2 ** 20
    print(f"model: {n_params / 1e6:.1f}M params; train state (params + AdamW + step/RNG) {state_mb:.0f} MiB; "
          f"mesh {mesh_lib.format_mesh(mesh_lib.mesh_shape(run.mesh))} over {jax.device_count()} "
          f"{jax.devices()[0].platform} devices; checkpoints in {args.workdir}")
    steps(run, batch, 2)  # compile
    step_s, _ = steps(run, batch, args.window)
    print(f"train step: {step_s / args.window:.3f} s (mean of {args.window})")

    results, labels = {}, itertools.count(1)
    for mode in ("async", "sync"):
        cfg = CheckpointConfig(save_every_steps=0, keep_last=100, async_save=(mode == "async"))
        ckpt = Checkpointer(os.path.join(args.workdir, mode), cfg)
        warm = measure_saves(run, batch, ckpt, argparse.Namespace(window=args.window, repeats=1), labels)
        results[mode] = measure_saves(run, batch, ckpt, args, labels)
        results[mode]["first"] = warm["call"]
        ckpt.close()
    print(f"\nsave of the same {state_mb:.0f} MiB state, median of {args.repeats} (after one warm-up save per mode):")
    print(f"{'':7}{'save call blocks loop':>23}{f'{args.window}-step loop overhead':>25}"
          f"{'committed after':>17}{'warm-up save call':>19}")
    for mode, r in results.items():
        print(f"{mode:7}{statistics.median(r['call']):>21.3f} s{statistics.median(r['overhead']):>23.3f} s"
              f"{statistics.median(r['committed']):>15.3f} s{r['first'][0]:>17.3f} s")
    a, s = (statistics.median(results[m]["call"]) for m in ("async", "sync"))
    print(f"async blocks the loop {s / max(a, 1e-9):.1f}x less than sync per save")

    ckpt = Checkpointer(os.path.join(args.workdir, "sync"), CheckpointConfig(enabled=False))
    step = ckpt.latest_step()
    restores = measure_restores(run, ckpt, step, args.repeats)
    ckpt.close()
    print(f"\nrestore of step {step}, median of {args.repeats}:")
    for name, t in restores.items():
        print(f"  {name:36} {t:.3f} s")


if __name__ == "__main__":
    main()
