"""The run registry: ``<workdir>/run.json``, one record per run, written by process 0 of the trainer.

``run.json`` holds: ``run_id``, ``status`` (running, completed, preempted, failed), ``config_hash``
(sha256 of the operative gin config), ``data_version``, ``tokenizer`` (path, sha256), ``git`` (commit,
dirty), ``mesh``, ``devices`` (count, kind, processes), ``num_params``, ``started_at`` / ``ended_at``
(UTC ISO 8601) and ``sessions`` (one per start or resume, each with ``start_step``, ``last_step`` and
``goodput``, the session's time accounting, :class:`jaxpt.run.monitor.Goodput`), ``stages`` (the stages that led to
this run, the parent's first, each with its name, workdir, start step, parent checkpoint ``{path, step}`` or null,
and ``end_step`` where a later stage left it; see :mod:`jaxpt.run.lineage`), ``final`` metrics, and ``events`` (spike skips,
rollbacks, preemptions; an event of a step that a resumed session re-runs, its checkpoint lost, is kept and marked
``superseded_at: <restored step>``). ``python -m jaxpt.tools.runs`` reads it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import uuid
from typing import Any

import jax

from jaxpt import config as config_lib, mesh as mesh_lib
from jaxpt.run.lineage import RUN_FILE
from jaxpt.training import state as state_lib
from jaxpt.util import fs, jsonl

__all__ = ["RUN_FILE", "RunRegistry", "git_state"]


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second (``2025-01-31T12:00:00+00:00``): the registry's timestamps."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def git_state(path: str = ".") -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the repository holding ``path``."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path,
                                capture_output=True, text=True, timeout=10).stdout
        return {"commit": commit, "dirty": bool(status.strip()) if commit else None}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


class RunRegistry:
    """Writes and updates ``<workdir>/run.json`` (a no-op unless ``enabled``)."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.path = fs.join(workdir, RUN_FILE)
        self.enabled = enabled
        self.record: dict[str, Any] = {}

    def _write(self) -> None:
        if not self.enabled:
            return
        # atomic: a reader never sees half a file
        fs.write_text_atomic(self.path, jsonl.dumps(self.record, indent=2, default=str))

    def start(self, cfg, run, ident) -> None:
        """Create run.json, or add a session to an existing one (a resumed run keeps its id), from the run's
        identity (:class:`jaxpt.run.lineage.Identity`: config hash, data version; its stages, recorded when run.json
        is new or has none: a resume keeps its own) and the built ``run`` (mesh, devices, parameter count)."""
        if not self.enabled:
            return
        if fs.exists(self.path):
            self.record = json.loads(fs.read_text(self.path))
        else:
            self.record = {"run_id": f"{fs.basename(fs.absolute(cfg.workdir))}-{uuid.uuid4().hex[:8]}",
                           "workdir": fs.absolute(cfg.workdir), "started_at": utc_now(), "events": [],
                           "sessions": []}
        self.record.update({
            "status": "running",
            "config_hash": config_lib.config_hash(ident.config_text),
            "data_version": ident.data_version,
            "tokenizer": {"path": fs.absolute(cfg.data.tokenizer_path), "sha256": run.tokenizer.sha256},
            "git": git_state(os.path.dirname(os.path.abspath(__file__))),
            "mesh": mesh_lib.format_mesh(mesh_lib.mesh_shape(run.mesh)),
            "devices": {"count": jax.device_count(), "kind": jax.devices()[0].device_kind,
                        "processes": jax.process_count()},
            "num_params": state_lib.num_params(run.spec),
            "target_steps": cfg.steps,
        })
        start = int(jax.device_get(run.state.step))
        for ev in self.record.get("events", []):  # from steps this session re-runs (lost checkpoints): superseded
            if isinstance(ev.get("step"), int) and ev["step"] > start:
                ev.setdefault("superseded_at", start)
        if ident.stages and not self.record.get("stages"):
            self.record["stages"] = ident.stages
        self.record["sessions"].append({"started_at": utc_now(), "start_step": start})
        self._write()

    def steps_reached_before(self) -> int:
        """The highest ``last_step`` an earlier session recorded (0 when none did): a resumed session that
        starts below it trains those steps again."""
        return max((s.get("last_step", 0) for s in self.record.get("sessions", [])[:-1]), default=0)

    def update_session(self, fields: dict[str, Any]) -> None:
        """Merge ``fields`` (``last_step``, ``goodput``: :meth:`jaxpt.run.monitor.Goodput.summary`) into the current
        session's record and rewrite run.json."""
        if self.enabled and self.record.get("sessions"):
            self.record["sessions"][-1].update(fields)
            self._write()

    def add_event(self, event: dict[str, Any]) -> None:
        if self.enabled:
            self.record.setdefault("events", []).append({**event, "time": utc_now()})
            self._write()

    def finish(self, status: str, final: dict[str, Any]) -> None:
        if not self.enabled or not self.record:
            return
        self.record["status"] = status
        self.record["ended_at"] = utc_now()
        if final:
            self.record["final"] = final
        if self.record.get("sessions"):
            self.record["sessions"][-1]["ended_at"] = self.record["ended_at"]
            self.record["sessions"][-1]["status"] = status
        self._write()
