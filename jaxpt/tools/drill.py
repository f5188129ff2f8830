"""``python -m jaxpt.tools.drill``: a recovery drill: kill the trainer, restart it, check the resumed run.

Train, SIGKILL the trainer at random moments (some inside an asynchronous checkpoint save), restart it, and check
that the resumed run *is* the uninterrupted run.

    python -m jaxpt.tools.drill --config configs/quickstart.gin --workdir workdirs/drill --steps 60 --kills 5

Steps:

1. ``<workdir>/reference``: an uninterrupted ``python -m jaxpt.train`` to ``--steps`` (or ``--reference DIR``,
   an earlier such run with the same flags, checked by comparing the operative configs).
2. ``<workdir>/interrupted``: the same command, killed with SIGKILL ``--kills`` times and restarted each
   time. Each kill has a planned target step (distinct, increasing, drawn with ``--seed``) and a kind:
   ``save`` (kill as soon as the asynchronous save of the target step has started, i.e. its Orbax
   temporary directory exists, after a random delay up to ``--max-kill-delay-s``) or ``step`` (kill a
   random delay after the target step's metrics were logged). ``--mode mixed`` draws the kind per kill.
3. Compare, with ``--rtol`` (0: bitwise, the CPU default): every logged loss, grad norm, learning rate
   and target-token count of every step, by every launch, against the reference; the document ids of
   every batch (``TrainConfig.log_batch_documents``); the final checkpoint's RNG key, step and params;
   the final held-out loss.

Per restart it reports the recovery time (kill -> first new step logged, which includes process start,
compilation and restore), the step resumed at and whether it was the newest *committed* step on disk
when the trainer died (an interrupted save must never be picked up), and the steps lost (last step the
killed trainer finished minus the step resumed at). The report is written to
``<workdir>/drill_report.json``; the exit status is 0 when everything matches, 1 on any mismatch, 2 when
the drill itself could not run (a trainer failed, a timeout).

The trainer keeps its persistent compilation cache on, as in production (``TrainConfig.compilation_cache_dir =
'auto'``: ``<run workdir>/jax_cache``, :mod:`jaxpt.run.compile_cache`), so a restart loads its programs instead of
recompiling them. ``--compilation-cache off`` turns it off for the interrupted run; ``both`` runs the same kill plan
twice, with the cache (``interrupted/``) and without (``interrupted_nocache/``), checks both against the reference
and reports the recovery times side by side (``summary.recovery_time_s_mean_without_cache``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from jaxpt import config as config_lib
from jaxpt.run import monitor
from jaxpt.util import fs, jsonl
from jaxpt.util.errors import FileFormatError

#: Per-step metrics that must be identical in a resumed run (timing figures are not).
DETERMINISTIC_KEYS = ("loss", "z_loss", "grad_norm", "learning_rate", "num_target_tokens")
TMP_MARKER = ".orbax-checkpoint-tmp"
POLL_S = 0.005


class DrillError(RuntimeError):
    """The drill could not run (a trainer failed or hung); not a recovery mismatch."""


@dataclasses.dataclass
class Kill:
    """One planned kill: ``kind`` is ``save`` or ``step``; ``target`` the step whose save/metrics trigger it."""

    kind: str
    target: int
    delay_s: float


def plan_kills(steps: int, kills: int, save_every: int, mode: str, seed: int, max_delay_s: float) -> list[Kill]:
    """Distinct increasing target steps in ``[1, steps - 1]`` (save kills on multiples of ``save_every``).

    Raises:
      DrillError: too few candidate steps for ``kills``.
    """
    rng = random.Random(seed)
    save_steps = [s for s in range(1, steps) if save_every and s % save_every == 0]
    if mode == "save":
        pool = save_steps
    else:
        pool = list(range(1, steps))
    if len(pool) < kills:
        raise DrillError(f"--kills {kills} needs more candidate steps than {len(pool)} "
                         f"(--steps {steps}, save every {save_every} steps, mode {mode}); raise --steps")
    targets = sorted(rng.sample(pool, kills))
    plan = []
    for i, t in enumerate(targets):
        kind = mode if mode != "mixed" else rng.choice(("save", "step"))
        if kind == "save" and t not in save_steps:  # snap up to a save step before the next target
            upper = targets[i + 1] if i + 1 < len(targets) else steps
            snapped = [s for s in save_steps if t <= s < upper]
            t, kind = (snapped[0], "save") if snapped else (t, "step")
        plan.append(Kill(kind, t, rng.uniform(0.0, max_delay_s)))
    return plan


# ------------------------------------------------------------------------------------------ the trainer


#: The operative-config key the drill may set differently in the reference and the interrupted run.
CACHE_KEY = "TrainConfig.compilation_cache_dir"


def trainer_command(args: argparse.Namespace, workdir: str, cache: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "jaxpt.train", "--workdir", workdir, "--steps", str(args.steps)]
    for c in args.config:
        cmd += ["--config", c]
    if args.mesh:
        cmd += ["--mesh", args.mesh]
    forced = ["TrainConfig.log_every = 1", "TrainConfig.log_batch_documents = True",
              "TrainConfig.progress_bar = False", "CheckpointConfig.enabled = True",
              "CheckpointConfig.async_save = True"]
    if args.save_every:
        forced.append(f"CheckpointConfig.save_every_steps = {args.save_every}")
    if not cache:
        forced.append(f"{CACHE_KEY} = ''")
    for b in [*args.gin, *forced]:
        cmd += ["--gin", b]
    return cmd


class MetricsTail:
    """Reads the records appended to ``<workdir>/metrics.jsonl`` since construction, a complete line at a time.

    ``offset`` is always the start of a line: an unfinished last line is read again at the next poll, so a
    trainer that is killed mid-line and restarted (its writer cuts the half line off before appending) is read
    correctly. Lines are parsed by :func:`jaxpt.run.monitor.parse_metrics_line` (MetricsFormatError on a bad one).
    """

    def __init__(self, workdir: str):
        self.path = fs.join(workdir, monitor.METRICS_FILE)
        data = b""
        if fs.exists(self.path):
            with fs.open(self.path, "rb") as f:
                data = f.read()
        self.offset = data.rfind(b"\n") + 1  # start of the unfinished line, if any
        self.line_no = data.count(b"\n", 0, self.offset)

    def poll(self) -> list[dict[str, Any]]:
        if not fs.exists(self.path):
            return []
        with fs.open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        records = []
        for raw in chunk[:end].split(b"\n")[:-1]:
            self.line_no += 1
            records.append(monitor.parse_metrics_line(raw, self.path, self.line_no))
        self.offset += end
        return records


def checkpoint_dirs(workdir: str) -> tuple[set[int], set[int]]:
    """``(committed steps, steps with a temporary, unfinished save directory)`` under ``<workdir>/checkpoints``."""
    committed, pending = set(), set()
    d = fs.join(workdir, "checkpoints")
    if not fs.isdir(d):
        return committed, pending
    for name in fs.listdir(d):
        head = name.split(".", 1)[0]
        if not head.isdigit():
            continue
        (pending if TMP_MARKER in name else committed).add(int(head))
    return committed, pending


@dataclasses.dataclass
class Launch:
    """What one trainer process did."""

    index: int
    started_s: float                 # since the drill's start
    resumed_step: int | None = None  # from the trainer's start/resume record
    first_step_s: float | None = None  # since launch: first new step's metrics logged
    last_step_done: int | None = None
    kill: dict | None = None
    returncode: int | None = None


def _local_log_dir(log_dir: str) -> str:
    """``log_dir`` when local; for a ``gs://`` one a local scratch folder (``<tmp>/jaxpt-drill-logs``) where the
    trainer's output is written while it runs (a subprocess needs a file descriptor), uploaded when it ends; one
    subfolder per ``log_dir``, so two drills never share a log file."""
    key = hashlib.sha256(log_dir.encode()).hexdigest()[:16]
    d = os.path.join(tempfile.gettempdir(), "jaxpt-drill-logs", key) if fs.is_remote(log_dir) else log_dir
    os.makedirs(d, exist_ok=True)
    return d


def run_launch(args, workdir: str, index: int, t0: float, kill: Kill | None, log_dir: str,
               cache: bool = True) -> Launch:
    """Start the trainer; SIGKILL it at ``kill`` (or let it finish). Raises DrillError on failure/timeout."""
    tail = MetricsTail(workdir)
    if kill is not None:
        kill = _retarget(kill, workdir, args.steps, args.save_every or 1)
    launch = Launch(index, time.monotonic() - t0)
    start = time.monotonic()
    name = f"launch_{index:02d}{'' if cache else '_nocache'}.log"
    # The trainer's output needs a real file descriptor: a local file, uploaded afterwards to a gs:// log_dir.
    local_log = os.path.join(_local_log_dir(log_dir), name)
    with open(local_log, "w") as log:
        proc = subprocess.Popen(trainer_command(args, workdir, cache), stdout=log, stderr=subprocess.STDOUT)
        try:
            fired_at = _watch(proc, tail, launch, kill, workdir, start, args.timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if fs.is_remote(log_dir):
                fs.copy(local_log, fs.join(log_dir, name))
    launch.returncode = proc.returncode
    for rec in tail.poll():  # records flushed just before the process died
        _absorb(launch, rec, start)
    if kill is not None:
        committed, pending = checkpoint_dirs(workdir)
        launch.kill = {"kind": kill.kind, "target_step": kill.target, "delay_s": round(kill.delay_s, 4),
                       "fired_after_s": round(fired_at - start, 3),
                       "inside_save": kill.target in pending and kill.target not in committed,
                       "committed_steps_after_kill": sorted(committed),
                       "newest_committed": max(committed) if committed else None}
    elif proc.returncode != 0:
        raise DrillError(f"trainer launch {index} exited with {proc.returncode}; see {log.name}")
    return launch


def _retarget(kill: Kill, workdir: str, steps: int, save_every: int) -> Kill:
    """A target at or below the newest committed step (the previous trainer got further than planned
    before it died) can never fire: move it to the next save step (``save``) or step (``step``) after it.

    Raises:
      DrillError: no such step remains before ``steps``.
    """
    committed, _ = checkpoint_dirs(workdir)
    newest = max(committed, default=0)
    if kill.target > newest:
        return kill
    target = newest + 1 if kill.kind == "step" else (newest // save_every + 1) * save_every
    if target >= steps:
        raise DrillError(f"planned kill at step {kill.target} is already behind the newest checkpoint "
                         f"({newest}) and no later step remains; raise --steps")
    return dataclasses.replace(kill, target=target)


def _absorb(launch: Launch, rec: dict, start: float) -> None:
    if rec.get("event") in ("start", "resume"):
        launch.resumed_step = int(rec["step"])
    elif "loss" in rec and "event" not in rec:
        if launch.first_step_s is None:
            launch.first_step_s = time.monotonic() - start
        launch.last_step_done = max(launch.last_step_done or 0, int(rec["step"]))


def _watch(proc, tail: MetricsTail, launch: Launch, kill: Kill | None, workdir: str, start: float,
           timeout_s: float) -> float | None:
    """Poll the trainer until it exits or the kill condition holds; returns when the kill was sent."""
    while True:
        for rec in tail.poll():
            _absorb(launch, rec, start)
        if kill is not None:
            committed, pending = checkpoint_dirs(workdir)
            if kill.kind == "save":
                due = kill.target in pending or kill.target in committed
            else:
                due = (launch.last_step_done or 0) >= kill.target
            if due:
                time.sleep(kill.delay_s)
                proc.send_signal(signal.SIGKILL)
                return time.monotonic()
        if proc.poll() is not None:
            if kill is not None:
                raise DrillError(f"trainer launch {launch.index} exited with {proc.returncode} before its "
                                 f"planned kill at step {kill.target} ({kill.kind})")
            return None
        if time.monotonic() - start > timeout_s:
            raise DrillError(f"trainer launch {launch.index} still running after {timeout_s:.0f} s")
        time.sleep(POLL_S)


# ------------------------------------------------------------------------------------------ comparison


def step_records(workdir: str) -> dict[int, list[dict]]:
    """Every per-step metrics record of a workdir, grouped by step, superseded ones included (a step re-run after
    a resume appears more than once: each must match the reference). Raises as :func:`jaxpt.run.monitor.read_metrics`."""
    out: dict[int, list[dict]] = {}
    for rec in monitor.read_metrics(workdir, superseded=True):
        if "loss" in rec and "event" not in rec:
            out.setdefault(rec["step"], []).append(rec)
    return out


def batch_documents(workdir: str) -> dict[int, list[list[int]]]:
    """Per step, every logged list of document indices (process 0's rows), superseded ones included (supersede
    markers are skipped).

    Raises:
      FileFormatError: a line of ``batches/process_0.jsonl`` breaks the JSON Lines rules (a half-written last
        line, from a killed trainer, is skipped), or lacks ``step``/``doc_index`` (reason ``bad_record``).
    """
    path = fs.join(workdir, "batches", "process_0.jsonl")
    out: dict[int, list[list[int]]] = {}
    for n, rec in jsonl.iter_objects(path, partial_last_line=True):
        if jsonl.SUPERSEDED_AFTER in rec:
            continue
        if not isinstance(rec.get("step"), int) or not isinstance(rec.get("doc_index"), list):
            raise FileFormatError.at(path, n, "bad_record", "needs an integer 'step' and a 'doc_index' list")
        out.setdefault(rec["step"], []).append(rec["doc_index"])
    return out


def _close(a, b, rtol: float) -> bool:
    if isinstance(a, str) or isinstance(b, str):  # "nan" written as a string
        return a == b
    return a == b if rtol == 0 else bool(np.isclose(a, b, rtol=rtol, atol=0.0))


def compare_metrics(ref: dict[int, list[dict]], got: dict[int, list[dict]], steps: int, rtol: float) -> dict:
    """Every record of every step vs the reference; ``continuous`` = each step 1..steps was logged."""
    mismatches, lr_mismatches = [], []
    for s in range(1, steps + 1):
        if s not in ref:
            raise DrillError(f"the reference run logged no metrics for step {s}")
        r = ref[s][-1]
        for rec in got.get(s, []):
            for k in DETERMINISTIC_KEYS:
                if k in r and not _close(rec.get(k), r[k], rtol):
                    (lr_mismatches if k == "learning_rate" else mismatches).append(
                        {"step": s, "key": k, "reference": r[k], "resumed": rec.get(k)})
    missing = [s for s in range(1, steps + 1) if s not in got]
    return {"loss_curve_continuous": not missing and not mismatches, "missing_steps": missing,
            "learning_rate_match": not lr_mismatches, "metric_mismatches": (mismatches + lr_mismatches)[:20]}


def compare_batches(ref: dict[int, list], got: dict[int, list], steps: int) -> dict:
    bad = [s for s in range(1, steps + 1) if not got.get(s) or any(d != ref[s][-1] for d in got[s])]
    return {"data_position_match": not bad, "batch_mismatch_steps": bad[:20]}


def load_state_numpy(workdir: str, step: int) -> dict[str, Any]:
    """A committed checkpoint's ``state`` item as host numpy arrays (no devices or mesh needed)."""
    import logging

    import jax
    import orbax.checkpoint as ocp

    path = fs.join(workdir, "checkpoints", str(step), "state")
    if not fs.isdir(path):
        raise DrillError(f"{path}: no such committed checkpoint")
    ckptr = ocp.PyTreeCheckpointer()
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)  # Orbax warns that an item directory has no step metadata
    try:
        tree = ckptr.metadata(path).item_metadata.tree
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        return ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    finally:
        absl_logger.setLevel(level)


