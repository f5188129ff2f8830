"""jaxpt.run.distributed: which start-up path a process takes, decided by flags and cluster environment variables.

No real cluster: the environment is set with monkeypatch and ``jax.distributed.initialize`` is replaced by a
recorder, so each test checks the decision and the exact call JAX would receive.
"""

import argparse
import os

import jax
import pytest

from jaxpt.run import distributed

_CLUSTER_VARS = ("SLURM_", "OMPI_", "TPU_WORKER_", "TPU_PROCESS_", "MEGASCALE_", "KUBERNETES_SERVICE_HOST",
                 "JAXPT_DISTRIBUTED")


@pytest.fixture
def clean_env(monkeypatch):
    """No cluster variable set; jax.distributed.initialize records its kwargs instead of starting anything."""
    for k in list(os.environ):
        if k.startswith(_CLUSTER_VARS):
            monkeypatch.delenv(k)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    return calls


def _args(**kw):
    a = argparse.Namespace(coordinator_address=None, num_processes=None, process_id=None,
                           distributed_timeout_s=17)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _slurm(monkeypatch, ntasks):
    for k, v in {"SLURM_JOB_ID": "5000", "SLURM_STEP_NODELIST": "node[3-6]", "SLURM_NTASKS": str(ntasks),
                 "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": str(ntasks)}.items():
        monkeypatch.setenv(k, v)


def test_no_cluster_environment_is_one_process_without_initialize(clean_env):
    assert distributed.jax_cluster_env() is None
    info = distributed.initialize(_args())
    assert info == {"mode": "single", "how": "no cluster environment detected", "process_index": 0,
                    "process_count": 1}
    assert clean_env == []  # never called: nothing to wait for on a lone CPU host


def test_slurm_job_of_four_tasks_lets_jax_detect_everything(clean_env, monkeypatch):
    _slurm(monkeypatch, 4)
    assert distributed.decide(_args()) == distributed.Decision("auto", "SlurmCluster", 4)
    distributed.initialize(_args())
    # no coordinator, count or id passed: JAX's detector fills them in; the timeouts are ours.
    assert clean_env == [{"initialization_timeout": 17, "heartbeat_timeout_seconds": 17}]
    # what JAX then derives from the same variables: first node, port 65535 - 2**12 + 1 + job_id % 2**12.
    from jax._src import clusters
    addr, n, i, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 10)
    assert (addr, n, i) == (f"node3:{61440 + 5000 % 4096}", 4, 2)


def test_slurm_job_of_one_task_is_not_initialized(clean_env, monkeypatch):
    _slurm(monkeypatch, 1)
    assert distributed.decide(_args()) == distributed.Decision("single", "SlurmCluster reports 1 process", 1)
    distributed.initialize(_args())
    assert clean_env == []


def test_open_mpi_is_detected_by_its_hnp_uri(clean_env, monkeypatch):
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.96.0.1:34911")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    assert distributed.decide(_args()) == distributed.Decision("auto", "OmpiCluster", 8)


def test_gke_tpu_pod_is_detected_from_worker_hostnames(clean_env, monkeypatch):
    from jax._src.clusters import cloud_tpu_cluster
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)  # as on a TPU VM
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")  # GKE: no metadata server to ask
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "w0,w1,w2,w3")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "1")  # else JAX asks the metadata server for it
    assert distributed.decide(_args()) == distributed.Decision("auto", "GkeTpuCluster", 4)


def test_explicit_flags_win_over_the_environment(clean_env, monkeypatch):
    _slurm(monkeypatch, 4)
    a = _args(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
    assert distributed.decide(a).mode == "explicit"
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    info = distributed.initialize(a)
    assert clean_env == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1,
                          "initialization_timeout": 17, "heartbeat_timeout_seconds": 17}]
    assert (info["mode"], info["process_index"], info["process_count"]) == ("explicit", 1, 2)


def test_partial_explicit_flags_are_refused(clean_env):
    with pytest.raises(ValueError, match="go together"):
        distributed.decide(_args(coordinator_address="10.0.0.1:1234"))


def test_jaxpt_distributed_off_forces_one_process(clean_env, monkeypatch):
    _slurm(monkeypatch, 4)
    monkeypatch.setenv("JAXPT_DISTRIBUTED", "off")
    assert distributed.decide(_args()) == distributed.Decision("single", "JAXPT_DISTRIBUTED=off", 1)
    distributed.initialize(_args())
    assert clean_env == []


def test_the_path_taken_is_logged(clean_env, caplog):
    caplog.set_level("INFO", logger="jaxpt.run.distributed")
    distributed.log_startup(distributed.initialize(_args()))
    assert "distributed: single via no cluster environment detected (process 0 of 1)" in caplog.text
