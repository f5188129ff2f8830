"""``python -m jaxpt.tools.compile``: compile the real train step for a target slice without running it.

Ahead-of-time compilation catches out-of-memory before hardware is booked (as MaxText's
``train_compile`` does). The step is the one training runs: :func:`jaxpt.run.build.build` on the target's
devices, then :meth:`jaxpt.run.build.Built.lower_train_step` and ``.compile()``. No array is allocated.

Targets (``--topology``):

* ``cpu:N``: N local (simulated) CPU devices per slice; no HBM figure unless ``--hbm-gib`` is given.
* an accelerator type as Cloud TPU names it: ``v5p-128``, ``v4-128`` (TensorCores, two per chip: 64
  chips), ``v5e-256``, ``v6e-256`` (chips). The chips form the slice's usual torus (v4/v5p 3-D, e.g.
  ``4x4x4``; v5e/v6e 2-D, e.g. ``16x16``).
* a topology: ``v5p:4x4x4``, ``v5e:2x4``, ``v6e:16x16``.

TPU targets need libtpu (``pip install -e '.[tpu]'``): its compiler runs on this host against compile-only
devices (:func:`jax.experimental.topologies.get_topology_desc`). Only one process may load libtpu at a
time unless ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``. ``--num-slices N`` compiles for N such slices over the
data-center network: the config's ``TrainConfig.dcn_mesh`` says which axis spans them (default
``stage=N`` for a pipelined config, ``ModelConfig.pipeline_microbatches > 0`` or a ``stage`` in the mesh:
stages across slices, as the pipeline sends the least traffic; else ``data=N``).

The report gives per-chip bytes from ``compiled.memory_analysis()`` (arguments, outputs, aliased,
temp; total = arguments + outputs - aliased + temp), the chip's HBM and the headroom, the compile time
(seconds), and the planner's estimate (:func:`jaxpt.training.memory.estimate_memory`) beside it. Exit status:
0 fits (or no HBM figure), 1 does not fit (the numbers are still printed), 2 config or target error.

Example::

    python -m jaxpt.tools.compile --config configs/models/llama3_8b.gin --config configs/slices/v5p-128.gin \\
        --gin 'TrainConfig.seq_len = 8192' --gin 'TrainConfig.global_batch_size = 128' --topology v5p-128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from typing import Any, Sequence

from jaxpt import config as config_lib, mesh as mesh_lib
from jaxpt.model import attention_auto
from jaxpt.model.decoder import count_params
from jaxpt.run import build as builder
from jaxpt.training import memory
from jaxpt.util import platform, progress as progress_lib
from jaxpt.util.errors import ConfigError, report_cli_error

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class TpuKind:
    """A TPU generation: its libtpu topology prefix, torus rank, TensorCores counted per chip in
    accelerator-type names, the chip config libtpu compiles for, and HBM per chip (bytes, vendor figure)."""

    prefix: str
    rank: int
    cores_per_chip: int
    chip_config: str
    hbm_bytes: int


#: Cloud TPU generations. HBM per chip: v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e (Trillium) 32 GiB
#: (cloud.google.com/tpu/docs/system-architecture-tpu-vm). v4 compiles as one megacore device per chip.
TPU_KINDS = {
    "v4": TpuKind("v4", 3, 2, "megacore", 32 * GIB),
    "v5p": TpuKind("v5p", 3, 2, "default", 95 * GIB),
    "v5e": TpuKind("v5e", 2, 1, "default", 16 * GIB),
    "v5litepod": TpuKind("v5e", 2, 1, "default", 16 * GIB),
    "v6e": TpuKind("v6e", 2, 1, "default", 32 * GIB),
}


@dataclasses.dataclass
class Target:
    """What to compile for: ``name`` as given, ``platform`` (``cpu``/``tpu``), ``devices`` (all slices),
    ``num_slices``, ``hbm_bytes`` per chip (None: unknown) and the libtpu ``topology`` (``v5p:4x4x4``)."""

    name: str
    platform: str
    devices: list
    num_slices: int
    hbm_bytes: int | None
    topology: str = ""

    @property
    def chips(self) -> int:
        return len(self.devices)


def torus_shape(chips: int, rank: int) -> tuple[int, ...]:
    """The usual torus of ``chips`` chips: grow from ``2x2x1`` (3-D) or ``1x1`` (2-D) by doubling the
    smallest dimension (the last of equals), giving v5p ``4x4x4`` for 64 and ``8x8x8`` for 512, v5e
    ``2x4`` for 8 and ``16x16`` for 256.

    Raises:
      ValueError: ``chips`` is not a power of two (or below 4 for a 3-D torus).
    """
    if chips < 1 or chips & (chips - 1) or (rank == 3 and chips < 4):
        raise ValueError(f"{chips} chips: expected a power of two{' >= 4' if rank == 3 else ''}")
    dims = [2, 2, 1] if rank == 3 else [1, 1]
    while math.prod(dims) < chips:
        smallest = min(dims)
        i = max(j for j, d in enumerate(dims) if d == smallest)
        dims[i] *= 2
    return tuple(sorted(dims)) if rank == 2 else tuple(dims)


def parse_topology(name: str) -> tuple[TpuKind, tuple[int, ...]]:
    """``'v5p-128'`` or ``'v5p:4x4x4'`` -> (kind, torus dims).

    Raises:
      ConfigError: unknown generation or malformed name (naming ``--topology``), a core count that is
        not a whole number of chips, or dims of the wrong rank.
    """
    s = name.strip().lower()
    m = re.fullmatch(r"([a-z0-9]+)(?:-(\d+)|:(\d+(?:x\d+)*))", s)
    if not m or m.group(1) not in TPU_KINDS:
        raise ConfigError(f"--topology {name!r}: expected cpu:N, TYPE-COUNT (v5p-128, v5e-256, v6e-256, v4-128) "
                          f"or TYPE:AxBxC (v5p:4x4x4, v5e:2x4) with TYPE one of {', '.join(TPU_KINDS)}")
    kind = TPU_KINDS[m.group(1)]
    if m.group(3):
        dims = tuple(int(x) for x in m.group(3).split("x"))
        if len(dims) != kind.rank:
            raise ConfigError(f"--topology {name!r}: {kind.prefix} topologies have {kind.rank} dimensions")
        return kind, dims
    count = int(m.group(2))
    if count % kind.cores_per_chip:
        raise ConfigError(f"--topology {name!r}: {count} TensorCores is not a whole number of chips "
                          f"({kind.cores_per_chip} per chip)")
    try:
        return kind, torus_shape(count // kind.cores_per_chip, kind.rank)
    except ValueError as e:
        raise ConfigError(f"--topology {name!r}: {e}") from None


def tpu_devices(kind: TpuKind, dims: tuple[int, ...], num_slices: int) -> list:
    """Compile-only devices of ``num_slices`` slices of ``kind`` with torus ``dims`` (needs libtpu).

    Raises:
      ConfigError: libtpu is not installed, or another process holds it (naming the fix).
    """
    from jax.experimental import topologies
    topology = f"{kind.prefix}:{'x'.join(map(str, dims))}"
    _quiet_libtpu_off_tpu(f"{kind.prefix}-{math.prod(dims) * kind.cores_per_chip}")
    host = tuple(min(2, d) for d in dims[:2]) + (1,)  # 4 chips per host; only memory per chip matters here
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, chip_config_name=kind.chip_config,
                                            chips_per_host_bounds=host, num_slices=num_slices)
    except RuntimeError as e:  # JaxRuntimeError subclasses RuntimeError
        hint = ("install the tpu extra: pip install -e '.[tpu]'" if "not installed" in str(e) else
                "another process has libtpu loaded; set ALLOW_MULTIPLE_LIBTPU_LOAD=1" if "lockfile" in str(e) else "")
        raise ConfigError(f"--topology {topology}: cannot make TPU devices: {e}" + (f" ({hint})" if hint else "")) from None
    return list(desc.devices)


def _quiet_libtpu_off_tpu(accelerator_type: str) -> None:
    """On a host without TPU chips, libtpu (loaded to make compile-only devices) looks for the TPU VM it runs on and
    prints ``Failed to find host bounds`` and ``E0000 ... INVALID_ARGUMENT`` lines; telling it the target's type and a
    local worker name (defaults only, never on a TPU VM) keeps it quiet. The compile does not depend on them."""
    vendors = platform.pci_vendors()
    if vendors is not None and "0x1ae0" in vendors:  # a Google TPU on this host: libtpu knows its own
        return
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def make_target(name: str, num_slices: int = 1, hbm_gib: float | None = None) -> Target:
    """Resolve ``--topology``/``--num-slices``/``--hbm-gib`` into a :class:`Target`.

    Raises:
      ConfigError: see :func:`parse_topology` and :func:`tpu_devices`; ``cpu:N`` with fewer local CPU devices.
    """
    if num_slices < 1:
        raise ConfigError(f"--num-slices {num_slices}: must be >= 1")
    override = None if hbm_gib is None else int(hbm_gib * GIB)
    m = re.fullmatch(r"cpu:(\d+)", name.strip().lower())
    if m:
        import jax
        n, have = int(m.group(1)) * num_slices, jax.devices("cpu")
        if not 0 < n <= len(have):
            raise ConfigError(f"--topology {name!r} x {num_slices} slices: {n} devices wanted, {len(have)} local CPU "
                              "devices (XLA_FLAGS=--xla_force_host_platform_device_count=N)")
        return Target(name, "cpu", list(have[:n]), num_slices, override)
    kind, dims = parse_topology(name)
    topology = f"{kind.prefix}:{'x'.join(map(str, dims))}"
    devices = tpu_devices(kind, dims, num_slices)
    return Target(name, "tpu", devices, num_slices, override or kind.hbm_bytes, topology)


def with_slices(cfg, num_slices: int):
    """``cfg`` with ``TrainConfig.dcn_mesh`` defaulted for ``N > 1`` slices: ``stage=N`` when the config pipelines
    (``ModelConfig.pipeline_microbatches > 0``, or a ``stage`` axis > 1 in ``TrainConfig.mesh``), so the stages
    span the slices and only one micro-batch's activations cross the data-center network per step; else
    ``data=N``.

    Raises:
      ConfigError: the config's ``dcn_mesh`` spans a different number of slices.
    """
    if num_slices == 1 and not cfg.dcn_mesh:
        return cfg
    if not cfg.dcn_mesh:
        pipelined = (cfg.model.pipeline_microbatches > 0
                     or mesh_lib.parse_mesh_spec(cfg.mesh)[mesh_lib.PIPELINE_AXIS] not in (1,))
        return dataclasses.replace(cfg, dcn_mesh=f"{'stage' if pipelined else 'data'}={num_slices}")
    n = math.prod(mesh_lib.parse_mesh_spec(cfg.dcn_mesh).values())
    if n != num_slices:
        raise ConfigError(f"TrainConfig.dcn_mesh = {cfg.dcn_mesh!r} spans {n} slices, --num-slices is {num_slices}")
    return cfg


def memory_bytes(compiled) -> dict[str, int]:
    """Per-chip bytes of a compiled step from ``memory_analysis()``: ``arguments``, ``outputs``,
    ``aliased`` (outputs sharing a donated argument's buffer), ``temp``, ``total`` (= arguments + outputs
    - aliased + temp), and the same for buffers placed in host memory (``pinned_host``, e.g. an offloaded
    optimizer state): ``host_argument``, ``host_output``, ``host_alias``, ``host_temp``, ``host_total``. The CPU
    backend reports every buffer under the first set (its host_* figures are 0)."""
    ma = compiled.memory_analysis()
    get = lambda f: int(getattr(ma, f, 0) or 0)  # noqa: E731
    out = {"arguments": get("argument_size_in_bytes"), "outputs": get("output_size_in_bytes"),
           "aliased": get("alias_size_in_bytes"), "temp": get("temp_size_in_bytes")}
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temp"]
    for f in ("argument", "output", "alias", "temp"):
        out[f"host_{f}"] = get(f"host_{f}_size_in_bytes")
    out["host_total"] = out["host_argument"] + out["host_output"] - out["host_alias"] + out["host_temp"]
    return out


def compiled_flops(compiled) -> float | None:
    """FLOPs one device executes per train step by XLA's cost analysis of the compiled program (recomputation,
    attention, optimizer update included); None when the backend reports none."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) and ca else ca
    flops = (ca or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def compile_report(cfg, target: Target) -> dict[str, Any]:
    """Build ``cfg`` on ``target``'s devices, compile its train step and report memory and times.

    Returns: one JSON-able dict: ``topology``, ``platform``, ``chips``, ``num_slices``, ``mesh``,
    ``bytes_per_chip`` (:func:`memory_bytes`), ``hbm_bytes_per_chip`` (None: unknown), ``headroom_bytes``,
    ``headroom_fraction``, ``fits`` (None when the HBM is unknown), ``lower_seconds``, ``compile_seconds``,
    ``planner_bytes_per_chip``, ``planner_ratio`` (planner / compiled), ``params``, ``pipeline`` (None
    unpipelined; else stages, micro-batches, repeats, bubble fraction and the planner's per-stage activation
    stash and buffer bytes), ``offload_optimizer_state``, ``attention_impl`` (requested) and
    ``attention_impl_used`` (what runs on this target, :func:`jaxpt.model.attention_auto.resolve_for`) with
    ``attention_fallback_reason`` (empty unless it fell back), ``flops_per_step`` (per chip, :func:`compiled_flops`)
    and ``tokens_per_step``.
    ``fits`` and the headroom compare the device ``total`` with the HBM; host bytes (``host_total``) do not count.
    Raises:
      ConfigError: from :func:`jaxpt.run.build.build` (naming the key); ``attention_impl = 'cudnn'`` for a target
        that is not a CUDA GPU.
    """

    # Donated, as on the accelerator the report stands for, also on a cpu:N topology (where a run would not donate).
    built = builder.build_for(with_slices(cfg, target.num_slices), devices=target.devices, donate_state=True)
    attention = attention_auto.resolve_for(built.cfg.model, built.cfg.seq_len, target.devices)
    where = f"{target.topology or target.name} ({target.chips} chips)"
    with progress_lib.Phase(f"lowering the train step for {where}") as lowering:
        lowered = built.lower_train_step()
    with progress_lib.Phase(f"compiling the train step for {where}") as compiling:
        compiled = lowered.compile()
    b = memory_bytes(compiled)
    estimate = memory.estimate_memory(built.cfg, built.sizes)
    planned = estimate.total
    hbm = target.hbm_bytes
    return {
        "topology": target.topology or target.name, "platform": target.platform, "chips": target.chips,
        "num_slices": target.num_slices, "mesh": mesh_lib.format_mesh(built.sizes),
        "dcn_mesh": built.cfg.dcn_mesh, "bytes_per_chip": b, "hbm_bytes_per_chip": hbm,
        "headroom_bytes": None if hbm is None else hbm - b["total"],
        "headroom_fraction": None if hbm is None else (hbm - b["total"]) / hbm,
        "fits": None if hbm is None else b["total"] <= hbm,
        "lower_seconds": round(lowering.seconds, 2), "compile_seconds": round(compiling.seconds, 2),
        "planner_bytes_per_chip": planned, "planner_ratio": planned / max(b["total"], 1),
        "params": count_params(built.cfg.model)["total"],
        "global_batch_size": built.cfg.global_batch_size, "seq_len": built.cfg.seq_len,
        # Pipelined: stages, micro-batches, repeats, bubble; the planner's activation stash of the in-flight
        # micro-batches and buffers, per stage (the compiled bytes above are per chip, i.e. per stage share).
        "pipeline": None if estimate.pipeline is None else {
            **estimate.pipeline, "planner_activation_bytes": estimate.activations,
            "planner_buffer_bytes": estimate.stash},
        "offload_optimizer_state": built.cfg.offload_optimizer_state,
        "attention_impl": built.cfg.model.attention_impl, "attention_impl_used": attention.name,
        "attention_fallback_reason": attention.reason,
        "flops_per_step": compiled_flops(compiled), "tokens_per_step": built.cfg.global_batch_size * built.cfg.seq_len,
    }


def format_report(r: dict[str, Any]) -> str:
    """Human-readable lines of :func:`compile_report`'s dict (GiB = 2^30 bytes)."""
    g = lambda x: f"{x / GIB:8.2f} GiB" if abs(x) >= GIB / 10 else f"{x / 2 ** 20:8.2f} MiB"  # noqa: E731
    b = r["bytes_per_chip"]
    lines = [f"target     {r['topology']} ({r['platform']}): {r['chips']} chips, {r['num_slices']} slice(s), "
             f"mesh {r['mesh']}" + (f", dcn {r['dcn_mesh']}" if r["dcn_mesh"] else ""),
             f"model      {r['params'] / 1e9:.2f}B params, batch {r['global_batch_size']} x {r['seq_len']} tokens",
             "per chip   (compiled, memory_analysis)"]
    lines.append(f"  {'':<10}{'device':>12}{'host':>14}")
    lines += [f"  {k:<10}{g(b[k])}  {g(b['host_' + h])}"
              for k, h in (("arguments", "argument"), ("outputs", "output"), ("aliased", "alias"), ("temp", "temp"),
                           ("total", "total"))]
    if r.get("offload_optimizer_state"):
        lines.append("  optimizer state offloaded to pinned host memory (TrainConfig.offload_optimizer_state)")
    used = r["attention_impl_used"]
    lines.append(f"attention  {r['attention_impl']}" + (f" -> {used}" if used != r["attention_impl"] else "")
                 + (f" (fallback: {r['attention_fallback_reason']})" if r["attention_fallback_reason"] else ""))
    lines.append(f"planner    {g(r['planner_bytes_per_chip'])}  ({r['planner_ratio']:.2f} x compiled)")
    if r.get("pipeline"):
        p = r["pipeline"]
        lines.append(f"pipeline   {p['stages']} stages x {p['repeats']} repeats, {p['microbatches']} micro-batches, "
                     f"bubble {100 * p['bubble_fraction']:.1f}%; per-stage stash {g(p['planner_activation_bytes'])}"
                     f" + buffers {g(p['planner_buffer_bytes'])} (planner)")
    if r["hbm_bytes_per_chip"] is None:
        lines.append("HBM        unknown for this target (--hbm-gib to compare)")
    else:
        lines.append(f"HBM        {g(r['hbm_bytes_per_chip'])}  headroom {g(r['headroom_bytes'])} "
                     f"({100 * r['headroom_fraction']:.1f}%): {'fits' if r['fits'] else 'DOES NOT FIT'}")
    lines.append(f"compile    {r['compile_seconds']:.1f} s (lowering {r['lower_seconds']:.1f} s)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxpt.tools.compile", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    config_lib.add_arguments(p)  # --config/--gin/--mesh/...
    p.add_argument("--topology", required=True, help="cpu:N, v5p-128, v5e-256, v6e-256, v4-128 or v5p:4x4x4")
    p.add_argument("--num-slices", type=int, default=1, help="slices over DCN (TrainConfig.dcn_mesh; default stage=N for a pipelined "
                   "config, else data=N)")
    p.add_argument("--hbm-gib", type=float, help="memory per chip to compare with (default: the chip's HBM)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_lib.from_args(args)
        target = make_target(args.topology, args.num_slices, args.hbm_gib)
        report = compile_report(cfg, target)
    except ConfigError as e:
        return report_cli_error(str(e), args.json)
    print(json.dumps(report) if args.json else format_report(report))
    return 1 if report["fits"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
