"""Host offload of the optimizer state (``TrainConfig.offload_optimizer_state``): the state lives in ``pinned_host``
memory between steps, training computes the same numbers, and the compile report shows the host bytes."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import packed_batch
from jaxpt.run import build as builder
from jaxpt.tools import compile as compile_lib
from jaxpt import config as config_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "configs" / "quickstart.gin")
B, L, V = 8, 32, 256
TINY = [f"ModelConfig.vocab_size = {V}", "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2",
        "ModelConfig.num_heads = 4", "ModelConfig.num_kv_heads = 2", "ModelConfig.head_dim = 8",
        "ModelConfig.mlp_dim = 64", f"TrainConfig.seq_len = {L}", f"TrainConfig.global_batch_size = {B}",
        "TrainConfig.mesh = 'data=2,fsdp=4'", "TrainConfig.steps = 10"]


def _cfg(offload: bool):
    return config_lib.parse([QUICKSTART], [*TINY, f"TrainConfig.offload_optimizer_state = {offload}"])


def _batch(built, seed):
    return packed_batch(built, B, L, V, seed)


def test_cpu_devices_have_pinned_host_memory():
    """The premise of the CPU tests below: jax 0.10.2's CPU backend exposes a ``pinned_host`` memory."""
    assert "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}


@pytest.mark.slow
def test_offloaded_optimizer_state_trains_to_the_same_numbers():
    """Three AdamW steps on 8 simulated devices (data=2, fsdp=4): with the optimizer state in pinned host memory,
    loss, grad norm, params and both moments equal the run without offload (rel 1e-6); the offloaded state stays
    in host memory after each step, the params in device memory."""
    runs = {}
    for offload in (False, True):
        built = builder.build_for(_cfg(offload))
        state = built.init_state()
        losses = []
        for i in range(3):
            state, metrics = built.train_step(state, _batch(built, i))
            losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
        assert kinds == ({"pinned_host"} if offload else {"device"})
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
        runs[offload] = (losses, jax.tree.map(np.asarray, state.params), jax.tree.map(np.asarray, state.opt_state))
    (l0, p0, o0), (l1, p1, o1) = runs[False], runs[True]
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    assert l0[2][0] < l0[0][0]  # it trained: the comparison is between moving states
    for a, b in zip(jax.tree.leaves(p1) + jax.tree.leaves(o1), jax.tree.leaves(p0) + jax.tree.leaves(o0)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12)


@pytest.mark.integration
def test_compile_report_carries_host_figures_and_offloaded_arguments(capsys):
    """cpu:8: the report has ``host_*`` fields, says the state is offloaded and what ``auto`` runs as (``xla`` for
    32-token rows on CPU) (the CPU backend counts every buffer
    as device memory, so its host_* figures are 0: the TPU test below checks the figures themselves)."""
    argv = ["--config", QUICKSTART, *[a for b in TINY for a in ("--gin", b)], "--gin",
            "TrainConfig.offload_optimizer_state = True", "--gin", "ModelConfig.attention_impl = 'auto'",
            "--topology", "cpu:8", "--json"]
    assert compile_lib.main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["offload_optimizer_state"] is True
    assert (r["attention_impl"], r["attention_impl_used"], r["attention_fallback_reason"]) == ("auto", "xla", "")
    b = r["bytes_per_chip"]
    assert {"host_argument", "host_output", "host_alias", "host_temp", "host_total"} <= set(b)
    assert b["host_total"] == b["host_argument"] + b["host_output"] - b["host_alias"] + b["host_temp"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (pip install -e '.[tpu]'); TPU topology compiles need it")
def test_offload_moves_the_optimizer_state_from_hbm_to_host_on_a_v5e_2x2_topology():
    """A 2-layer model compiled for 4 v5e chips (fsdp=4) with and without offload: with it, the device argument
    bytes fall by what the host argument bytes rise (within 1%), at least the two fp32 AdamW moments of 1/4 of the
    params; without it there are no host bytes."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=str(REPO))
    reports = {}
    for offload in (False, True):
        argv = ["--config", QUICKSTART, *[a for b in TINY for a in ("--gin", b)],
                "--gin", "TrainConfig.mesh = 'fsdp=-1'",  # --gin wins over --mesh, and TINY's mesh is 8 devices
                "--gin", f"TrainConfig.offload_optimizer_state = {offload}",
                "--topology", "v5e:2x2", "--json"]
        proc = subprocess.run([sys.executable, "-m", "jaxpt.tools.compile", *argv],
                              env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[offload] = json.loads(proc.stdout.strip().splitlines()[-1])["bytes_per_chip"]
    off, on = reports[False], reports[True]
    from jaxpt.model import count_params
    moments = 2 * 4 * count_params(_cfg(False).model)["total"] / 4   # unpadded: TPU tiles pad small arrays
    assert off["host_argument"] == off["host_total"] == 0
    assert on["host_argument"] >= moments and on["host_total"] == on["host_argument"]
    assert off["arguments"] - on["arguments"] == pytest.approx(on["host_argument"], rel=0.01)