def compare_final_state(ref_dir: str, got_dir: str, steps: int, rtol: float) -> dict:
    import jax

    ref, got = load_state_numpy(ref_dir, steps), load_state_numpy(got_dir, steps)
    same = lambda a, b: (np.array_equal(a, b) if rtol == 0 else  # noqa: E731
                         bool(np.allclose(a, b, rtol=rtol, atol=0.0)))
    p_ref, p_got = jax.tree.leaves(ref["params"]), jax.tree.leaves(got["params"])
    return {"rng_match": bool(np.array_equal(ref["rng"], got["rng"])) and int(ref["step"]) == int(got["step"]),
            "final_params_match": len(p_ref) == len(p_got) and all(same(a, b) for a, b in zip(p_ref, p_got))}


def final_heldout(workdir: str) -> float | None:
    """``heldout_loss`` of the last ``final`` event in metrics.jsonl (None without one)."""
    finals = [r for r in monitor.read_metrics(workdir) if r.get("event") == "final"]
    return finals[-1].get("heldout_loss") if finals else None


# ------------------------------------------------------------------------------------------ the drill


def summarize_restarts(launches: list[Launch], kill_times: list[float]) -> list[dict]:
    """Per restart: step resumed at, whether it was the newest committed one, steps lost, recovery time."""
    out = []
    for killed, nxt, t_kill in zip(launches, launches[1:], kill_times):
        expected = killed.kill["newest_committed"] or 0
        lost = max(0, (killed.last_step_done or 0) - (nxt.resumed_step or 0))
        recovery = None if nxt.first_step_s is None else nxt.started_s + nxt.first_step_s - t_kill
        out.append({"after_launch": killed.index, **killed.kill, "last_step_done": killed.last_step_done,
                    "resumed_step": nxt.resumed_step, "resumed_newest_committed": nxt.resumed_step == expected,
                    "steps_lost": lost, "recovery_time_s": None if recovery is None else round(recovery, 2)})
    return out


