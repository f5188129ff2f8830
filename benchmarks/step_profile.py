"""Where the train step's time goes: jaxpt's step beside the plain-JAX step, by op kind and by source.

For the reference model of ``benchmarks/train_throughput.py`` (8 simulated CPU devices) this compiles jaxpt's
train step (as :func:`jaxpt.run.build.build` makes it) and the plain-JAX step, then prints

* **HLO instructions** of each compiled program (``compiled.as_text()``), by opcode, and jaxpt's attributed to
  their source: the line of :func:`jaxpt.training.step.train_step` they were traced from (its stack-frame metadata), the
  model and loss split by the innermost jaxpt function (attention, SwiGLU, RMSNorm, ...), and ``XLA-inserted``
  for instructions with no source (copies XLA adds, e.g. for buffer donation);
* **a profile** of ``--steps`` steps of each (``jax.profiler`` trace, Perfetto JSON; one event per executed HLO
  op per device, the format :mod:`jaxpt.run.profile_comm` reads): op time per step, summed over the devices, by op
  kind (dot, elementwise fusion, reduce, copy/transpose, gather/scatter, collective) and, for jaxpt, by source.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/step_profile.py [--mesh data=8]

Op times on simulated CPU devices are wall times of each device's thunks on a shared host (8 "devices" on the
host's cores), so they include waiting for a core; shares are what to compare, and only within one run.
Figures only; never part of a test.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import linecache
import os
import re
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import train_throughput as tt  # noqa: E402

_INST = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^=]*\)|\S+)\s+([\w\-]+)\((.*)$")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_TABLE = re.compile(r"^(\d+)\s+(.*)$")
_KV = re.compile(r"(\w+)=(\d+)")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
COPY_OPS = {"copy", "transpose", "bitcast", "reshape", "parameter", "broadcast", "constant", "slice",
            "concatenate", "tuple", "get-tuple-element", "bitcast-convert"}


def parse_hlo(text: str) -> dict:
    """The instructions of a compiled HLO module's text, with the stack-frame tables it carries.

    Returns ``{"instructions": [...], "computations": {name: [instructions]}, "entry": name, "frames": {id: (file,
    function, line, parent id)}}``; each instruction is a dict ``name, op, computation, calls (list of called
    computations), op_name, frame (stack frame id or 0)``.
    """
    files, funcs, locs, frames = {}, {}, {}, {}
    table = None
    comps: dict[str, list] = collections.defaultdict(list)
    instructions, comp, entry = [], None, None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = line
            continue
        if table and (m := _TABLE.match(line)):
            i, rest = int(m.group(1)), m.group(2)
            if table == "FileNames":
                files[i] = rest.strip('"')
            elif table == "FunctionNames":
                funcs[i] = rest.strip('"')
            elif table == "FileLocations":
                kv = dict((k, int(v)) for k, v in _KV.findall(rest))
                locs[i] = (files.get(kv["file_name_id"], "?"), funcs.get(kv["function_name_id"], "?"), kv["line"])
            else:
                kv = dict((k, int(v)) for k, v in _KV.findall(rest))
                frames[i] = (*locs[kv["file_location_id"]], kv["parent_frame_id"] - 1)
            continue
        if not line.strip():
            table = None
            continue
        if (m := _COMP.match(line)) and " = " not in line.split("{")[0]:
            comp = m.group(1)
            if line.startswith("ENTRY"):
                entry = comp
            continue
        m = _INST.match(line)
        if not m or comp is None:
            continue
        name, op, rest = m.group(1), m.group(3), m.group(4)
        calls = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", rest)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        inst = {"name": name, "op": op, "computation": comp, "calls": calls,
                "op_name": op_name.group(1) if op_name else "", "frame": int(frame.group(1)) if frame else 0}
        instructions.append(inst)
        comps[comp].append(inst)
    return {"instructions": instructions, "computations": comps, "entry": entry, "frames": frames}


def stack(hlo: dict, frame: int) -> list[tuple[str, str, int]]:
    """``[(file, function, line), ...]`` of a stack frame id, innermost first (empty for 0)."""
    out = []
    while frame > 0 and frame in hlo["frames"] and len(out) < 200:
        f, fn, line, parent = hlo["frames"][frame]
        out.append((f, fn, line))
        frame = parent
    return out


def source_label(hlo: dict, frame: int) -> str:
    """Where an instruction comes from in jaxpt's train step.

    ``XLA-inserted`` without a stack; ``model: <function>`` for the model and loss (the innermost function in
    ``jaxpt/model`` or the loss functions of ``jaxpt/training/step.py``); else ``train_step:<line> <source text>``, the
    line of :func:`jaxpt.training.step.train_step` it was traced from (optimizer, norms, metrics, skip policy);
    ``other: <function>`` otherwise.
    """
    st = stack(hlo, frame)
    if not st:
        return "XLA-inserted"
    names = [fn for _, fn, _ in st]
    if "loss_and_grads" in names:
        for f, fn, _ in st:
            if "/jaxpt/" in f and fn not in ("constrain",):
                return f"model: {fn}"
    for f, fn, line in st:
        if fn == "train_step" and f.endswith("jaxpt/training/step.py"):
            return f"train_step:{line} {linecache.getline(f, line).strip()[:70]}"
    return f"other: {st[0][1]}"


def fusion_kind(hlo: dict, inst: dict) -> str:
    """Op kind of an entry-level instruction: ``dot``, ``reduce``, ``copy/transpose``, ``gather/scatter``,
    ``collective``, ``elementwise`` (a fusion is classed by the ops of the computations it calls)."""
    ops, todo, seen = {inst["op"]}, list(inst["calls"]), set()
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        for i in hlo["computations"].get(c, ()):
            ops.add(i["op"])
            todo.extend(i["calls"])
    if ops & {"dot", "convolution", "custom-call"}:
        return "dot"
    if any(o.startswith(c) for o in ops for c in COLLECTIVES):
        return "collective"
    if ops & {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"}:
        return "gather/scatter"
    if ops & {"reduce", "reduce-window"}:
        return "reduce"
    if ops - {"fusion"} <= COPY_OPS:
        return "copy/transpose"
    return "elementwise"


def trace_op_times(trace_dir: str) -> tuple[dict[str, float], int]:
    """``({hlo op name: summed duration in seconds over devices and runs}, number of runs)`` of the newest
    Perfetto trace under ``trace_dir``."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                  key=os.path.getmtime)[-1]
    with gzip.open(path, "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    times: dict[str, float] = collections.defaultdict(float)
    runs = set()
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") == "X" and a.get("hlo_op") and e.get("name") == a["hlo_op"]:
            times[a["hlo_op"]] += float(e.get("dur", 0.0)) / 1e6
            runs.add(a.get("run_id"))
    return times, len(runs)


def profile(step, args, steps: int, trace_dir: str) -> tuple[dict[str, float], int]:
    """Trace ``steps`` calls of ``step`` (state threaded through) after one warm-up; :func:`trace_op_times`."""
    out = step(*args)
    jax.block_until_ready(out)
    args = (out[0],) + tuple(args[1:])
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(steps):
        out = step(*args)
        jax.block_until_ready(out)
        args = (out[0],) + tuple(args[1:])
    jax.profiler.stop_trace()
    return trace_op_times(trace_dir)


def breakdown(hlo: dict, times: dict[str, float], runs: int, devices: int, by_source: bool):
    """Seconds per step per device by op kind (and by source): ``(kinds, sources)``."""
    entry = {i["name"]: i for i in hlo["computations"][hlo["entry"]]}
    kinds: dict[str, float] = collections.defaultdict(float)
    sources: dict[str, float] = collections.defaultdict(float)
    norm = max(runs, 1)  # one run id per step, shared by the devices
    for op, t in times.items():
        inst = entry.get(op)
        if inst:
            kind = fusion_kind(hlo, inst)
        else:  # an op nested in a called computation (an async collective's wrapper, say)
            kind = "collective" if op.startswith(COLLECTIVES) else "other"
        kinds[kind] += t / norm / devices
        if by_source:
            sources[source_label(hlo, inst["frame"]) if inst else "other"] += t / norm / devices
    return kinds, sources


def print_table(title: str, rows: dict[str, float], total: float | None = None, unit: str = "s") -> None:
    total = sum(rows.values()) if total is None else total
    print(f"\n{title}")
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1]):
        share = f"{v / total:6.1%}" if total else ""
        print(f"  {k:84s} {v:10.4f} {unit} {share}" if unit == "s" else f"  {k:84s} {int(v):8d} {share}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="data=8", help="jaxpt's mesh (TrainConfig.mesh)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps of each")
    ap.add_argument("--hlo-dir", default="", help="also write the two compiled HLO texts here")
    args = ap.parse_args()
    devices = jax.device_count()

    js = tt.JaxptStep(args.mesh)
    plain_step, carry, batch = tt.plain_jax_step()
    programs = {"plain JAX": (plain_step, (carry, batch)),
                f"jaxpt {args.mesh}": (js.built.train_step, (js.state, js.batch))}
    hlos = {}
    for name, (fn, fargs) in programs.items():
        compiled = fn.lower(*fargs).compile()
        text = compiled.as_text()
        if args.hlo_dir:
            os.makedirs(args.hlo_dir, exist_ok=True)
            with open(os.path.join(args.hlo_dir, re.sub(r"\W+", "_", name) + ".hlo"), "w") as f:
                f.write(text)
        hlos[name] = parse_hlo(text)
        mem = compiled.memory_analysis()
        ins = hlos[name]["instructions"]
        print(f"{name}: {len(ins)} HLO instructions ({len(hlos[name]['computations'][hlos[name]['entry']])} at "
              f"entry level); arguments {mem.argument_size_in_bytes / 1e6:.1f} MB, aliased to outputs "
              f"{mem.alias_size_in_bytes / 1e6:.1f} MB, temporaries {mem.temp_size_in_bytes / 1e6:.1f} MB")
        top = collections.Counter(i["op"] for i in ins).most_common(14)
        print("  by opcode: " + ", ".join(f"{o} {n}" for o, n in top))
    jname = f"jaxpt {args.mesh}"
    by_src = collections.Counter(source_label(hlos[jname], i["frame"]) for i in hlos[jname]["instructions"])
    print_table(f"{jname}: HLO instructions by source", dict(by_src), unit="n")

    with tempfile.TemporaryDirectory(prefix="step_profile_") as tmp:
        results = {}
        for name, (fn, fargs) in programs.items():
            times, runs = profile(fn, fargs, args.steps, os.path.join(tmp, re.sub(r"\W+", "_", name)))
            results[name] = breakdown(hlos[name], times, runs, devices, by_source=name == jname)
    for name, (kinds, _) in results.items():
        print_table(f"{name}: op time per step per device, by op kind (sum {sum(kinds.values()):.3f} s)", kinds)
    print_table(f"{jname}: op time per step per device, by source", results[jname][1])


if __name__ == "__main__":
    main()
