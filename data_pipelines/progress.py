"""Progress of a corpus build: documents read, kept, held out and dropped so far, their rate, and the ETA of reading.

The stages count into process-wide counters (:func:`count`, called by the DoFns) and into Beam metrics counters
of the namespace ``corpus_build`` (shown by the runner's own monitoring, e.g. the Dataflow console). While the
pipeline runs, :class:`BuildProgress` (the launcher's) reports the counters with `jaxpt.util.progress`'s conventions:
a tqdm bar over the input files on a terminal; otherwise one plain line every ``JAXPT_PROGRESS_EVERY_S`` seconds
(default 30) from a background thread, and one at the end:

    corpus build: 3/10 input files (30.0%), 12000 documents read (400 documents/s), 9000 kept, 50 held out,
    2950 dropped, elapsed 0:00:30, ETA of reading 0:01:10

``ETA of reading = files left / (files read / elapsed)``; the stages after reading (dedup, quality, shards) have no
known total, so once every file is read the line says ``reading done`` instead. ``JAXPT_PROGRESS=off`` silences it.

The counters are those of this process, so the lines cover the DirectRunner (which runs every DoFn in the
launcher's process, the default ``in_memory`` mode); with a distributed runner each worker counts its own, and
the Beam metrics counters are the place to watch.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from typing import Callable, TextIO

from jaxpt.util import progress as progress_lib

NAMESPACE = "corpus_build"
#: The counters, in line order: input files done, documents read (admission drops included), documents kept
#: (written to the training shards), held out, dropped (by any stage).
KINDS = ("files", "read", "kept", "heldout", "dropped")

_lock = threading.Lock()
_counts = dict.fromkeys(KINDS, 0)
_metrics: dict = {}


def count(kind: str, k: int = 1) -> None:
    """Adds ``k`` to the process-wide counter ``kind`` (one of :data:`KINDS`) and to the Beam metrics counter
    ``corpus_build/<kind>``.

    Raises:
      KeyError: an unknown kind.
    """
    with _lock:
        _counts[kind] += k
        metric = _metrics.get(kind)
        if metric is None:
            from apache_beam.metrics import Metrics
            metric = _metrics[kind] = Metrics.counter(NAMESPACE, kind)
    metric.inc(k)


def snapshot() -> dict[str, int]:
    """The process-wide counters now (a copy)."""
    with _lock:
        return dict(_counts)


def reset() -> None:
    """Sets every process-wide counter to zero (a build starts from zero)."""
    with _lock:
        for k in KINDS:
            _counts[k] = 0


def format_line(counts: dict[str, int], total_files: int, elapsed_s: float) -> str:
    """The progress line (module docstring) for ``counts`` after ``elapsed_s`` seconds of ``total_files`` inputs."""
    files, read = counts["files"], counts["read"]
    rate = read / elapsed_s if elapsed_s > 0 else float("nan")
    rate_s = f"{rate:.3g} documents/s" if math.isfinite(rate) else "? documents/s"
    pct = f" ({100.0 * files / total_files:.1f}%)" if total_files else ""
    if total_files and files >= total_files:
        eta = "reading done"
    else:
        files_rate = files / elapsed_s if elapsed_s > 0 else 0.0
        eta = "ETA of reading " + progress_lib.format_duration(
            (total_files - files) / files_rate if files_rate > 0 else float("nan"))
    return (f"corpus build: {files}/{total_files} input files{pct}, {read} documents read ({rate_s}), "
            f"{counts['kept']} kept, {counts['heldout']} held out, {counts['dropped']} dropped, "
            f"elapsed {progress_lib.format_duration(elapsed_s)}, {eta}")


class BuildProgress:
    """Reports the process-wide counters while a build runs (module docstring); a context manager.

    Args:
      total_files: input files (or TFDS sources) the build reads.
      stream: where reports go (default ``sys.stderr``).
      every_s: seconds between lines (default ``JAXPT_PROGRESS_EVERY_S`` or 30).
      mode: ``bar``, ``lines`` or ``off`` (default: ``jaxpt.util.progress.choose_mode(stream)``).
      clock: seconds, monotonic.

    Raises:
      ValueError: an unknown mode or ``JAXPT_PROGRESS`` value.
    """

    def __init__(self, total_files: int, *, stream: TextIO | None = None, every_s: float | None = None,
                 mode: str | None = None, clock: Callable[[], float] = time.monotonic):
        self.total_files = total_files
        self.stream = sys.stderr if stream is None else stream
        self.every_s = float(os.environ.get("JAXPT_PROGRESS_EVERY_S", progress_lib.DEFAULT_EVERY_S)) \
            if every_s is None else every_s
        self.mode = progress_lib.choose_mode(self.stream) if mode is None else mode
        if self.mode not in progress_lib.MODES:
            raise ValueError(f"progress mode {self.mode!r}: choose one of {progress_lib.MODES}")
        self.clock = clock
        self._stop = threading.Event()
        self._thread = None
        self._bar = None

    def line(self) -> str:
        """The line for the counters now."""
        return format_line(snapshot(), self.total_files, self.clock() - self._start)

    def _report(self) -> None:
        if self._bar is not None:
            c = snapshot()
            self._bar.n = c["files"]
            self._bar.set_postfix_str(f"{c['read']} read, {c['kept']} kept, {c['heldout']} held out, "
                                      f"{c['dropped']} dropped", refresh=True)
        else:
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def _loop(self) -> None:
        interval = self.every_s if self._bar is None else min(self.every_s, 1.0)
        while not self._stop.wait(interval):
            self._report()

    def __enter__(self) -> "BuildProgress":
        reset()
        self._start = self.clock()
        if self.mode == "off":
            return self
        if self.mode == "bar":
            from tqdm import tqdm
            self._bar = tqdm(total=self.total_files, desc="corpus build", unit="files", file=self.stream,
                             dynamic_ncols=True)
        self._thread = threading.Thread(target=self._loop, name="corpus-build-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._report()  # the final line (or the bar's final state)
        if self._bar is not None:
            self._bar.close()