def mean_step_time_s(workdir: str) -> float | None:
    """Mean ``step_time_s`` over the logged step records of ``workdir`` (None without any)."""
    times = [r["step_time_s"] for r in monitor.read_metrics(workdir)
             if "event" not in r and isinstance(r.get("step_time_s"), (int, float))]
    return float(np.mean(times)) if times else None


def recovery_verdict(recovery_times_s: list[float], save_every_steps: int, step_time_s: float | None) -> dict:
    """The seed material's test: "is the recovery time after an interruption shorter than the checkpoint
    interval?" The interval in seconds is ``save_every_steps x step_time_s``; the worst recovery is compared.

    Returns:
      ``{"checkpoint_interval_s", "recovery_time_s_max", "recovery_shorter_than_interval"}`` (the verdict is
      None when either figure is unknown). When recovery takes longer than the interval, a failure costs more
      in restart than in redone steps: lengthen the interval (``jaxpt.tools.plan --mtbf-hours``) or speed up
      the restart (compilation cache, restore).
    """
    interval = None if step_time_s is None else save_every_steps * step_time_s
    worst = max(recovery_times_s) if recovery_times_s else None
    verdict = None if interval is None or worst is None else bool(worst < interval)
    return {"checkpoint_interval_s": None if interval is None else round(interval, 2),
            "recovery_time_s_max": worst, "recovery_shorter_than_interval": verdict}


