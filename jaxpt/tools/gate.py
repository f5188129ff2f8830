"""``python -m jaxpt.tools.gate WORKDIR``: judge a small-scale run against the acceptance criteria before scaling up.

    python -m jaxpt.tools.gate workdirs/quickstart [--estimate-tokens-per-sec N] [--mtbf-hours H] [--json]

Reads the run's ``metrics.jsonl`` (:func:`jaxpt.run.monitor.read_metrics`), its ``run.json`` and its checkpoint
directory; trains nothing. Each criterion reports its measured value, its threshold (:class:`GateConfig`,
set with ``--gin 'GateConfig.field = value'`` or the constructor) and a verdict:

``loss_smooth``
    No sustained rising segment: over every window of ``rise_window`` consecutive logged losses (each the
    interval mean ``loss_mean`` when the record has it), the least-squares slope times the window's span of
    steps, relative to the window's mean loss, stays at most ``rise_tolerance``. One noisy point cannot fail
    it; a climb that lasts a window does.
``spikes``
    Spikes counted from the run's own records: every ``spike_skip`` / ``nonfinite_skip`` / ``rollback``
    event, plus every logged loss above ``(1 + spike_jump)`` times the median of the ``rise_window``
    logged losses before it (a spike that the on-device skip did not catch). At most
    ``max_spikes_per_1k_steps`` per thousand steps trained (and at least ``max_spikes_min``).
``grad_norm_stable``
    The grad norm's median over the last quarter of the run is at most ``grad_norm_growth`` times its
    median over the first quarter, no logged grad norm in the second half exceeds ``grad_norm_spike_ratio``
    times the second half's median, and the share of clipped steps in the last quarter is at most the first
    quarter's plus ``clip_rise_tolerance`` (shares from the cumulative ``clipped_fraction``).
``tokens_per_sec``
    The median logged ``tokens_per_sec`` (step 1, which compiles, excluded; with a batch-size ramp, over the
    records at the full batch) within ``throughput_tolerance``
    (±20%) of an estimate: ``--estimate-tokens-per-sec``, or ``--estimate-mfu`` x the run's peak FLOP/s x
    devices / FLOPs per token (the same figures :mod:`jaxpt.training.flops` gives :mod:`jaxpt.tools.plan`), or by
    default from the compiled step: ``expected_flops_utilization`` x the run's peak FLOP/s x tokens per step /
    the compiled step's FLOPs per device (XLA's cost analysis; ``--compile-report`` from ``python -m
    jaxpt.tools.compile --json`` for the run's target, else the run's config compiled on this host). Outside
    it, the report says what dominates the step: waiting for data (``data_wait_s / step_time_s``) or
    communication (the collective share of the run's profiled steps, ``TrainConfig.profile_steps``, as
    :func:`jaxpt.tools.sweep.collective_time_us` measures it). Without an estimate it is ``not judged``.
``checkpoint_restore``
    A checkpoint was committed and the run resumed from one at least once (a ``resume`` record), and the
    loss after the resume continues the trajectory: a step logged both before and after the resume agrees
    within ``resume_exact_rtol``; otherwise the first loss after the resume is within ``resume_loss_rtol`` of
    the least-squares line through the last ``rise_window`` losses before it, extrapolated.
``heldout_trend``
    At least two held-out evaluations on the same tokens (``TrainConfig.eval_every``; the final evaluation
    reads the whole set and forms its own series), the last below the first, and the last at most
    ``(1 + heldout_tolerance)`` times the best.

Exit status: 0 when every criterion passes (``not judged`` criteria are listed and, with ``--strict``, fail
the gate), 1 when any fails, 2 when the workdir cannot be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any

import numpy as np

from jaxpt import config as config_lib
from jaxpt.lab import plan
from jaxpt.lab.registry import table
from jaxpt.run import build as builder, monitor
from jaxpt.tools import sweep
from jaxpt.tools.compile import compiled_flops
from jaxpt.util import fs
from jaxpt.util.errors import ConfigError, report_cli_error
from jaxpt.util.validation import check_types, positive, require

PASS, FAIL, NOT_JUDGED = "pass", "FAIL", "not judged"
SPIKE_EVENTS = ("spike_skip", "nonfinite_skip", "rollback")


@dataclasses.dataclass(frozen=True)
class GateConfig:
    """Thresholds of the scale-up gate (see the module docstring for each criterion).

    Attributes:
      rise_window: logged loss points per least-squares window (>= 3).
      rise_tolerance: largest relative rise of the fitted line across one window (0.02: 2%).
      spike_jump: a logged loss above ``(1 + spike_jump) x`` the median of the window before it is a spike.
      max_spikes_per_1k_steps: spikes allowed per thousand steps trained.
      max_spikes_min: spikes always allowed, however short the run.
      grad_norm_growth: last-quarter / first-quarter median grad norm allowed.
      grad_norm_spike_ratio: a second-half grad norm above this x the second half's median fails.
      clip_rise_tolerance: last-quarter clipped share allowed above the first quarter's (0..1).
      throughput_tolerance: relative distance of tokens/s from the estimate allowed (0.2: ±20%).
      resume_loss_rtol: relative distance of the first loss after a resume from the extrapolated trend.
      resume_exact_rtol: relative distance of a step's loss logged before and after a resume.
      heldout_tolerance: the last held-out loss may exceed the best by this fraction.
      expected_flops_utilization: for the estimate the gate derives itself (no ``--estimate-*`` given): the
        fraction of the device's peak FLOP/s the compiled step's FLOPs are expected to run at (0..1].

    Raises:
      ConfigError: naming ``GateConfig.<field> = <value>``: a wrong type, ``rise_window < 3`` or a
        non-positive threshold.
    """

    rise_window: int = 5
    rise_tolerance: float = 0.02
    spike_jump: float = 0.25
    max_spikes_per_1k_steps: float = 5.0
    max_spikes_min: int = 0
    grad_norm_growth: float = 2.0
    grad_norm_spike_ratio: float = 3.0
    clip_rise_tolerance: float = 0.05
    throughput_tolerance: float = 0.2
    resume_loss_rtol: float = 0.1
    resume_exact_rtol: float = 1e-3
    heldout_tolerance: float = 0.01
    expected_flops_utilization: float = 0.5

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "rise_window", self.rise_window >= 3, "at least 3 points to fit a slope")
        positive(self, "rise_tolerance", "spike_jump", "max_spikes_per_1k_steps", "grad_norm_growth",
                 "grad_norm_spike_ratio", "throughput_tolerance", "resume_loss_rtol", "resume_exact_rtol")
        require(self, "max_spikes_min", self.max_spikes_min >= 0, "must be >= 0")
        require(self, "clip_rise_tolerance", self.clip_rise_tolerance >= 0, "must be >= 0")
        require(self, "heldout_tolerance", self.heldout_tolerance >= 0, "must be >= 0")
        require(self, "expected_flops_utilization", 0 < self.expected_flops_utilization <= 1, "must be in (0, 1]")


@dataclasses.dataclass
class Criterion:
    """One criterion's result: ``measured`` and ``threshold`` as text with units, ``verdict`` one of
    :data:`PASS`, :data:`FAIL`, :data:`NOT_JUDGED`, and ``reason`` saying why in words."""

    name: str
    measured: str
    threshold: str
    verdict: str
    reason: str = ""


# ------------------------------------------------------------------------------------------ series


def step_records(records: list[dict]) -> list[dict]:
    """The per-step records (no ``event``) that carry a finite ``loss``, in step order."""
    out = [r for r in records if "event" not in r and _finite(r.get("loss"))]
    return sorted(out, key=lambda r: r["step"])


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def loss_series(records: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """``(steps int[n], loss float[n])``: per logged step, the interval mean ``loss_mean`` when present (it
    averages the steps since the previous record), else ``loss``."""
    recs = step_records(records)
    steps = np.array([r["step"] for r in recs], dtype=np.int64)
    loss = np.array([r["loss_mean"] if _finite(r.get("loss_mean")) else r["loss"] for r in recs], np.float64)
    return steps, loss


def max_window_rise(steps: np.ndarray, values: np.ndarray, window: int) -> tuple[float, int | None]:
    """The largest relative rise over any ``window`` consecutive points: the least-squares slope (per step)
    times the window's span of steps, divided by the window's mean value. Returns ``(rise, first step of that
    window)``; ``(-inf, None)`` with fewer than ``window`` points."""
    best, at = -math.inf, None
    for i in range(len(values) - window + 1):
        x, y = steps[i:i + window].astype(np.float64), values[i:i + window]
        slope = np.polyfit(x, y, 1)[0]
        rise = slope * (x[-1] - x[0]) / max(abs(float(np.mean(y))), 1e-12)
        if rise > best:
            best, at = float(rise), int(x[0])
    return best, at


# ------------------------------------------------------------------------------------------ criteria


def check_loss_smooth(records: list[dict], cfg: GateConfig) -> Criterion:
    """No sustained rising segment (module docstring, ``loss_smooth``)."""
    steps, loss = loss_series(records)
    thr = f"rise over {cfg.rise_window} log points <= {cfg.rise_tolerance:.1%}"
    if len(loss) < cfg.rise_window:
        return Criterion("loss_smooth", f"{len(loss)} log points", thr, FAIL,
                         f"too few logged losses to judge (need {cfg.rise_window})")
    rise, at = max_window_rise(steps, loss, cfg.rise_window)
    ok = rise <= cfg.rise_tolerance
    end = steps[list(steps).index(at) + cfg.rise_window - 1]
    reason = "" if ok else f"loss rises {rise:.1%} over steps {at}-{end} (least-squares fit)"
    return Criterion("loss_smooth", f"max rise {rise:+.2%} (steps {at}-{end})", thr, PASS if ok else FAIL, reason)


def count_spikes(records: list[dict], cfg: GateConfig) -> list[tuple[int, str]]:
    """``[(step, kind), ...]``: skip and rollback events, and logged losses that jump above the median of
    the window before them (module docstring, ``spikes``)."""
    out = [(r["step"], r["event"]) for r in records if r.get("event") in SPIKE_EVENTS]
    steps, loss = loss_series(records)
    w = cfg.rise_window
    for i in range(w, len(loss)):
        if loss[i] > (1 + cfg.spike_jump) * float(np.median(loss[i - w:i])):
            out.append((int(steps[i]), "loss_jump"))
    return sorted(out)


def check_spikes(records: list[dict], cfg: GateConfig) -> Criterion:
    """The count of spikes within the allowed range (module docstring, ``spikes``)."""
    steps, _ = loss_series(records)
    trained = int(steps.max()) if len(steps) else 0
    allowed = max(cfg.max_spikes_min, math.floor(cfg.max_spikes_per_1k_steps * trained / 1000))
    spikes = count_spikes(records, cfg)
    ok = len(spikes) <= allowed
    listed = ", ".join(f"{k} at {s}" for s, k in spikes[:8]) + (" ..." if len(spikes) > 8 else "")
    return Criterion("spikes", f"{len(spikes)} in {trained} steps" + (f" ({listed})" if spikes else ""),
                     f"<= {allowed} ({cfg.max_spikes_per_1k_steps:g} per 1k steps)", PASS if ok else FAIL,
                     "" if ok else f"{len(spikes)} spikes > {allowed} allowed: {listed}")


def _quarters(steps: np.ndarray) -> tuple[float, float, float]:
    lo, hi = float(steps.min()), float(steps.max())
    span = hi - lo
    return lo + span / 4, lo + span / 2, hi - span / 4


def clipped_share(records: list[dict], start: float, stop: float) -> float | None:
    """Share of steps in ``(start, stop]`` whose gradient was clipped, from the cumulative ``clipped_fraction``
    (clipped steps / steps so far) of the records nearest to each bound: ``(f(b) b - f(a) a) / (b - a)``.
    None without two such records."""
    recs = [r for r in step_records(records) if _finite(r.get("clipped_fraction"))]
    if len(recs) < 2:
        return None
    a = min(recs, key=lambda r: abs(r["step"] - start))
    b = min(recs, key=lambda r: abs(r["step"] - stop))
    if b["step"] <= a["step"]:
        return None
    return (b["clipped_fraction"] * b["step"] - a["clipped_fraction"] * a["step"]) / (b["step"] - a["step"])


def check_grad_norm(records: list[dict], cfg: GateConfig) -> Criterion:
    """Grad norm stable and clipped share not risen (module docstring, ``grad_norm_stable``)."""
    recs = [r for r in step_records(records) if _finite(r.get("grad_norm"))]
    thr = (f"last/first quarter median <= {cfg.grad_norm_growth:g}; second-half max <= "
           f"{cfg.grad_norm_spike_ratio:g} x median; clipped share rise <= {cfg.clip_rise_tolerance:.0%}")
    if len(recs) < 6:
        return Criterion("grad_norm_stable", f"{len(recs)} log points", thr, FAIL, "too few grad norms (need 6)")
    steps = np.array([r["step"] for r in recs])
    gn = np.array([r["grad_norm"] for r in recs], np.float64)
    q1, q2, q3 = _quarters(steps)
    first, last, half = gn[steps <= q1], gn[steps > q3], gn[steps > q2]
    growth = float(np.median(last) / np.median(first))
    peak = float(half.max() / np.median(half))
    c_first, c_last = clipped_share(records, steps.min(), q1), clipped_share(records, q3, steps.max())
    clip_rise = None if c_first is None or c_last is None else c_last - c_first
    reasons = []
    if growth > cfg.grad_norm_growth:
        reasons.append(f"grad norm median grew {growth:.2f}x from the first to the last quarter")
    if peak > cfg.grad_norm_spike_ratio:
        at = int(steps[steps > q2][int(np.argmax(half))])
        reasons.append(f"grad norm {half.max():.3g} at step {at} is {peak:.1f}x the second half's median")
    if clip_rise is not None and clip_rise > cfg.clip_rise_tolerance:
        reasons.append(f"clipped share rose from {c_first:.0%} (first quarter) to {c_last:.0%} (last quarter)")
    clip_text = "n/a" if clip_rise is None else f"{c_first:.0%} -> {c_last:.0%}"
    return Criterion("grad_norm_stable", f"growth {growth:.2f}x; second-half max {peak:.2f}x median; clipped "
                     f"{clip_text}", thr, FAIL if reasons else PASS, "; ".join(reasons))


def collective_share(workdir: str, records: list[dict]) -> float | None:
    """Share (0..1) of the profiled steps' device time in collectives: the ``comm_share`` the loop's profile
    window logged (:func:`jaxpt.run.profile_comm.comm_share_by_axis`); for a record without it (a run of an
    older version), the summed collective-op time of the trace per device over ``steps x step_time_s`` of
    the window. None without a profile record or trace."""
    prof = [r for r in records if r.get("profile_dir")]
    if not prof:
        return None
    if _finite(prof[-1].get("comm_share")):
        return float(prof[-1]["comm_share"])
    try:
        coll_us, _ = sweep.collective_time_us(prof[-1]["profile_dir"])
    except (FileNotFoundError, OSError, ValueError):
        return None
    run = _run_json(workdir)
    devices = (run.get("devices") or {}).get("count") or 1
    a, b = (int(x) for x in (_gin_value(workdir, "TrainConfig.profile_steps") or "1:1").strip("'\"").split(":"))
    window = b - a + 1
    step_time = prof[-1].get("step_time_s") or _median([r.get("step_time_s") for r in step_records(records)])
    if not step_time:
        return None
    return min(coll_us / 1e6 / devices / (window * step_time), 1.0)


def collective_axes_text(records: list[dict]) -> str:
    """``' (fsdp 30%, data 12%)'``: the profile window's collective share per mesh axis, largest first; ``''``
    when not logged."""
    prof = [r for r in records if r.get("profile_dir")]
    axes = {k.split("/", 1)[1]: v for k, v in (prof[-1].items() if prof else ()) if k.startswith("comm_share/")}
    if not axes:
        return ""
    return " (" + ", ".join(f"{k} {v:.0%}" for k, v in sorted(axes.items(), key=lambda kv: -kv[1])) + ")"


def _median(values: list) -> float | None:
    vals = [v for v in values if _finite(v)]
    return float(np.median(vals)) if vals else None


def mfu_estimate(records: list[dict], workdir: str, mfu: float) -> float | None:
    """Tokens/s the run would reach at model FLOPs utilization ``mfu``: ``mfu x peak x devices / FLOPs per
    token``, with the peak from the run's start record and FLOPs per token from its logged
    ``tflops_per_device`` and ``tokens_per_sec`` (both from :func:`jaxpt.training.flops.flops_per_token`)."""
    start = next((r for r in records if r.get("event") in ("start", "resume") and r.get("peak_flops_per_device")),
                 None)
    devices = (_run_json(workdir).get("devices") or {}).get("count")
    recs = [r for r in step_records(records) if _finite(r.get("tflops_per_device")) and r.get("tokens_per_sec")]
    if start is None or not devices or not recs:
        return None
    fpt = recs[-1]["tflops_per_device"] * 1e12 * devices / recs[-1]["tokens_per_sec"]
    return mfu * start["peak_flops_per_device"] * devices / fpt


def compiled_step_report(workdir: str) -> dict[str, Any]:
    """``flops_per_step`` (per device, XLA's cost analysis) and ``tokens_per_step`` of the run's train step,
    compiled here from the workdir's ``config.gin`` on this host's devices (:func:`jaxpt.tools.compile.compiled_flops`).

    Raises:
      ConfigError: no config.gin, or this host's devices differ from the run's (count or kind, from run.json):
        pass ``--compile-report`` (``python -m jaxpt.tools.compile ... --json`` for the run's target) instead.
    """
    import jax
    gin_path = fs.join(workdir, "config.gin")
    if not fs.isfile(gin_path):
        raise ConfigError(f"{gin_path}: no operative config to compile")
    ran = _run_json(workdir).get("devices") or {}
    here = {"count": jax.device_count(), "kind": jax.devices()[0].device_kind}
    if ran and (ran.get("count"), ran.get("kind")) != (here["count"], here["kind"]):
        raise ConfigError(f"the run had {ran.get('count')} x {ran.get('kind')!r}, this host {here['count']} x "
                          f"{here['kind']!r}: pass --compile-report from `python -m jaxpt.tools.compile --json`")
    cfg = config_lib.parse([gin_path], ["TrainConfig.progress_bar = False"])
    built = builder.build_for(cfg)
    return {"flops_per_step": compiled_flops(built.lower_train_step().compile()),
            "tokens_per_step": built.cfg.global_batch_size * built.cfg.seq_len}


def compiled_estimate(records: list[dict], report: dict[str, Any], utilization: float) -> tuple[float | None, str]:
    """Tokens/s expected from a compile report: ``utilization x peak x tokens_per_step / flops_per_step``
    (per device: the step's compiled FLOPs run at ``utilization`` of the peak FLOP/s the run's start record
    logged, spec sheet or measured). Returns ``(estimate, how)``; ``(None, why)`` without a peak or FLOPs."""
    start = next((r for r in records if r.get("event") in ("start", "resume") and r.get("peak_flops_per_device")),
                 None)
    flops, tokens = report.get("flops_per_step"), report.get("tokens_per_step")
    if start is None or not flops or not tokens:
        return None, "no peak FLOP/s in the start record or no compiled FLOPs"
    peak = start["peak_flops_per_device"]
    est = utilization * peak * tokens / flops
    return est, (f"estimate {est:.4g} tokens/s = {utilization:g} x peak {peak:.3g} FLOP/s x {tokens} tokens / "
                 f"{flops:.3g} compiled FLOPs per device-step")


def check_throughput(records: list[dict], workdir: str, cfg: GateConfig, estimate: float | None) -> Criterion:
    """Tokens/s within tolerance of ``estimate``; when outside, what dominates (module docstring)."""
    recs = [r for r in step_records(records) if r["step"] > 1 and _finite(r.get("tokens_per_sec"))]
    full = max((r.get("batch_size", 0) for r in recs), default=0)
    recs = [r for r in recs if r.get("batch_size", 0) == full]  # a batch-size ramp: the full batch's steps
    measured = _median([r["tokens_per_sec"] for r in recs])
    thr = f"within ±{cfg.throughput_tolerance:.0%} of the estimate"
    if measured is None:
        return Criterion("tokens_per_sec", "no tokens_per_sec records", thr, FAIL, "no throughput was logged")
    if estimate is None:
        return Criterion("tokens_per_sec", f"{measured:.4g} tokens/s", thr, NOT_JUDGED,
                         "no estimate: pass --estimate-tokens-per-sec or --estimate-mfu")
    rel = measured / estimate - 1
    text = f"{measured:.4g} tokens/s ({rel:+.1%} vs {estimate:.4g})"
    if abs(rel) <= cfg.throughput_tolerance:
        return Criterion("tokens_per_sec", text, thr, PASS)
    wait = _median([r.get("data_wait_s") for r in recs]) or 0.0
    step = _median([r.get("step_time_s") for r in recs]) or math.inf
    data_share = wait / step
    coll = collective_share(workdir, records)
    coll_text = ("not measured (no profile: set TrainConfig.profile_steps)" if coll is None
                 else f"{coll:.0%}{collective_axes_text(records)}")
    if coll is not None and coll > data_share:
        dominant = f"communication dominates{collective_axes_text(records)}"
    elif data_share >= 0.1:
        dominant = "data waiting dominates"
    else:
        dominant = "neither data waiting nor measured communication dominates (compute-bound or mis-estimated)"
    return Criterion("tokens_per_sec", text + f"; data wait {data_share:.0%} of the step, collectives {coll_text}",
                     thr, FAIL, f"{'below' if rel < 0 else 'above'} the estimate: {dominant}")


def committed_checkpoints(workdir: str) -> list[int]:
    """Committed checkpoint steps under ``<workdir>/checkpoints`` (directories named by their step)."""
    d = fs.join(workdir, "checkpoints")
    return sorted(int(n) for n in fs.listdir(d) if n.isdigit()) if fs.isdir(d) else []


def check_checkpoint_restore(all_records: list[dict], workdir: str, cfg: GateConfig) -> Criterion:
    """Checkpoint save and restore ran and the loss continued its trajectory (module docstring).

    ``all_records``: every record as written (``read_metrics(..., superseded=True)``), so the losses a resumed
    session re-logged can be compared with the first logging.
    """
    thr = (f"a resume; re-logged steps within {cfg.resume_exact_rtol:g}, else first loss within "
           f"{cfg.resume_loss_rtol:.0%} of the extrapolated trend")
    saved = committed_checkpoints(workdir)
    resumes = [i for i, r in enumerate(all_records) if r.get("event") == "resume"]
    if not saved:
        return Criterion("checkpoint_restore", "no committed checkpoint", thr, FAIL,
                         "no checkpoint was saved (CheckpointConfig.enabled, save_every_steps)")
    if not resumes:
        return Criterion("checkpoint_restore", f"{len(saved)} checkpoints, no resume", thr, FAIL,
                         "the run never resumed from a checkpoint: rerun it to a later --steps (or run "
                         "python -m jaxpt.tools.drill) so restore is exercised")
    worst, texts = 0.0, []
    for i in resumes:
        at = all_records[i]["step"]
        before = {r["step"]: r for r in step_records(all_records[:i])}
        after = step_records(all_records[i + 1:])
        after = [r for r in after if r["step"] > at]
        if not after:
            continue
        again = [r for r in after if r["step"] in before]
        if again:
            rel = max(abs(r["loss"] / before[r["step"]]["loss"] - 1) for r in again)
            ok = rel <= cfg.resume_exact_rtol
            texts.append(f"resume at {at}: {len(again)} re-logged steps, max rel diff {rel:.2g}")
            worst = max(worst, rel / cfg.resume_exact_rtol)
            continue
        steps, loss = loss_series([r for r in before.values() if r["step"] <= at])
        if len(loss) < 2:
            texts.append(f"resume at {at}: too few losses before it to extrapolate")
            worst = max(worst, math.inf)
            continue
        k = min(cfg.rise_window, len(loss))
        fit = np.polyfit(steps[-k:].astype(np.float64), loss[-k:], 1)
        first_steps, first_loss = loss_series(after[:1])
        pred = float(np.polyval(fit, first_steps[0]))
        rel = abs(first_loss[0] / pred - 1)
        texts.append(f"resume at {at}: loss {first_loss[0]:.4g} at step {first_steps[0]} vs trend {pred:.4g} "
                     f"({rel:+.1%})")
        worst = max(worst, rel / cfg.resume_loss_rtol)
    if not texts:
        return Criterion("checkpoint_restore", f"{len(resumes)} resume(s) with no step after", thr, FAIL,
                         "no step was logged after the resume")
    ok = worst <= 1.0
    return Criterion("checkpoint_restore", "; ".join(texts), thr, PASS if ok else FAIL,
                     "" if ok else "the loss after a resume does not continue the trajectory")


def heldout_series(records: list[dict]) -> list[tuple[int, float]]:
    """``[(step, heldout_loss), ...]`` of the evaluations made on the same held-out tokens: records are grouped
    by ``heldout_tokens`` (the in-loop evaluation reads ``TrainConfig.eval_batches``, the final one the whole
    set, so their losses are not comparable) and the group with the most points is kept (the later on a tie)."""
    groups: dict[Any, dict[int, float]] = {}
    for r in records:
        if _finite(r.get("heldout_loss")):
            groups.setdefault(r.get("heldout_tokens"), {})[r["step"]] = float(r["heldout_loss"])
    if not groups:
        return []
    best = max(groups.values(), key=lambda g: (len(g), max(g)))
    return sorted(best.items())


def check_heldout(records: list[dict], cfg: GateConfig) -> Criterion:
    """Held-out loss falls (module docstring, ``heldout_trend``), on one held-out basis (:func:`heldout_series`)."""
    pts = heldout_series(records)
    thr = f"last < first and last <= best x {1 + cfg.heldout_tolerance:g}"
    if len(pts) < 2:
        return Criterion("heldout_trend", f"{len(pts)} evaluation(s)", thr, FAIL,
                         "need two held-out evaluations on the same tokens (TrainConfig.eval_every)")
    first, last, best = pts[0][1], pts[-1][1], min(v for _, v in pts)
    text = " -> ".join(f"{v:.4g}@{s}" for s, v in pts[:6]) + (" ..." if len(pts) > 6 else "")
    reasons = []
    if last >= first:
        reasons.append(f"held-out loss did not fall ({first:.4g} at {pts[0][0]} -> {last:.4g} at {pts[-1][0]})")
    if last > best * (1 + cfg.heldout_tolerance):
        reasons.append(f"held-out loss {last:.4g} is above its best {best:.4g}")
    return Criterion("heldout_trend", text, thr, FAIL if reasons else PASS, "; ".join(reasons))


# ------------------------------------------------------------------------------------------ the gate


def _gin_value(workdir: str, key: str) -> str | None:
    """The value text of ``key`` in the run's operative ``config.gin`` (None when absent)."""
    path = fs.join(workdir, "config.gin")
    if fs.isfile(path):
        for line in fs.read_text(path).splitlines():
            if line.split("=")[0].strip() == key:
                return line.split("=", 1)[1].strip()
    return None


def _run_json(workdir: str) -> dict:
    path = fs.join(workdir, "run.json")
    if not fs.isfile(path):
        return {}
    return fs.read_json(path, "the run record")


def judge(workdir: str, cfg: GateConfig | None = None, estimate_tokens_per_sec: float | None = None,
          estimate_mfu: float | None = None, compile_report: dict | str | None = None) -> list[Criterion]:
    """Every criterion of the gate for the run in ``workdir``.

    The throughput estimate: ``estimate_tokens_per_sec``, else ``estimate_mfu`` (:func:`mfu_estimate`), else
    from the compiled step's FLOPs (:func:`compiled_estimate`) of ``compile_report`` (a ``python -m
    jaxpt.tools.compile --json`` report, or its path), else of the run's config compiled here
    (:func:`compiled_step_report`; ``not judged``, with the reason, when this host cannot).

    Raises:
      FileNotFoundError: no metrics.jsonl.
      MetricsFormatError: a malformed metrics.jsonl (file and line named).
    """
    cfg = cfg or GateConfig()
    records = monitor.read_metrics(workdir)
    everything = monitor.read_metrics(workdir, superseded=True)
    estimate, how = estimate_tokens_per_sec, ""
    if estimate is None and estimate_mfu is not None:
        estimate = mfu_estimate(records, workdir, estimate_mfu)
    if estimate is None and estimate_mfu is None:
        try:
            if isinstance(compile_report, str):
                compile_report = fs.read_json(compile_report, "a python -m jaxpt.tools.compile --json report")
            report = compile_report or compiled_step_report(workdir)
            estimate, how = compiled_estimate(records, report, cfg.expected_flops_utilization)
        except (ConfigError, OSError, ValueError) as e:
            how = f"no estimate from the compiled step: {e}"
    throughput = check_throughput(records, workdir, cfg, estimate)
    if how:
        throughput.reason = "; ".join(x for x in (throughput.reason, how) if x)
    return [check_loss_smooth(records, cfg), check_spikes(records, cfg), check_grad_norm(records, cfg),
            throughput, check_checkpoint_restore(everything, workdir, cfg), check_heldout(records, cfg)]


def passed(criteria: list[Criterion], strict: bool = False) -> bool:
    """True when no criterion failed (and, with ``strict``, every one was judged)."""
    bad = (FAIL, NOT_JUDGED) if strict else (FAIL,)
    return not any(c.verdict in bad for c in criteria)


def format_report(criteria: list[Criterion], extra: list[str] = ()) -> str:
    """A plain-text table of the criteria, then each failure's reason."""
    rows = [[c.name, c.measured, c.threshold, c.verdict] for c in criteria]
    lines = [table(rows, ["criterion", "measured", "threshold", "verdict"])]
    lines += [f"{c.name}: {c.reason}" for c in criteria if c.reason]
    return "\n".join(lines + list(extra))


def interval_note(workdir: str, mtbf_hours: float, save_s: float | None) -> tuple[dict | None, str]:
    """The Young/Daly checkpoint interval (:func:`jaxpt.lab.plan.checkpoint_plan`) for this run: save time
    ``save_s`` or the run's measured mean checkpoint blocking time (run.json goodput), its median step time and
    configured save interval. ``(None, why)`` when the save time is unknown."""
    run = _run_json(workdir)
    records = monitor.read_metrics(workdir)
    if save_s is None:
        gp = [s.get("goodput", {}) for s in run.get("sessions", [])]
        saves = sum(g.get("checkpoint_saves", 0) for g in gp)
        save_s = sum(g.get("checkpoint_s", 0.0) for g in gp) / saves if saves else None
    if not save_s:
        return None, "checkpoint interval: no measured save time; pass --save-seconds"
    step_s = _median([r.get("step_time_s") for r in step_records(records)])
    every = _gin_value(workdir, "CheckpointConfig.save_every_steps")
    every = int(every) if every else None
    p = plan.checkpoint_plan(mtbf_hours, save_s, 0.0, step_s, every)
    return p, plan.format_checkpoint_plan(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxpt.tools.gate", description=__doc__.splitlines()[0])
    ap.add_argument("workdir")
    ap.add_argument("--estimate-tokens-per-sec", type=float, help="expected tokens/s for this config and slice")
    ap.add_argument("--estimate-mfu", type=float,
                    help="expected MFU; the estimate is MFU x the run's peak FLOP/s x devices / FLOPs per token")
    ap.add_argument("--compile-report", metavar="JSON",
                    help="`python -m jaxpt.tools.compile --json` output for the run's target: the estimate from its "
                         "compiled FLOPs (default: the run's config compiled on this host)")
    ap.add_argument("--mtbf-hours", type=float, help="also recommend the checkpoint interval (Young/Daly)")
    ap.add_argument("--save-seconds", type=float, help="save time for --mtbf-hours (default: measured)")
    ap.add_argument("--gin", action="append", default=[], metavar="BINDING",
                    help="threshold override, e.g. 'GateConfig.rise_tolerance = 0.05'; may repeat")
    ap.add_argument("--strict", action="store_true", help="a criterion that could not be judged fails the gate")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        cfg = parse_gate_config(args.gin)
        criteria = judge(args.workdir, cfg, args.estimate_tokens_per_sec, args.estimate_mfu, args.compile_report)
        interval, note = (None, "")
        if args.mtbf_hours is not None:
            interval, note = interval_note(args.workdir, args.mtbf_hours, args.save_seconds)
    except FileNotFoundError as e:
        return report_cli_error(f"{args.workdir} is not a run directory with metrics (python -m jaxpt.train writes "
                                f"metrics.jsonl there): {e}", args.json)
    except (ConfigError, ValueError) as e:
        return report_cli_error(str(e), args.json)
    ok = passed(criteria, args.strict)
    if args.json:
        print(json.dumps({"passed": ok, "criteria": [dataclasses.asdict(c) for c in criteria],
                          **({"checkpoint_interval": interval} if interval else {})}, indent=1))
    else:
        print(format_report(criteria, [note] if note else []))
        print(f"gate: {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


def parse_gate_config(bindings: list[str]) -> GateConfig:
    """A :class:`GateConfig` from ``'GateConfig.field = value'`` bindings (values as Python literals).

    Raises:
      ConfigError: a binding not of that form, an unknown field, or a value the field refuses.
    """
    import ast
    fields = {f.name for f in dataclasses.fields(GateConfig)}
    values = {}
    for b in bindings:
        key, sep, value = b.partition("=")
        key = key.strip()
        if not sep or not key.startswith("GateConfig.") or key.split(".", 1)[1] not in fields:
            raise ConfigError(f"--gin {b!r}: expected 'GateConfig.<field> = <value>' with a field among "
                              f"{', '.join(sorted(fields))}")
        try:
            values[key.split(".", 1)[1]] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ConfigError(f"--gin {b!r}: the value is not a Python literal") from None
    return GateConfig(**values)


if __name__ == "__main__":
    sys.exit(main())
