"""Multi-controller start-up: one process per host, joined through ``jax.distributed``.

Called from ``jaxpt.train``'s ``main`` (never from the config loader), before anything touches devices.

Detection order:
  1. explicit flags ``--coordinator_address HOST:PORT --num_processes N --process_id I``;
  2. a cluster environment JAX recognizes on its own (``jax.distributed.initialize()`` with no arguments):
     TPU VMs (``TPU_WORKER_HOSTNAMES`` / the metadata server, also under GKE), SLURM (``SLURM_JOB_ID`` with
     ``SLURM_NTASKS`` > 1), Open MPI (``OMPI_COMM_WORLD_SIZE`` > 1), Kubernetes JobSets
     (``JOBSET_NAME`` with ``JAX_PROCESS_COUNT``/indexed jobs) -- only when the environment says there is
     more than one process;
  3. otherwise a single process, no initialization.

On CPU the gloo collectives are selected (``jax_cpu_collectives_implementation``), so the same code runs
across local processes for tests.
"""

from __future__ import annotations

import argparse
import logging
import os

import jax

log = logging.getLogger("jaxpt.distributed")

#: Seconds a process waits for the others at start-up and for a missing peer before failing.
DEFAULT_TIMEOUT_S = 120


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator_address", help="HOST:PORT of process 0 (explicit multi-process start)")
    parser.add_argument("--num_processes", type=int, help="number of processes (explicit start)")
    parser.add_argument("--process_id", type=int, help="index of this process (explicit start)")
    parser.add_argument("--distributed_timeout_s", type=int, default=DEFAULT_TIMEOUT_S,
                        help="seconds to wait for peers at start-up and heartbeats before failing")


def detected_cluster() -> str | None:
    """The multi-process environment this process runs in, or None for a single process."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in env:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "openmpi"
    if env.get("TPU_WORKER_HOSTNAMES") and len(env["TPU_WORKER_HOSTNAMES"].split(",")) > 1:
        return "tpu"
    if env.get("JOBSET_NAME") and int(env.get("JAX_PROCESS_COUNT", "1") or 1) > 1:
        return "kubernetes"
    return None


def _use_gloo_on_cpu() -> None:
    # Must be set before the backend starts; harmless on accelerators (only the CPU client reads it).
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError) as e:  # very old or very new jax: say so, continue
        log.warning("could not select gloo CPU collectives: %s", e)


def initialize(args: argparse.Namespace | None = None) -> dict:
    """Join the job's processes if there are several. Returns ``{"mode", "process_index", "process_count"}``.

    Raises:
      ValueError: explicit flags given only in part.
      RuntimeError: (from JAX) the coordinator cannot be reached within the timeout.
    """
    explicit = [getattr(args, k, None) for k in ("coordinator_address", "num_processes", "process_id")]
    timeout = getattr(args, "distributed_timeout_s", DEFAULT_TIMEOUT_S) if args else DEFAULT_TIMEOUT_S
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise ValueError("--coordinator_address, --num_processes and --process_id go together")
        _use_gloo_on_cpu()
        addr, n, i = explicit
        jax.distributed.initialize(coordinator_address=addr, num_processes=n, process_id=i,
                                   initialization_timeout=timeout, heartbeat_timeout_seconds=timeout)
        mode = "explicit"
    elif (cluster := detected_cluster()) is not None:
        _use_gloo_on_cpu()
        jax.distributed.initialize(initialization_timeout=timeout)
        mode = cluster
    else:
        return {"mode": "single", "process_index": 0, "process_count": 1}
    info = {"mode": mode, "process_index": jax.process_index(), "process_count": jax.process_count()}
    log.info("distributed: %s", info)
    return info