def run_drill(args: argparse.Namespace) -> dict[str, Any]:
    """The reference run, then the interrupted run(s) of ``--compilation-cache``; the report as written to
    ``drill_report.json`` (the cache-on series at the top level, the cache-off one under
    ``without_compilation_cache`` when both ran)."""
    ref_dir = args.reference or fs.join(args.workdir, "reference")
    series = {"on": [True], "off": [False], "both": [True, False]}[args.compilation_cache]
    got_dirs = {c: fs.join(args.workdir, "interrupted" if c == series[0] else "interrupted_nocache")
                for c in series}
    for d in ([] if args.reference else [ref_dir]) + list(got_dirs.values()):
        if fs.isdir(d) and fs.listdir(d):
            raise DrillError(f"{d} is not empty; use a fresh --workdir")
    log_dir = fs.join(args.workdir, "logs")
    fs.makedirs(log_dir)
    save_every = args.save_every = args.save_every or _configured_save_every(args)
    plan = plan_kills(args.steps, args.kills, save_every, args.mode, args.seed, args.max_kill_delay_s)

    t0 = time.monotonic()
    if not args.reference:
        run_launch(args, ref_dir, 0, t0, None, log_dir)
    reference_s = time.monotonic() - t0
    results = {c: run_series(args, ref_dir, got_dirs[c], plan, t0, log_dir, c) for c in series}
    report = {"command": trainer_command(args, got_dirs[series[0]], series[0]), "steps": args.steps,
              "kills": args.kills, "seed": args.seed, "mode": args.mode, "save_every_steps": save_every,
              "rtol": args.rtol, "reference_wall_s": round(reference_s, 2), **results[series[0]]}
    if len(series) == 2:
        off = results[False]
        report["without_compilation_cache"] = off
        report["summary"]["recovery_time_s_mean_without_cache"] = off["summary"]["recovery_time_s_mean"]
        report["ok"] = report["ok"] and off["ok"]
    return report


