"""Preemption: SIGTERM (or the runtime's preemption sync point) becomes "save after this step and exit 75"."""

from __future__ import annotations

import logging
import signal

import jax

log = logging.getLogger("jaxpt.train")


class Preemption:
    """Turns SIGTERM into a flag the loop checks between steps (finish the step, save, exit).

    On TPU, Orbax/JAX's preemption sync point (``multihost_utils.reached_preemption_sync_point``) is also
    consulted when the distributed runtime provides it, so every process stops at the same step.
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        def handler(signum, frame):
            self.requested = True
            log.warning("signal %d received: will save after the current step and exit", signum)
        self._previous = signal.signal(signal.SIGTERM, handler)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self._previous)

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            try:
                from jax.experimental import multihost_utils
                if multihost_utils.reached_preemption_sync_point(step):
                    return True
            except Exception:  # no preemption service (e.g. CPU/gloo): fall back to the signal flag
                pass
        return self.requested


class Preempted(Exception):
    """Raised by the loop after a preemption checkpoint committed; ``main`` exits with
    :data:`PREEMPTED_EXIT_CODE`."""


#: Exit status after a clean preemption (EX_TEMPFAIL: "try again later"); schedulers can requeue on it.
PREEMPTED_EXIT_CODE = 75
