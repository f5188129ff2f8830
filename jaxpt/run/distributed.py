"""Multi-controller start-up: one process per host, joined through ``jax.distributed``.

Called from ``jaxpt.train``'s ``main`` (never from the config loader), before anything touches devices.

Decision (:func:`decide`, logged by :func:`log_startup` as ``distributed: <mode> via <how>``):
  1. explicit flags ``--coordinator-address HOST:PORT --num-processes N --process-id I`` (all three, or
     none): ``jax.distributed.initialize`` with them;
  2. ``JAXPT_DISTRIBUTED=off``: a single process, whatever the environment says (an escape hatch for running
     one process inside a multi-task allocation);
  3. JAX's own cluster auto-detection (``jax._src.clusters``, the detectors ``jax.distributed.initialize()``
     runs when given no arguments): GCE TPU VMs (worker list from the metadata server, queried only when TPU
     chips are attached to this VM), GKE TPU pods (``TPU_WORKER_HOSTNAMES`` / ``TPU_PROCESS_ADDRESSES``),
     SLURM (``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``),
     Open MPI (``OMPI_MCA_orte_hnp_uri``), Kubernetes (with the ``kubernetes`` package). When one is present
     and reports more than one process, ``jax.distributed.initialize()`` is called with no arguments so JAX
     finds coordinator, process count and id itself; a detected cluster of one process is not initialized;
  4. otherwise a single process, no initialization. On a host with no cluster environment the detectors
     read only environment variables and ``/sys/bus/pci`` (no network), so a CPU run never waits here.

On CPU the gloo collectives are selected (``jax_cpu_collectives_implementation``), so the same code runs
across local processes for tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

import jax

from jaxpt.util import cli

log = logging.getLogger("jaxpt.run.distributed")

#: Seconds a process waits for the others at start-up and for a missing peer before failing.
DEFAULT_TIMEOUT_S = 120


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The multi-process start-up flags of ``jaxpt.train`` (the snake_case spellings: deprecated aliases)."""
    cli.add_flag(parser, "--coordinator-address", "--coordinator_address",
                 help="HOST:PORT of process 0 (explicit multi-process start)")
    cli.add_flag(parser, "--num-processes", "--num_processes", type=int, help="number of processes (explicit start)")
    cli.add_flag(parser, "--process-id", "--process_id", type=int, help="index of this process (explicit start)")
    cli.add_flag(parser, "--distributed-timeout-s", "--distributed_timeout_s", type=int, default=DEFAULT_TIMEOUT_S,
                 help="seconds to wait for peers at start-up and heartbeats before failing")


#: ``JAXPT_DISTRIBUTED`` values that force a single process.
_OFF = ("0", "off", "false", "no", "single")


@dataclasses.dataclass(frozen=True)
class Decision:
    """How this process starts. ``mode``: ``explicit``, ``auto`` or ``single``; ``how``: what decided it (the
    flags, JAX's detector class name such as ``SlurmCluster``, or why nothing was initialized);
    ``process_count``: the count the flags or the detector report (None when unknown)."""

    mode: str
    how: str
    process_count: int | None = None


def jax_cluster_env():
    """The JAX cluster detector (a ``jax._src.clusters.ClusterEnv`` subclass) whose environment is present, in
    JAX's own order, skipping opt-in-only ones (mpi4py) exactly as ``jax.distributed.initialize()`` does; None
    when there is none or when this jax no longer has that module (then :func:`decide` says so and runs one
    process, and explicit flags still work)."""
    try:
        from jax._src import clusters  # pylint: disable=g-import-not-at-top
        types = list(clusters.ClusterEnv._cluster_types)  # pylint: disable=protected-access
    except (ImportError, AttributeError) as e:
        log.warning("JAX's cluster detectors are not importable (%s); pass the explicit flags on a cluster", e)
        return None
    return next((env for env in types if not getattr(env, "opt_in_only_method", False) and env.is_env_present()),
                None)


def decide(args: argparse.Namespace | None = None, env: dict | None = None) -> Decision:
    """The start-up path (module docstring) for these flags and environment ``env`` (default ``os.environ``;
    JAX's detectors always read ``os.environ``).

    Raises:
      ValueError: explicit flags given only in part.
    """
    env = os.environ if env is None else env
    explicit = [getattr(args, k, None) for k in ("coordinator_address", "num_processes", "process_id")]
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise ValueError("--coordinator-address, --num-processes and --process-id go together")
        return Decision("explicit", "--coordinator-address/--num-processes/--process-id", explicit[1])
    if env.get("JAXPT_DISTRIBUTED", "").strip().lower() in _OFF:
        return Decision("single", "JAXPT_DISTRIBUTED=" + env["JAXPT_DISTRIBUTED"], 1)
    cluster = jax_cluster_env()
    if cluster is None:
        return Decision("single", "no cluster environment detected", 1)
    count = cluster.get_process_count()
    if count <= 1:
        return Decision("single", f"{cluster.__name__} reports 1 process", 1)
    return Decision("auto", cluster.__name__, count)


def _use_gloo_on_cpu() -> None:
    # Must be set before the backend starts; harmless on accelerators (only the CPU client reads it).
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError) as e:  # very old or very new jax: say so, continue
        log.warning("could not select gloo CPU collectives: %s", e)


def initialize(args: argparse.Namespace | None = None) -> dict:
    """Join the job's processes if there are several (:func:`decide`). Returns ``{"mode", "how",
    "process_index", "process_count"}`` for :func:`log_startup` (logging is not set up yet when this runs).

    Raises:
      ValueError: explicit flags given only in part.
      RuntimeError: (from JAX) the coordinator cannot be reached within the timeout.
    """
    decision = decide(args)
    timeout = getattr(args, "distributed_timeout_s", DEFAULT_TIMEOUT_S) if args else DEFAULT_TIMEOUT_S
    if decision.mode == "explicit":
        _use_gloo_on_cpu()
        jax.distributed.initialize(coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=timeout,
                                   heartbeat_timeout_seconds=timeout)
    elif decision.mode == "auto":
        _use_gloo_on_cpu()
        jax.distributed.initialize(initialization_timeout=timeout, heartbeat_timeout_seconds=timeout)
    else:
        return {"mode": "single", "how": decision.how, "process_index": 0, "process_count": 1}
    return {"mode": decision.mode, "how": decision.how, "process_index": jax.process_index(),
            "process_count": jax.process_count()}


def log_startup(info: dict) -> None:
    """Logs (INFO, ``jaxpt.run.distributed``) which start-up path :func:`initialize` took."""
    log.info("distributed: %s via %s (process %d of %d)", info["mode"], info["how"], info["process_index"],
             info["process_count"])