def run_series(args: argparse.Namespace, ref_dir: str, got_dir: str, plan: list[Kill], t0: float, log_dir: str,
               cache: bool) -> dict[str, Any]:
    """The interrupted run into ``got_dir`` (the trainer's compilation cache on or off), killed by ``plan``, and
    its comparison with the reference: restarts, matches, summary and ``ok``."""
    t_drill = time.monotonic()
    launches, kill_times = [], []
    for i, kill in enumerate(plan, 1):
        launch = run_launch(args, got_dir, i, t0, kill, log_dir, cache)
        if i == 1:
            check_same_config(ref_dir, got_dir)
        kill_times.append(launch.started_s + launch.kill["fired_after_s"])
        launches.append(launch)
    launches.append(run_launch(args, got_dir, len(plan) + 1, t0, None, log_dir, cache))
    if not plan:
        check_same_config(ref_dir, got_dir)
    restarts = summarize_restarts(launches, kill_times)

    report = {"compilation_cache": cache, "interrupted_wall_s": round(time.monotonic() - t_drill, 2),
              "restarts": restarts}
    report.update(compare_metrics(step_records(ref_dir), step_records(got_dir), args.steps, args.rtol))
    report.update(compare_batches(batch_documents(ref_dir), batch_documents(got_dir), args.steps))
    report.update(compare_final_state(ref_dir, got_dir, args.steps, args.rtol))
    report["leftover_tmp_dirs"] = sorted(checkpoint_dirs(got_dir)[1])
    h_ref, h_got = final_heldout(ref_dir), final_heldout(got_dir)
    report["final_heldout_loss"] = {"reference": h_ref, "interrupted": h_got}
    times = [r["recovery_time_s"] for r in restarts if r["recovery_time_s"] is not None]
    report["summary"] = {
        "kills_inside_save": sum(r["inside_save"] for r in restarts),
        "every_restart_resumed_newest_committed": all(r["resumed_newest_committed"] for r in restarts),
        "steps_lost_total": sum(r["steps_lost"] for r in restarts),
        "steps_lost_max": max((r["steps_lost"] for r in restarts), default=0),
        "recovery_time_s_mean": round(float(np.mean(times)), 2) if times else None,
        **recovery_verdict(times, args.save_every, mean_step_time_s(ref_dir)),
    }
    report["ok"] = bool(report["loss_curve_continuous"] and report["learning_rate_match"]
                        and report["data_position_match"] and report["rng_match"]
                        and report["final_params_match"] and h_ref is not None and h_got is not None
                        and _close(h_got, h_ref, args.rtol)
                        and report["summary"]["every_restart_resumed_newest_committed"])
    return report


