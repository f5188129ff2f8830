"""The test tiers: ``unit``, ``integration`` and ``corpus``, each a pytest marker set at collection.

- ``corpus``: needs all of raw-v1 (the ``raw_v1_dir`` fixture or the ``raw_v1`` marker).
- ``integration``: marked ``integration`` or ``slow`` (trains, starts processes, converts, compiles for TPU), or
  using a fixture of :data:`INTEGRATION_FIXTURES` (one that trains a run, builds a corpus or starts a server).
- ``unit``: every other test. A unit test whose fixtures' setup trains or starts a process fails, naming them (add
  the fixture to :data:`INTEGRATION_FIXTURES`). A unit test that starts a child process (``git`` aside), enters the training loop, or whose call
  phase uses over :data:`UNIT_LIMIT_S` CPU-seconds (all threads of the process: another xdist worker's load does
  not count) or six times that in seconds of wall time fails, its message saying which: the tier stays a
  few minutes.

``make test-unit`` / ``test-integration`` / ``test-corpus`` select one (``-m unit``, ...); ``make test`` runs all and
the terminal summary prints each tier's count and seconds and the slowest tests. ``JAXPT_TIER_LOG=path`` appends one
JSON line per test (its tier, phase seconds, child processes and training loops seen) for the tier table of
docs/results.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest

TIERS = ("unit", "integration", "corpus")
#: The most CPU-seconds a unit test's call phase may use, setup and teardown apart (a session fixture's build is
#: charged to the first test that asks for it); ``JAXPT_UNIT_LIMIT_S`` overrides it, 0 turns both checks off.
UNIT_LIMIT_S = float(os.environ.get("JAXPT_UNIT_LIMIT_S", "5"))
#: The most wall seconds of a unit test's call phase, as a multiple of :data:`UNIT_LIMIT_S` (waits and sleeps,
#: which use no CPU, count here).
WALL_FACTOR = 6
SLOWEST = 30
#: Fixtures whose setup trains a run, builds a corpus on Beam, converts a model or starts a server: a test that
#: uses one is an integration test, whatever its own call does.
INTEGRATION_FIXTURES = frozenset({
    "base",         # test_continued_pretraining: a converted Hugging Face Llama
    "built",        # test_corpus_grain, test_corpus_paragraph_dedup: a corpus version built on Beam
    "carded",       # test_mixtures: a mixture experiment's proxy runs
    "corpus",       # test_corpus_pipeline, test_mixtures: a corpus version built on Beam
    "eval_run",     # test_eval_checkpoint: a trained run
    "gcs",          # test_object_storage: a local object-storage server process
    "parent",       # test_stage_data: a trained parent run
    "parent_run",   # test_stage: a trained parent run
    "planted",      # test_mixtures: a mixture experiment's proxy runs
    "reference30",  # test_checkpoint: an uninterrupted 30-step run
    "run6",         # test_edges: a trained run
    "runs",         # test_zero: train steps under each ZeRO switch
    "short_run",    # test_behaviour_goldens: a trained run
    "tiny_run",     # test_conclusions: a trained run
    "trained10",    # test_checkpoint: a trained run
})


def tier_of(item) -> str:
    """The tier of a collected test item."""
    if item.get_closest_marker("raw_v1") or "raw_v1_dir" in getattr(item, "fixturenames", ()):
        return "corpus"
    if item.get_closest_marker("integration") or item.get_closest_marker("slow"):
        return "integration"
    if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
        return "integration"
    return "unit"


def mark_tiers(items) -> None:
    """Adds each item's tier as a marker (so ``-m unit`` selects it) and records it in its user properties."""
    for item in items:
        tier = tier_of(item)
        if not item.get_closest_marker(tier):
            item.add_marker(tier)
        item.user_properties.append(("tier", tier))


class _Seen:
    """What one test did that the unit tier refuses: child processes started, training loops entered."""

    def __init__(self):
        self.children: list[str] = []
        self.loops = 0
        self.cpu_s = 0.0


_STACK: list[_Seen] = []  # one entry per test call in progress (a test that runs pytest in-process nests one)
_POPEN_INIT = subprocess.Popen.__init__
#: Programs a unit test may start: ``git`` answers in milliseconds and loads no jax (the docs checks ask it what
#: is tracked and at which commit).
ALLOWED_CHILDREN = ("git",)


def _popen_init(self, args, *a, **k):
    line = args if isinstance(args, str) else " ".join(map(str, args))
    if _STACK and line.split(" ", 1)[0].rsplit("/", 1)[-1] not in ALLOWED_CHILDREN:
        _STACK[-1].children.append(line[:160])
    _POPEN_INIT(self, args, *a, **k)


