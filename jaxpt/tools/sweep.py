"""``python -m jaxpt.tools.sweep``: compile and time one config on several mesh shapes, and name the best.

    python -m jaxpt.tools.sweep --config configs/quickstart.gin --mesh data=8 --mesh fsdp=8 \\
        --mesh data=2,fsdp=2,tensor=2 --mesh fsdp=4,tensor=2 --steps 5 --output workdirs/sweep

For each ``--mesh``:

1. **Validate** the config on that mesh (:func:`jaxpt.config.validate`); a shape that does not divide the
   devices, the batch or the heads is reported as ``invalid`` with the config error, not raised.
2. **Compile ahead of time** (``jit(...).lower(abstract state, abstract batch).compile()``), timing it, and
   read the compiled per-device memory from ``memory_analysis()``: ``argument + output - alias + temp``
   bytes (donated state is aliased, so it counts once). Beside it, :func:`jaxpt.training.memory.estimate_memory`.
   If the device's memory is known (``memory_stats()['bytes_limit']`` on accelerators, or
   ``--device-memory-gib``) and the step needs more, the shape is reported as ``does not fit`` and not run.
3. **Run** one untimed warm-up step, then ``--steps`` timed steps on *synthetic* batches: uniform random
   tokens, each row packed with 1 to 4 documents (segment ids and restarting positions), two batches
   placed on the devices beforehand and alternated, so the figures measure the train step and not the
   input pipeline. Step time is wall time over the timed steps, ended by one ``block_until_ready``;
   tokens/s, TFLOP/s per device and MFU follow :class:`jaxpt.run.monitor.Throughput` and
   :mod:`jaxpt.training.flops` (on CPU the peak is the measured matmul peak, as in training).
4. **Collective share**: ``--trace-steps`` more steps run under ``jax.profiler.trace`` with a Perfetto
   trace; the share is the summed duration of the trace's collective-op events (all-gather, all-reduce,
   reduce-scatter, all-to-all, collective-permute and their async ``-start``/``-done`` halves, NCCL
   kernels), divided by the number of devices, over the wall time of those steps. On CPU collectives
   are synchronous thunks, and their time includes waiting at the rendezvous for the slowest device; on
   accelerators with asynchronous collectives, time that overlaps compute is still counted, so the share
   is an upper bound on the time collectives cost.

Output: a table on the terminal, ``<output>/sweep.csv``, ``<output>/sweep.png`` (tokens/s, and step time split
into collectives and the rest), and the best shape (highest tokens/s among those that ran).

``--topology v5p:4x4x4`` (a libtpu topology name) additionally compiles each shape for that TPU
slice without the hardware (``jax.experimental.topologies.get_topology_desc``) and reports its compiled
memory. Where JAX cannot build that topology (no libtpu installed, or a CPU-only JAX), it says so and
carries on with the local devices.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import glob
import gzip
import io
import json
import logging
import os
import re
import sys
import tempfile
import time
from typing import Any, Sequence

import jax
import numpy as np

from jaxpt import config as config_lib, mesh as mesh_lib
from jaxpt.config import ConfigError, TrainConfig
from jaxpt.lab import plan
from jaxpt.run import build as builder_lib, monitor
from jaxpt.run.validate import validate
from jaxpt.training import flops as flops_lib, memory
from jaxpt.util import cli, fs

log = logging.getLogger("jaxpt.tools.sweep")

#: HLO collective op names (XLA); a trace event is a collective if its name starts with one of them.
COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                  "collective-permute", "collective-broadcast")
_COLLECTIVE_RE = re.compile(r"^(%s)(-start|-done)?([.\-_]\d+)*$" % "|".join(map(re.escape, COLLECTIVE_OPS)))

CSV_FIELDS = ("mesh", "status", "compile_s", "compiled_memory_bytes", "estimated_memory_bytes",
              "device_memory_bytes", "step_time_s", "tokens_per_sec", "tflops_per_device", "mfu",
              "collective_share", "first_loss", "last_loss", "topology_memory_bytes", "note")


@dataclasses.dataclass
class Result:
    """One mesh shape's row. ``status``: ``ok``, ``invalid``, ``does not fit``, ``compile failed``,
    ``run failed``. Times in seconds, memory in bytes per device, ``mfu`` and ``collective_share`` in 0..1."""

    mesh: str
    status: str = "ok"
    compile_s: float | None = None
    compiled_memory_bytes: int | None = None
    estimated_memory_bytes: int | None = None
    device_memory_bytes: int | None = None
    step_time_s: float | None = None
    tokens_per_sec: float | None = None
    tflops_per_device: float | None = None
    mfu: float | None = None
    collective_share: float | None = None
    first_loss: float | None = None
    last_loss: float | None = None
    topology_memory_bytes: int | None = None
    note: str = ""


# --------------------------------------------------------------------------------------------------
# Pieces.


def compiled_bytes(compiled) -> int | None:
    """Per-device bytes of a compiled executable: ``argument + output - alias + temp`` from
    ``memory_analysis()`` (None where the backend gives no analysis)."""
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
               + ma.temp_size_in_bytes)


def device_memory_limit(override_gib: float | None) -> int | None:
    """Bytes one device may use: ``--device-memory-gib`` if given, else ``memory_stats()['bytes_limit']``
    of the first device, else None (CPU reports none)."""
    if override_gib:
        return int(override_gib * memory.GIB)
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        stats = {}
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def synthetic_batch(batch: int, seq_len: int, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """A packed batch of random tokens: int32 ``tokens``, ``segment_ids`` (1..4 documents per row, ids from
    1, no padding) and ``positions`` (restarting at 0 per document), each [batch, seq_len]."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=(batch, seq_len), dtype=np.int32)
    segment_ids = np.empty((batch, seq_len), np.int32)
    positions = np.empty((batch, seq_len), np.int32)
    for r in range(batch):
        n_docs = int(rng.integers(1, 5))
        cuts = np.sort(rng.choice(np.arange(1, seq_len), size=min(n_docs - 1, seq_len - 1), replace=False))
        starts = np.concatenate([[0], cuts])
        seg = np.searchsorted(cuts, np.arange(seq_len), side="right")
        segment_ids[r] = seg + 1
        positions[r] = np.arange(seq_len) - starts[seg]
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}