def check_same_config(ref_dir: str, got_dir: str) -> None:
    """The reference and the interrupted run must have the same operative config (workdir and compilation cache
    aside).

    Raises:
      DrillError: naming the first differing line.
    """
    def lines(d):
        out, skipping = [], False
        for line in fs.read_text(fs.join(d, "config.gin")).splitlines():
            # gin wraps long values onto indented continuation lines
            skipping = (line.startswith(("TrainConfig.workdir", CACHE_KEY))
                        or (skipping and line[:1].isspace()))
            if not skipping:
                out.append(line)
        return out
    a, b = lines(ref_dir), lines(got_dir)
    if a != b:
        diff = next((f"{x!r} vs {y!r}" for x, y in zip(a, b) if x != y), "different lengths")
        raise DrillError(f"{ref_dir}/config.gin differs from the drill's trainer config: {diff}")


def _configured_save_every(args: argparse.Namespace) -> int:
    return config_lib.parse(args.config, args.gin).checkpoint.save_every_steps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxpt.tools.drill", description=__doc__.splitlines()[0])
    p.add_argument("--config", action="append", default=[], metavar="FILE", help="gin file; may repeat")
    p.add_argument("--gin", action="append", default=[], metavar="BINDING", help="gin binding; may repeat")
    p.add_argument("--mesh", help="mesh sizes for the trainer, e.g. data=2,fsdp=2,tensor=2")
    p.add_argument("--workdir", required=True, help="drill directory (reference/, interrupted/, logs/)")
    p.add_argument("--steps", type=int, default=40, help="global step every run trains to")
    p.add_argument("--kills", type=int, default=3, help="SIGKILLs of the interrupted run")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill plan (targets, kinds, delays)")
    p.add_argument("--mode", choices=("mixed", "save", "step"), default="mixed",
                   help="kill inside saves, after steps, or a random mix")
    p.add_argument("--save-every", type=int, default=5,
                   help="CheckpointConfig.save_every_steps for the drill (0: the config's own)")
    p.add_argument("--max-kill-delay-s", type=float, default=0.05,
                   help="random delay before each kill, uniform in [0, this]")
    p.add_argument("--reference", metavar="DIR",
                   help="reuse this finished uninterrupted run (same flags; its config.gin is checked) "
                        "instead of training a reference")
    p.add_argument("--rtol", type=float, default=0.0, help="tolerance of the comparisons (0: bitwise)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per trainer launch")
    p.add_argument("--compilation-cache", choices=("on", "off", "both"), default="on",
                   help="the interrupted trainer's persistent compilation cache: on (the default, as in production), "
                        "off, or both (the same kill plan twice; recovery times side by side)")
    p.add_argument("--no-compilation-cache", dest="compilation_cache", action="store_const", const="off",
                   help="the same as --compilation-cache off")
    args = p.parse_args(argv)
    if args.steps < 2 or args.kills < 0:
        p.error("need --steps >= 2 and --kills >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fs.makedirs(args.workdir)
    try:
        report = run_drill(args)
    except DrillError as e:
        print(f"drill error: {e}", file=sys.stderr)
        return 2
    path = fs.join(args.workdir, "drill_report.json")
    fs.write_text_atomic(path, jsonl.dumps(report, indent=2))
    s = report["summary"]
    print(f"drill: {len(report['restarts'])} kills ({s['kills_inside_save']} inside an unfinished save); "
          f"recovery {s['recovery_time_s_mean']} s mean, {s['recovery_time_s_max']} s max; "
          f"steps lost {s['steps_lost_total']} in all, {s['steps_lost_max']} at most")
    print(f"  checkpoint interval {s['checkpoint_interval_s']} s (every {report['save_every_steps']} steps); "
          f"recovery shorter than the interval: {s['recovery_shorter_than_interval']}")
    print(f"  resumed newest committed step every time: {s['every_restart_resumed_newest_committed']}; "
          f"loss curve continuous: {report['loss_curve_continuous']}; learning rate: "
          f"{report['learning_rate_match']}; data position: {report['data_position_match']}; RNG: "
          f"{report['rng_match']}; final params: {report['final_params_match']}")
    if "without_compilation_cache" in report:
        off = report["without_compilation_cache"]["summary"]
        print(f"  without the compilation cache: recovery {off['recovery_time_s_mean']} s mean, "
              f"{off['recovery_time_s_max']} s max (with it: {s['recovery_time_s_mean']} s mean)")
    print(f"  {'OK' if report['ok'] else 'MISMATCH'}; report: {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