def _watch_training_loop() -> None:
    """Counts entries to jaxpt's training loop (both names it is called by), once jaxpt.run is imported."""
    for name in ("jaxpt.run.loop", "jaxpt.run.session"):
        module = sys.modules.get(name)
        original = getattr(module, "train_loop", None)
        if original is None or getattr(original, "_tier_watch", False):
            continue

        def watched(*a, _original=original, **k):
            if _STACK:
                _STACK[-1].loops += 1
            return _original(*a, **k)

        watched._tier_watch = True
        setattr(module, "train_loop", watched)


@contextlib.contextmanager
def _watching():
    """Yields the :class:`_Seen` of the phase it wraps: child processes, training loops and CPU-seconds."""
    _watch_training_loop()
    seen = _Seen()
    _STACK.append(seen)
    subprocess.Popen.__init__ = _popen_init
    cpu = time.process_time()
    try:
        yield seen
    finally:
        seen.cpu_s = time.process_time() - cpu
        _STACK.pop()
        if not _STACK:
            subprocess.Popen.__init__ = _POPEN_INIT


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Watches the fixtures' setup for training loops and child processes (their CPU is not charged: a session
    fixture is built once for many tests)."""
    with _watching() as item._tier_setup_seen:
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _watching() as item._tier_seen:
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call":
        return
    seen = getattr(item, "_tier_seen", None) or _Seen()
    tier = dict(item.user_properties).get("tier", "unit")
    report.user_properties = [*report.user_properties, ("children", len(seen.children)), ("loops", seen.loops)]
    problems = []
    setup = getattr(item, "_tier_setup_seen", None) or _Seen()
    if tier == "unit" and report.passed and (setup.children or setup.loops):
        fixtures = sorted(set(item.fixturenames) - {"request", "tmp_path", "tmp_path_factory", "monkeypatch",
                                                      "worker_id", "compilation_cache", "capsys", "caplog"})
        problems.append(f"uses a fixture whose setup {'trained' if setup.loops else 'started a process'} (one of "
                        f"{', '.join(fixtures)}: add it to INTEGRATION_FIXTURES)")
    if tier == "unit" and report.passed:
        if seen.children:
            problems.append(f"started {len(seen.children)} child process(es), first: {seen.children[0]!r}")
        if seen.loops:
            problems.append(f"entered the training loop {seen.loops} time(s)")
        if UNIT_LIMIT_S and seen.cpu_s > UNIT_LIMIT_S:
            problems.append(f"used {seen.cpu_s:.1f} CPU-s (the unit tier's limit is {UNIT_LIMIT_S:g})")
        elif UNIT_LIMIT_S and call.duration > WALL_FACTOR * UNIT_LIMIT_S:
            problems.append(f"took {call.duration:.1f} s (the unit tier's wall limit is "
                            f"{WALL_FACTOR * UNIT_LIMIT_S:g} s)")
    if problems:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: a unit-tier test that " + "; ".join(problems) +
                           ". Make it cheaper, or mark it `integration` (tests/tiers.py).")
    log = os.environ.get("JAXPT_TIER_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "tier": tier, "call_s": round(call.duration, 3),
                                "cpu_s": round(seen.cpu_s, 3),
                                "children": len(seen.children), "loops": seen.loops,
                                "outcome": report.outcome, "time": time.time()}) + "\n")


def terminal_summary(terminalreporter) -> None:
    """Prints each tier's test count and summed seconds (setup + call + teardown) and the slowest tests."""
    per_test: dict[str, list] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) not in ("setup", "call", "teardown"):
                continue
            tier = dict(getattr(r, "user_properties", ())).get("tier")
            entry = per_test.setdefault(r.nodeid, [None, 0.0])
            entry[0] = entry[0] or tier
            entry[1] += r.duration
    if not per_test:
        return
    write = terminalreporter.write_line
    terminalreporter.section("tiers")
    for tier in TIERS:
        times = [s for t, s in per_test.values() if t == tier]
        write(f"{tier:<12} {len(times):>5} tests {sum(times):>9.1f} s")
    write(f"{'all':<12} {len(per_test):>5} tests {sum(s for _, s in per_test.values()):>9.1f} s "
          "(summed over workers: the wall time is about this over the worker count)")
    terminalreporter.section(f"{SLOWEST} slowest tests (setup + call + teardown)")
    for nodeid, (tier, s) in sorted(per_test.items(), key=lambda kv: -kv[1][1])[:SLOWEST]:
        write(f"{s:>8.1f} s  {tier or '?':<12} {nodeid}")