def collective_time_us(trace_dir: str) -> tuple[float, int]:
    """``(summed microseconds of collective-op events, number of such events)`` in the newest Perfetto
    trace (``perfetto_trace.json.gz``) under ``trace_dir``.

    Raises:
      FileNotFoundError: no Perfetto trace was written.
    """
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, count = 0.0, 0
    for e in events:
        if e.get("ph") == "X" and is_collective(e.get("name", "")):
            total += float(e.get("dur", 0.0))
            count += 1
    return total, count


def is_collective(name: str) -> bool:
    """Whether a trace event name is an XLA collective op (``all-reduce.3``, ``all-gather-start``) or a
    NCCL kernel."""
    return bool(_COLLECTIVE_RE.match(name)) or name.lower().startswith("nccl")


def topology_devices(topology: str):
    """Compile-only devices of a TPU topology (e.g. ``v5p:4x4x4``).

    Returns ``(devices, None)`` or ``(None, reason)`` when JAX cannot describe it here.
    """
    try:
        from jax.experimental import topologies
        return list(topologies.get_topology_desc(topology, platform="tpu").devices), None
    except Exception as e:  # noqa: BLE001 - JAX raises RuntimeError/NotImplementedError/JaxRuntimeError
        return None, (f"cannot compile for TPU topology {topology!r} here: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''} (needs JAX with TPU support, "
                      f"i.e. libtpu; jax.experimental.topologies.get_topology_desc)")


# --------------------------------------------------------------------------------------------------
# One mesh.


@dataclasses.dataclass
class _Compiled:
    built: "builder_lib.Built"
    executable: Any


def lower(cfg: TrainConfig, devices) -> "builder_lib.Built":
    """The run's program for ``cfg`` on ``devices``, built by :func:`jaxpt.run.build.build` exactly as
    ``jaxpt.train`` builds it (gradient accumulation, stability policy, clipping, z-loss, schedule)."""
    return builder_lib.build_for(cfg, devices=devices)


