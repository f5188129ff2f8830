"""jaxpt.tools.sweep: per-mesh compile, memory, timing and collective share; bad shapes reported, not raised."""

import csv
import gzip
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxpt import config as config_lib
from jaxpt.tools import sweep

#: A tiny model so that four compiles and a few steps stay within seconds on 2 CPU cores.
TINY = ["ModelConfig.vocab_size = 512", "ModelConfig.d_model = 64", "ModelConfig.num_layers = 2",
        "ModelConfig.num_heads = 4", "ModelConfig.num_kv_heads = 2", "ModelConfig.head_dim = 16",
        "ModelConfig.mlp_dim = 128", "ModelConfig.max_seq_len = 64", "TrainConfig.seq_len = 32",
        "TrainConfig.global_batch_size = 16", "ModelConfig.compute_dtype = 'float32'"]


def _tiny_cfg():
    return config_lib.parse(["configs/quickstart.gin"], TINY)


def test_synthetic_batch_is_packed_like_real_data():
    """Segments are contiguous runs numbered from 1, positions restart at 0 in each, tokens in range."""
    b = sweep.synthetic_batch(8, 50, vocab=100, seed=3)
    assert {k: (v.shape, v.dtype) for k, v in b.items()} == {k: ((8, 50), np.int32) for k in b}
    assert b["tokens"].min() >= 0 and b["tokens"].max() < 100
    for seg, pos in zip(b["segment_ids"], b["positions"]):
        assert seg[0] == 1 and np.all(np.diff(seg) >= 0) and np.all(np.diff(seg) <= 1) and seg[-1] <= 4
        expected, run = [], 0
        for t in range(len(seg)):
            run = 0 if t == 0 or seg[t] != seg[t - 1] else run + 1
            expected.append(run)
        np.testing.assert_array_equal(pos, expected)


@pytest.mark.parametrize("name,want", [
    ("all-reduce", True), ("all-gather.3", True), ("all-reduce-start", True), ("all-gather-done.12", True),
    ("reduce-scatter.1", True), ("collective-permute", True), ("ncclDevKernel_AllReduce_Sum_f32", True),
    ("ynn_fusion", False), ("end: all-gather", False), ("fusion.all-reduce", False), ("Rendezvous", False),
])
def test_is_collective(name, want):
    assert sweep.is_collective(name) is want


def test_collective_time_sums_only_collective_events(tmp_path):
    events = [{"ph": "X", "name": "all-reduce.1", "dur": 10.0}, {"ph": "X", "name": "fusion", "dur": 99.0},
              {"ph": "X", "name": "all-gather-start", "dur": 2.5}, {"ph": "M", "name": "all-reduce"},
              {"ph": "X", "name": "end: all-reduce", "dur": 7.0}]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert sweep.collective_time_us(str(tmp_path)) == (12.5, 2)


def test_collective_events_found_in_a_real_cpu_trace(tmp_path):
    """A jitted sum of a sharded array has one all-reduce: the trace shows it once per device per call."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.ones((8 * 64, 64)), NamedSharding(mesh, PartitionSpec("d")))
    f = jax.jit(lambda a: jnp.sum(jnp.tanh(a)), out_shardings=NamedSharding(mesh, PartitionSpec()))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(3):
            f(x).block_until_ready()
    total_us, count = sweep.collective_time_us(str(tmp_path))
    assert count == 3 * 8
    assert total_us > 0


def test_tpu_topology_unsupported_here_is_reported():
    """Without libtpu JAX cannot describe a TPU topology; the sweep says so instead of raising."""
    devices, reason = sweep.topology_devices("v5p:2x2x1")
    if devices is not None:
        pytest.skip("this JAX can compile for TPU topologies")
    assert "v5p:2x2x1" in reason and "libtpu" in reason


@pytest.mark.parametrize("mesh,key", [("data=3", "TrainConfig.mesh"), ("tensor=8", "ModelConfig.num_heads"),
                                      ("data=8,fsdp=2", "TrainConfig.mesh"), ("bogus=8", "unknown mesh axis"),
                                      ("stage=8", "ModelConfig.num_layers")])
def test_bad_shapes_are_reported_not_raised(mesh, key, tmp_path):
    r = sweep.sweep_one(_tiny_cfg(), mesh, steps=1, trace_steps=0, peak=1e11, memory_limit=None,
                        out_dir=str(tmp_path))
    assert r.status == "invalid" and key in r.note and r.compile_s is None


@pytest.mark.slow
def test_shape_over_the_memory_limit_does_not_run(tmp_path):
    r = sweep.sweep_one(_tiny_cfg(), "fsdp=8", steps=1, trace_steps=0, peak=1e11, memory_limit=2 ** 16,
                        out_dir=str(tmp_path))
    assert r.status == "does not fit"
    assert r.compiled_memory_bytes > 2 ** 16 and r.step_time_s is None and "GiB" in r.note


@pytest.mark.slow
def test_sweep_cli_end_to_end(tmp_path, capsys):
    """Four shapes run, two bad ones are reported; CSV, PNG and the best shape are written. The first loss
    (same params, same batch) is the same on every mesh: sharding must not change the math."""
    argv = ["--config", "configs/quickstart.gin", "--steps", "2", "--trace-steps", "1",
            "--peak-flops", "1e11", "--output", str(tmp_path), "--topology", "v5p:2x2x1"]
    for b in TINY:
        argv += ["--gin", b]
    meshes = ["data=8", "fsdp=8", "data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2", "tensor=8", "data=3"]
    for m in meshes:
        argv += ["--mesh", m]
    assert sweep.main(argv) == 0
    out = capsys.readouterr().out
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["mesh"] for r in rows] == meshes
    assert [r["status"] for r in rows] == ["ok"] * 4 + ["invalid"] * 2
    ok = rows[:4]
    losses = [float(r["first_loss"]) for r in ok]
    assert max(losses) - min(losses) <= 1e-4 * abs(losses[0])
    assert losses[0] == pytest.approx(math.log(512), rel=0.05)  # near-uniform logits at init
    for r in ok:
        assert float(r["tokens_per_sec"]) == pytest.approx(16 * 32 / float(r["step_time_s"]), rel=1e-6)
        assert 0 < float(r["collective_share"]) < 1
        assert int(r["compiled_memory_bytes"]) > 0
    best = max(ok, key=lambda r: float(r["tokens_per_sec"]))
    assert f"best: {best['mesh']}" in out
    assert "libtpu" in out or "TPU" in out
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_pipelined_shape_is_swept_like_any_other(tmp_path):
    """``stage=2,data=4`` (two pipeline stages of the tiny model's layers) compiles, runs and is timed by the
    sweep, with the same estimated and compiled memory columns as an unpipelined shape; the row's mesh names the
    stage axis."""
    r = sweep.sweep_one(_tiny_cfg(), "stage=2,data=4", steps=2, trace_steps=0, peak=1e11, memory_limit=None,
                        out_dir=str(tmp_path))
    assert r.status == "ok", r.note
    assert r.mesh == "stage=2,data=4" and r.tokens_per_sec > 0 and r.compile_s > 0
    assert r.compiled_memory_bytes > 0 and r.estimated_memory_bytes > 0
