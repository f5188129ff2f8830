"""The communication share of profiled train steps, by mesh axis, from a ``jax.profiler`` Perfetto trace.

The loop's profile window (``TrainConfig.profile_steps``, :class:`jaxpt.run.hooks.ProfileHook`) writes a trace with
``create_perfetto_trace=True``; :func:`comm_share_by_axis` reads its ``perfetto_trace.json.gz``:

* **device time**: per device and program run (the ``device_ordinal`` and ``run_id`` of the op events), the
  span from its first op's start to its last op's end, summed;
* **collective time**: the summed duration of the XLA collective ops run on the devices (events whose
  ``hlo_op`` argument names an ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or
  ``collective-permute``);
* **which mesh axes**: each collective's participants, from the ``Rendezvous`` event nested in it on the same
  thread (``global_devices=[0, 1, 2, 3]``); the mesh axes along which those devices' coordinates differ are
  the axes it communicates over (``data``, ``fsdp``, or ``data+fsdp`` for one spanning both).

``comm_share`` = collective time / device time (0..1, the seed's "share of each step spent on communication");
``comm_share/<axes>`` the same for the collectives over those axes (they sum to ``comm_share``;
``comm_share/unknown`` when a collective's participants are not in the trace). On simulated CPU devices a
collective's time includes waiting at the rendezvous for its slowest participant, as on real hardware, where
a collective also waits for its peers.

Trace format as written by jax 0.10.2's CPU client (``thunk_executor.cc`` events with ``hlo_op``,
``rendezvous.h`` events naming ``global_devices``); TPU and GPU traces name their ops the same way but record
participants differently, so there the axes read ``unknown`` unless the trace has such rendezvous events.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
from typing import Any, Mapping, Sequence

import numpy as np

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                  "ragged-all-to-all", "collective-broadcast")
_COLLECTIVE_RE = re.compile(r"^(%s)(-start|-done)?([.\-_]\d+)*$" % "|".join(map(re.escape, COLLECTIVE_OPS)))
_GROUP_RE = re.compile(r"global_devices=\[([\d,\s]*)\]")


def newest_trace(trace_dir: str) -> str:
    """Path of the newest ``perfetto_trace.json.gz`` under ``trace_dir``.

    Raises:
      FileNotFoundError: none there (a trace started without ``create_perfetto_trace=True``, or no trace).
    """
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    return files[-1]


def device_coords(mesh_devices: np.ndarray) -> dict[int, tuple[int, ...]]:
    """``{device id: its index in the mesh's device array}`` (``mesh.devices``, of any rank)."""
    return {int(d.id): idx for idx, d in np.ndenumerate(mesh_devices)}


def axes_of_group(device_ids: Sequence[int], coords: Mapping[int, tuple[int, ...]],
                  axis_names: Sequence[str]) -> str:
    """The mesh axes a group of devices spans: the axes along which their coordinates differ, joined by ``+``
    in mesh order (``'data'``, ``'data+fsdp'``); ``'unknown'`` for a device outside the mesh or one device."""
    try:
        pts = np.array([coords[int(d)] for d in device_ids])
    except KeyError:
        return "unknown"
    if len(pts) < 2:
        return "unknown"
    varying = [name for i, name in enumerate(axis_names) if len(set(pts[:, i])) > 1]
    return "+".join(varying) or "unknown"


def _events(path: str) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X"]


def comm_share_by_axis(trace_dir: str, mesh_devices: np.ndarray, axis_names: Sequence[str]) -> dict[str, float]:
    """``{"comm_share": ..., "comm_share/<axes>": ..., "comm_device_s": ...}`` of the newest trace under
    ``trace_dir`` (module docstring). ``mesh_devices``/``axis_names``: the run's ``mesh.devices`` and
    ``mesh.axis_names``. Units: shares 0..1; ``comm_device_s`` is the device time the shares divide (seconds,
    summed over devices). ``{}`` when the trace has no device executions.

    Raises:
      FileNotFoundError: no Perfetto trace under ``trace_dir``.
    """
    events = _events(newest_trace(trace_dir))
    spans: dict[tuple, list[float]] = {}
    for e in events:
        a = e.get("args") or {}
        if a.get("hlo_op") and e.get("name") == a["hlo_op"]:
            t0, t1 = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
            span = spans.setdefault((a.get("run_id"), a.get("device_ordinal")), [t0, t1])
            span[0], span[1] = min(span[0], t0), max(span[1], t1)
    device_us = sum(b - a for a, b in spans.values())
    if device_us <= 0:
        return {}
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("name") == "Rendezvous":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    coords = device_coords(mesh_devices)
    per_axes: dict[str, float] = collections.defaultdict(float)
    for e in events:
        op = (e.get("args") or {}).get("hlo_op", "")
        if not op or not _COLLECTIVE_RE.match(op) or e.get("name") != op:
            continue
        t0, t1 = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        group = None
        for r in by_thread.get((e.get("pid"), e.get("tid")), ()):
            if t0 <= float(r["ts"]) <= t1:
                m = _GROUP_RE.search(str((r.get("args") or {}).get("name", "")))
                if m:
                    group = [int(x) for x in m.group(1).split(",") if x.strip()]
                    break
        axes = "unknown" if group is None else axes_of_group(group, coords, axis_names)
        per_axes[axes] += float(e.get("dur", 0.0))
    out = {"comm_share": sum(per_axes.values()) / device_us, "comm_device_s": device_us / 1e6}
    out.update({f"comm_share/{k}": v / device_us for k, v in sorted(per_axes.items())})
    return out