def _build(cfg: TrainConfig, devices) -> tuple[_Compiled, float]:
    """The train step AOT-compiled on ``devices``. Returns it and compile seconds."""
    built = lower(cfg, devices)
    t0 = time.perf_counter()
    executable = built.lower_train_step().compile()
    return _Compiled(built, executable), time.perf_counter() - t0


def _device_batches(c: _Compiled, n: int = 2) -> list[dict[str, jax.Array]]:
    cfg = c.built.cfg
    lo = jax.process_index() * (cfg.global_batch_size // jax.process_count())
    hi = lo + cfg.global_batch_size // jax.process_count()
    out = []
    for i in range(n):
        host = synthetic_batch(cfg.global_batch_size, cfg.seq_len, cfg.model.vocab_size, cfg.seed + i)
        out.append({k: jax.make_array_from_process_local_data(c.built.batch_shardings()[k], v[lo:hi])
                    for k, v in host.items()})
    return out


def _run(c: _Compiled, steps: int, trace_steps: int, peak: float, trace_dir: str) -> dict[str, float]:
    """Warm-up step, ``steps`` timed steps, ``trace_steps`` traced steps. Returns the figures."""
    cfg = c.built.cfg
    state = c.built.init_state()
    batches = _device_batches(c)
    state, metrics = c.executable(state, batches[0])
    first_loss = float(metrics["loss"])
    t0 = time.perf_counter()
    for i in range(steps):
        state, metrics = c.executable(state, batches[(i + 1) % len(batches)])
    jax.block_until_ready(state)
    elapsed = time.perf_counter() - t0
    throughput = monitor.Throughput(cfg.global_batch_size * cfg.seq_len,
                                    flops_lib.flops_per_token(cfg.model, cfg.seq_len), c.built.mesh.size, peak)
    figures = throughput.figures(elapsed / steps)
    figures.update(first_loss=first_loss, last_loss=float(metrics["loss"]))
    if trace_steps > 0:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for i in range(trace_steps):
                state, metrics = c.executable(state, batches[i % len(batches)])
            jax.block_until_ready(state)
            traced_wall = time.perf_counter() - t0
        coll_us, _ = collective_time_us(trace_dir)
        figures["collective_share"] = min(coll_us / 1e6 / c.built.mesh.size / traced_wall, 1.0)
    return figures


def sweep_one(cfg: TrainConfig, mesh_spec: str, *, steps: int, trace_steps: int, peak: float,
              memory_limit: int | None, out_dir: str, topo_devices=None) -> Result:
    """Validate, compile, (maybe) run one mesh shape. Never raises for a bad shape: the row says why."""
    r = Result(mesh=mesh_spec)
    try:
        cfg = dataclasses.replace(cfg, mesh=mesh_spec)  # a malformed spec is refused here, by TrainConfig
        sizes = validate(cfg, jax.device_count())
    except ConfigError as e:
        r.status, r.note = "invalid", str(e)
        return r
    r.mesh = mesh_lib.format_mesh(sizes)
    r.estimated_memory_bytes = memory.estimate_memory(cfg, sizes).total
    r.device_memory_bytes = memory_limit
    if topo_devices is not None:
        r.topology_memory_bytes, topo_note = _topology_memory(cfg, mesh_spec, topo_devices)
        r.note = topo_note
    try:
        compiled, r.compile_s = _build(cfg, jax.devices())
    except Exception as e:  # noqa: BLE001 - XLA raises many types (e.g. RESOURCE_EXHAUSTED); report them
        r.status, r.note = "compile failed", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return r
    r.compiled_memory_bytes = compiled_bytes(compiled.executable)
    if memory_limit is not None and r.compiled_memory_bytes is not None and r.compiled_memory_bytes > memory_limit:
        r.status = "does not fit"
        r.note = (f"compiled step needs {r.compiled_memory_bytes / memory.GIB:.2f} GiB per device > "
                  f"{memory_limit / memory.GIB:.2f} GiB")
        return r
    trace_dir = os.path.join(_trace_root(out_dir), "traces", r.mesh.replace(",", "_").replace("=", ""))
    try:
        figures = _run(compiled, steps, trace_steps, peak, trace_dir)
    except Exception as e:  # noqa: BLE001 - an OOM at run time is reported like any other failure
        r.status, r.note = "run failed", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return r
    for k in ("step_time_s", "tokens_per_sec", "tflops_per_device", "mfu", "collective_share",
              "first_loss", "last_loss"):
        setattr(r, k, figures.get(k))
    return r


def _topology_memory(cfg: TrainConfig, mesh_spec: str, devices) -> tuple[int | None, str]:
    """Compiled per-device bytes of the step for a TPU topology's compile-only devices."""
    try:
        compiled, _ = _build(dataclasses.replace(cfg, mesh=mesh_spec), devices)
        return compiled_bytes(compiled.executable), ""
    except Exception as e:  # noqa: BLE001
        return None, f"topology compile: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


# --------------------------------------------------------------------------------------------------
# Reporting.


def best(results: Sequence[Result]) -> Result | None:
    """The row with the highest tokens/s among those that ran (None if none did)."""
    ran = [r for r in results if r.status == "ok" and r.tokens_per_sec]
    return max(ran, key=lambda r: r.tokens_per_sec) if ran else None


def _fmt(v, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "mib":
        return f"{v / 2 ** 20:.1f}"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    if kind == "f3":
        return f"{v:.3f}"
    if kind == "f0":
        return f"{v:,.0f}"
    return str(v)


def format_table(results: Sequence[Result]) -> str:
    """A fixed-width table of the rows (memory in MiB per device)."""
    cols = [("mesh", "mesh", "s"), ("status", "status", "s"), ("compile s", "compile_s", "f3"),
            ("compiled MiB", "compiled_memory_bytes", "mib"), ("est. MiB", "estimated_memory_bytes", "mib"),
            ("step s", "step_time_s", "f3"), ("tokens/s", "tokens_per_sec", "f0"), ("MFU", "mfu", "pct"),
            ("collectives", "collective_share", "pct"), ("loss@1", "first_loss", "f3")]
    if any(r.topology_memory_bytes is not None for r in results):
        cols.insert(4, ("TPU MiB", "topology_memory_bytes", "mib"))
    rows = [[h for h, _, _ in cols]] + [[_fmt(getattr(r, k), kind) for _, k, kind in cols] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"  {r.mesh}: {r.note}" for r in results if r.note]
    return "\n".join(lines + (["notes:"] + notes if notes else []))


def _trace_root(out_dir: str) -> str:
    """Where profiler traces go: ``out_dir`` when local; for a ``gs://`` output a local scratch folder
    (``<tmp>/jaxpt-sweep``), because the traces are read straight back (glob, gzip) for the collective share and
    are not part of the sweep's results."""
    return os.path.join(tempfile.gettempdir(), "jaxpt-sweep") if fs.is_remote(out_dir) else out_dir


def write_csv(results: Sequence[Result], path: str) -> None:
    """One row per mesh shape, columns :data:`CSV_FIELDS` (empty cell = not measured); ``path`` may be
    ``gs://``."""
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
    w.writeheader()
    for r in results:
        w.writerow({k: ("" if v is None else v) for k, v in dataclasses.asdict(r).items()})
    fs.write_text_atomic(path, buf.getvalue())


def plot(results: Sequence[Result], path: str, title: str = "") -> None:
    """Bar charts: tokens/s per shape (failed shapes labelled with their status), and step time split into
    collectives and the rest."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.mesh for r in results]
    x = np.arange(len(results))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(results)), 4.5))
    tps = [r.tokens_per_sec or 0.0 for r in results]
    top = best(results)
    colors = ["tab:green" if top is not None and r is top else "tab:blue" for r in results]
    ax1.bar(x, tps, color=colors)
    for i, r in enumerate(results):
        if r.status != "ok":
            ax1.text(i, 0, r.status, ha="center", va="bottom", rotation=90, fontsize=8)
    ax1.set_ylabel("tokens/s")
    ax1.set_title("throughput (best in green)")
    step = np.array([r.step_time_s or 0.0 for r in results])
    coll = step * np.array([r.collective_share or 0.0 for r in results])
    ax2.bar(x, coll, label="collectives", color="tab:red")
    ax2.bar(x, step - coll, bottom=coll, label="other", color="tab:gray")
    ax2.set_ylabel("step time (s)")
    ax2.set_title("step time")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fs.write_figure(fig, path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# CLI.


def run_sweep(cfg: TrainConfig, meshes: Sequence[str], *, steps: int, trace_steps: int, out_dir: str,
              device_memory_gib: float | None = None, peak_flops: float | None = None,
              topology: str | None = None) -> list[Result]:
    """Sweep ``meshes`` for ``cfg`` (vocab resolved) and write ``sweep.csv`` and ``sweep.png`` in ``out_dir``."""
    fs.makedirs(out_dir)
    if peak_flops is None:
        peak_flops, note = flops_lib.peak_flops_per_device(dtype=cfg.model.jnp_compute_dtype)
        log.info("MFU peak: %s", note)
    topo_devices = None
    if topology:
        topo_devices, reason = topology_devices(topology)
        if reason:
            log.warning("%s", reason)
            print(f"note: {reason}; sweeping the {jax.device_count()} local devices only")
        else:
            print(f"TPU topology {topology}: {len(topo_devices)} compile-only devices (libtpu); each shape's "
                  "compiled bytes per TPU device are in the 'TPU MiB' column")
    limit = device_memory_limit(device_memory_gib)
    results = []
    for m in meshes:
        log.info("mesh %s", m)
        results.append(sweep_one(cfg, m, steps=steps, trace_steps=trace_steps, peak=peak_flops,
                                 memory_limit=limit, out_dir=out_dir, topo_devices=topo_devices))
    write_csv(results, fs.join(out_dir, "sweep.csv"))
    plot(results, fs.join(out_dir, "sweep.png"),
         title=f"{jax.device_count()} x {jax.devices()[0].device_kind}, batch {cfg.global_batch_size} x {cfg.seq_len}")
    return results


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m jaxpt.tools.sweep`` (``--profile-steps`` and ``--out``: deprecated
    spellings of ``--trace-steps``, a count unlike the trainer's ``--profile-steps START:STOP``, and ``--output``)."""
    p = argparse.ArgumentParser(prog="python -m jaxpt.tools.sweep", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=[], metavar="FILE", help="gin file; may repeat")
    p.add_argument("--gin", action="append", default=[], metavar="BINDING", help="gin binding; may repeat")
    p.add_argument("--mesh", action="append", required=True, help="mesh shape to try; repeat for each")
    p.add_argument("--steps", type=int, default=5, help="timed steps per shape (after one warm-up step)")
    cli.add_flag(p, "--trace-steps", "--profile-steps", type=int, default=2, metavar="N",
                 help="steps traced for the collective share, after the timed ones (0: skip)")
    cli.add_flag(p, "--output", "--out", default="workdirs/sweep",
                 help="directory for sweep.csv, sweep.png and traces (default workdirs/sweep)")
    p.add_argument("--device-memory-gib", type=float, help="per-device memory limit (default: from the device)")
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s per device for MFU (default: as in training)")
    p.add_argument("--topology", help="also compile for this TPU topology without hardware, e.g. v5p:4x4x4")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns 0, 1 when no shape ran, 2 on bad input."""
    args = build_parser().parse_args(argv)
    # force: an imported library (grain/absl) already put a handler on the root logger, which would
    # make basicConfig a no-op and leave INFO unprinted.
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", force=True)
    if args.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    try:
        cfg = plan.resolve_vocab(config_lib.parse(args.config, args.gin))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    results = run_sweep(cfg, args.mesh, steps=args.steps, trace_steps=args.trace_steps, out_dir=args.output,
                        device_memory_gib=args.device_memory_gib, peak_flops=args.peak_flops,
                        topology=args.topology)
    print(format_table(results))
    top = best(results)
    print(f"best: {top.mesh} ({top.tokens_per_sec:,.0f} tokens/s, synthetic batches)" if top
          else "best: none of the shapes ran")
    print(f"wrote {fs.join(args.output, 'sweep.csv')} and {fs.join(args.output, 'sweep.png')}")
    return 0 if top else 1


if __name__ == "__main__":
    sys.exit(main())
