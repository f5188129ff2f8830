"""Progress of long work (evaluation, scoring, corpus builds): a bar on a terminal, periodic lines elsewhere.

A tqdm bar redraws with carriage returns, which fill a log file with one unreadable line; so when the stream is
not a terminal, :class:`Progress` writes instead one plain line every ``every_s`` seconds (and one at the end):

    heldout: 120/480 batches (25.0%), 3.1 batches/s, elapsed 0:00:39, ETA 0:01:56

``JAXPT_PROGRESS`` overrides the choice: ``bar``, ``lines`` or ``off``; ``JAXPT_PROGRESS_EVERY_S`` the line
interval (seconds, default 30).

:func:`quiet_startup` sets the environment variables that silence TensorFlow, gRPC, libtpu and CUDA start-up
banners (only where the user has not set them) and turns Beam's and absl's INFO logging down to WARNING.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Callable, Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")

#: Seconds between periodic lines when not on a terminal (``JAXPT_PROGRESS_EVERY_S`` overrides).
DEFAULT_EVERY_S = 30.0
#: The progress modes: a tqdm bar, plain periodic lines, or nothing.
MODES = ("bar", "lines", "off")


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` of a non-negative duration in seconds; ``?`` when not finite."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def choose_mode(stream: TextIO) -> str:
    """``bar`` when ``stream`` is a terminal, else ``lines``; ``JAXPT_PROGRESS`` (bar, lines, off) overrides."""
    forced = os.environ.get("JAXPT_PROGRESS", "").strip().lower()
    if forced:
        if forced not in MODES:
            raise ValueError(f"JAXPT_PROGRESS = {forced!r}: choose one of {MODES}")
        return forced
    isatty = getattr(stream, "isatty", None)
    return "bar" if isatty is not None and isatty() else "lines"


class Progress:
    """Counts units of work toward ``total`` and reports them (module docstring).

    Args:
      total: units expected (None when unknown: lines then give count and rate, no percentage or ETA).
      desc: what is being done (the line's prefix).
      unit: the unit's name, plural (``batches``, ``windows``, ``documents``).
      stream: where reports go (default ``sys.stderr``); a bar only when it is a terminal.
      every_s: seconds between lines (default ``JAXPT_PROGRESS_EVERY_S`` or 30).
      clock: seconds, monotonic (tests pass a fake).
      mode: ``bar``, ``lines`` or ``off``; default from ``JAXPT_PROGRESS``, else the stream.
      initial: units already done before this process started (a resumed run's step): counted in ``n`` and the
        percentage, not in the rate.

    ETA is ``(total - n) / rate`` with ``rate = (n - initial) / elapsed`` over this process so far.

    Raises:
      ValueError: an unknown mode or a ``JAXPT_PROGRESS`` value not in ``bar, lines, off``.
    """

    def __init__(self, total: int | None, desc: str, unit: str = "items", *, stream: TextIO | None = None,
                 every_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 mode: str | None = None, initial: int = 0):
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = sys.stderr if stream is None else stream
        self.every_s = float(os.environ.get("JAXPT_PROGRESS_EVERY_S", DEFAULT_EVERY_S)) if every_s is None \
            else every_s
        self.clock = clock
        self.mode = choose_mode(self.stream) if mode is None else mode
        if self.mode not in MODES:
            raise ValueError(f"progress mode {self.mode!r}: choose one of {MODES}")
        self.n = self.initial = initial
        self.postfix = ""
        self._start = self._last = clock()
        self._closed = False
        self._bar = None
        if self.mode == "bar":
            from tqdm import tqdm  # pylint: disable=g-import-not-at-top
            self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True,
                             initial=initial)

    def line(self) -> str:
        """The periodic line for the current count (module docstring)."""
        elapsed = self.clock() - self._start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else float("nan")
        head = f"{self.desc}: {self.n}"
        if self.total:
            eta = (self.total - self.n) / rate if rate > 0 else float("nan")
            head += f"/{self.total} {self.unit} ({100.0 * self.n / self.total:.1f}%)"
            tail = f", elapsed {format_duration(elapsed)}, ETA {format_duration(eta)}"
        else:
            head += f" {self.unit}"
            tail = f", elapsed {format_duration(elapsed)}"
        rate_s = f"{rate:.3g} {self.unit}/s" if math.isfinite(rate) else f"? {self.unit}/s"
        return f"{head}, {rate_s}{tail}" + (f", {self.postfix}" if self.postfix else "")

    def set_postfix(self, **values: str) -> None:
        """Shown after the count: on the bar, and at the end of each line (``loss 3.141``)."""
        if self._bar is not None:
            self._bar.set_postfix(**values)
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def update(self, k: int = 1) -> None:
        """``k`` more units done; writes a line if ``every_s`` passed since the last one (lines mode)."""
        self.n += k
        if self._bar is not None:
            self._bar.update(k)
        elif self.mode == "lines" and self.clock() - self._last >= self.every_s:
            self._write()

    def _write(self) -> None:
        self._last = self.clock()
        self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Ends the bar, or writes the final line (lines mode). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "lines":
            self._write()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Phase:
    """A long step of unknown length (a compile, a lowering) reported as it goes: a line when it starts, a heartbeat
    line every ``every_s`` seconds while it runs (from a background thread), and a line with its time when it ends.

        with Phase("compiling the train step for v5p:4x4x4 (64 chips)"):
            compiled = lowered.compile()

    prints ``compiling the train step for v5p:4x4x4 (64 chips) ...``, then ``... still compiling (0:00:30)`` and
    ``... done in 0:01:12``. Silent under ``JAXPT_PROGRESS=off``; ``every_s`` defaults to ``JAXPT_PROGRESS_EVERY_S``
    or 30. ``seconds`` holds the phase's wall time (seconds) once it ended.
    """

    def __init__(self, desc: str, *, stream: TextIO | None = None, every_s: float | None = None):
        self.desc, self.stream = desc, stream if stream is not None else sys.stderr
        self.every_s = every_s if every_s is not None else float(os.environ.get("JAXPT_PROGRESS_EVERY_S",
                                                                               DEFAULT_EVERY_S))
        self.quiet = choose_mode(self.stream) == "off"
        self.seconds = 0.0

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def __enter__(self) -> "Phase":
        import threading
        self._t0, self._stop = time.perf_counter(), threading.Event()
        verb = self.desc.split()[0]
        self._say(f"{self.desc} ...")

        def beat():
            while not self._stop.wait(self.every_s):
                self._say(f"... still {verb} ({format_duration(time.perf_counter() - self._t0)})")

        self._thread = threading.Thread(target=beat, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._t0
        if exc[0] is None:
            self._say(f"... done in {format_duration(self.seconds)}")


def track(items: Iterable[T], desc: str, unit: str = "items", total: int | None = None, **kw) -> Iterator[T]:
    """Yields ``items``, reporting progress (one unit per item; ``total`` defaults to ``len(items)``)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(total, desc, unit, **kw) as p:
        for x in items:
            yield x
            p.update()


#: Environment variables set (if unset) by :func:`quiet_startup`, and why.
QUIET_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",   # TensorFlow C++ INFO/WARNING banners (oneDNN, CUDA plugin, cpu features)
    "GRPC_VERBOSITY": "ERROR",     # gRPC fork/absl warnings (TensorFlow, Beam)
    "TPU_MIN_LOG_LEVEL": "2",      # libtpu INFO/WARNING start-up lines
    "TPU_STDERR_LOG_LEVEL": "2",
}


def quiet_startup() -> None:
    """Silences third-party start-up noise unless ``JAXPT_VERBOSE_STARTUP=1`` (module docstring). Must run
    before TensorFlow or libtpu initialize; an explicitly set variable is never changed."""
    if os.environ.get("JAXPT_VERBOSE_STARTUP", "").strip() in ("1", "true", "yes"):
        return
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    for name in ("apache_beam", "absl", "tensorflow"):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET or logger.level < logging.WARNING:
            logger.setLevel(logging.WARNING)
