"""The run registry, read: a run's ``run.json`` (:mod:`jaxpt.run.record`) by workdir or run id, every run under a
folder, and the plain-text table the programs print them in (``python -m jaxpt.tools.runs``,
``python -m jaxpt.tools.conclusions``, ``python -m jaxpt.tools.gate``).
"""

from __future__ import annotations

import sys
from typing import Any

from jaxpt.run.record import RUN_FILE
from jaxpt.util import fs


def load_run(path_or_id: str, root: str = "workdirs") -> dict[str, Any]:
    """A run's record from its workdir, its run.json, or its run id under ``root``.

    Raises:
      FileNotFoundError: naming what was looked for.
    """
    candidates = [path_or_id, fs.join(path_or_id, RUN_FILE)]
    for c in candidates:
        if fs.isfile(c):
            rec = fs.read_json(c, "a run record")
            rec.setdefault("workdir", fs.dirname(fs.absolute(c)))
            return rec
    for rec in find_runs(root):
        if rec.get("run_id") == path_or_id:
            return rec
    raise FileNotFoundError(f"no run {path_or_id!r}: not a workdir with {RUN_FILE}, nor a run id under {root!r}")


def find_runs(root: str) -> list[dict[str, Any]]:
    """Every run.json under ``root`` (recursively), sorted by start time; one that cannot be read is skipped with a
    warning on stderr naming it."""
    out = []
    if not fs.isdir(root):  # os.walk of a missing root yields nothing; so does this
        return []
    for dirpath, _, files in fs.walk(root):
        if RUN_FILE in files:
            try:
                rec = fs.read_json(fs.join(dirpath, RUN_FILE), "a run record")
            except (OSError, ValueError) as e:
                print(f"warning: skipped {fs.join(dirpath, RUN_FILE)}: {e}", file=sys.stderr)  # said, never silent
                continue
            rec.setdefault("workdir", dirpath)
            out.append(rec)
    return sorted(out, key=lambda r: r.get("started_at", ""))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def table(rows: list[list[Any]], header: list[str]) -> str:
    """A plain-text table."""
    cells = [header] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
