"""``python -m jaxpt.tools.compile``: topology names, the compile report on local CPU devices, and (with libtpu) on a TPU
topology compiled from this host."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxpt.tools import compile as compile_lib
from jaxpt.util.errors import ConfigError
from jaxpt.run.validate import validate

REPO = pathlib.Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "configs" / "quickstart.gin")
D, LAYERS, H, K, HD, F, V = 64, 2, 4, 2, 16, 128, 512
TINY = [f"ModelConfig.vocab_size = {V}", f"ModelConfig.d_model = {D}", f"ModelConfig.num_layers = {LAYERS}",
        f"ModelConfig.num_heads = {H}", f"ModelConfig.num_kv_heads = {K}", f"ModelConfig.head_dim = {HD}",
        f"ModelConfig.mlp_dim = {F}", "TrainConfig.seq_len = 64", "TrainConfig.global_batch_size = 16"]


def _argv(*extra):
    return ["--config", QUICKSTART, *[a for b in TINY for a in ("--gin", b)], *extra]


@pytest.mark.parametrize("name, dims", [
    # Cloud TPU accelerator types and their published topologies (cloud.google.com/tpu/docs/v5p, /v5e, /v6e, /v4).
    ("v5p-8", (2, 2, 1)), ("v5p-128", (4, 4, 4)), ("v5p-256", (4, 4, 8)), ("v5p-512", (4, 8, 8)), ("v5p-1024", (8, 8, 8)),
    ("v4-128", (4, 4, 4)), ("v4-32", (2, 2, 4)), ("v5e-8", (2, 4)), ("v5e-256", (16, 16)), ("v5e-32", (4, 8)),
    ("v6e-256", (16, 16)), ("v5litepod-16", (4, 4)), ("v5p:4x4x8", (4, 4, 8)), ("v5e:2x2", (2, 2))])
def test_topology_names_map_to_the_published_torus(name, dims):
    """Accelerator-type names count TensorCores on v4/v5p (two per chip) and chips on v5e/v6e."""
    _, got = compile_lib.parse_topology(name)
    assert got == dims


@pytest.mark.parametrize("name", ["v5p-3", "v9-8", "v5e:2x2x2", "v5p:4x4", "tpu", "v5e-12"])
def test_bad_topology_names_are_config_errors_naming_the_flag(name):
    with pytest.raises(ConfigError, match="--topology"):
        compile_lib.parse_topology(name)


@pytest.mark.integration
def test_cpu_compile_reports_per_chip_bytes_for_two_simulated_slices(capsys):
    """cpu:4 x 2 slices: the DCN axis is data=2 (the default), the state is an argument aliased by its output
    (donated), and total = arguments + outputs - aliased + temp. With the long-row settings of the slice presets
    that run off TPU (blockwise attention, chunked loss), so they are compiled sharded too."""
    rc = compile_lib.main(_argv("--mesh", "fsdp=2,tensor=2", "--topology", "cpu:4", "--num-slices", "2", "--json",
                                "--gin", "ModelConfig.attention_impl = 'blockwise'",
                                "--gin", "ModelConfig.loss_chunk_size = 16"))
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["topology"], r["chips"], r["num_slices"], r["dcn_mesh"]) == ("cpu:4", 8, 2, "data=2")
    assert r["mesh"] == "data=2,fsdp=2,tensor=2"
    b = r["bytes_per_chip"]
    assert b["total"] == b["arguments"] + b["outputs"] - b["aliased"] + b["temp"]
    # fp32 params + two AdamW moments: each device holds at least 1/4 of them (fsdp x tensor = 4 shards)
    params = V * D * 2 + LAYERS * (D * H * HD * 2 + D * K * HD * 2 + 3 * D * F + 2 * D) + D
    state_bytes = 3 * 4 * params
    assert state_bytes / 4 <= b["arguments"] <= state_bytes + 3 * 4 * 16 * 64
    assert b["aliased"] >= state_bytes / 4 * 0.99
    assert r["params"] == params
    assert r["hbm_bytes_per_chip"] is None and r["fits"] is None
    assert r["compile_seconds"] > 0 and r["planner_bytes_per_chip"] > 0


@pytest.mark.slow
def test_a_step_over_the_given_hbm_exits_1_with_the_numbers(capsys):
    rc = compile_lib.main(_argv("--topology", "cpu:8", "--hbm-gib", "0.001"))
    out = capsys.readouterr().out
    assert rc == 1
    assert "DOES NOT FIT" in out and "temp" in out and "planner" in out


def test_dcn_mesh_that_disagrees_with_num_slices_is_refused():
    from jaxpt import config as config_lib
    cfg = config_lib.parse([QUICKSTART], [*TINY, "TrainConfig.dcn_mesh = 'data=4'"])
    with pytest.raises(ConfigError, match="TrainConfig.dcn_mesh"):
        compile_lib.with_slices(cfg, 2)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (pip install -e '.[tpu]'); TPU topology compiles need it")
@pytest.mark.parametrize("impl, seq_len", [("xla", 64), ("splash", 128)])
def test_two_layer_model_compiles_for_a_v5e_2x2_topology_on_this_host(impl, seq_len):
    """The real train step compiles for 4 v5e chips with libtpu's compiler (with ``splash``: the Pallas kernel
    itself, under shard_map); per-chip bytes are reported against 16 GiB of HBM. Run in a subprocess: libtpu stays
    out of the test process, and other processes may hold it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=str(REPO))
    argv = _argv("--mesh", "fsdp=-1", "--topology", "v5e:2x2", "--json", "--gin", f"TrainConfig.seq_len = {seq_len}",
                 "--gin", f"ModelConfig.attention_impl = {impl!r}")
    proc = subprocess.run([sys.executable, "-m", "jaxpt.tools.compile", *argv],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (r["topology"], r["platform"], r["chips"], r["mesh"]) == ("v5e:2x2", "tpu", 4, "fsdp=4")
    assert r["hbm_bytes_per_chip"] == 16 * 2 ** 30 and r["fits"] is True
    b = r["bytes_per_chip"]
    assert b["total"] == b["arguments"] + b["outputs"] - b["aliased"] + b["temp"] > 0


#: Published parameter counts (Meta's Llama 3 / 3.2 model cards: 8,030,261,248; 70,553,706,496; 1,235,814,400).
PRESETS = {"llama3_1b": 1_235_814_400, "llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496}
#: (slice file, chips, sequences per chip)
SLICES = [("v5p-128", 64, 2), ("v5p-512", 256, 1), ("v5e-256", 256, 1), ("v6e-256", 256, 1)]


@pytest.mark.parametrize("model", sorted(PRESETS))
@pytest.mark.parametrize("slice_name, chips, per_chip", SLICES)
def test_model_and_slice_presets_compose_with_the_quickstart_data_config(model, slice_name, chips, per_chip):
    """quickstart.gin (data settings) + a model file + a slice file parse and validate for the slice's chip
    count with no tokenizer (vocab_size explicit), with the published parameter count, bf16 compute, fp32
    params, full remat and scanned layers, FSDP over every chip."""
    from jaxpt import config as config_lib
    from jaxpt.model import count_params
    cfg = config_lib.parse([QUICKSTART, str(REPO / "configs" / "models" / f"{model}.gin"),
                            str(REPO / "configs" / "slices" / f"{slice_name}.gin")])
    sizes = validate(cfg, chips)
    assert sizes["fsdp"] == chips
    assert cfg.global_batch_size == per_chip * chips and cfg.seq_len == 8192
    m = cfg.model
    assert count_params(m)["total"] == PRESETS[model]
    assert (m.param_dtype, m.compute_dtype, m.remat_policy, m.scan_layers) == ("float32", "bfloat16", "full", True)
    assert m.vocab_size == 128256 and m.rope_theta == 500000.0
    assert (m.attention_impl, m.loss_chunk_size) == ("splash", 1024)


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (pip install -e '.[tpu]'); TPU topology devices need it")
def test_mesh_axes_that_split_the_physical_torus_are_laid_out_with_a_warning():
    """expert=8 x fsdp=8 on v5p's 4x4x4 torus: 8 is no product of whole physical axes, which ``jax.make_mesh``
    refuses outside v5e; jaxpt lays it out with split physical axes (every chip once) and warns, so a mesh the
    planner accepts is one the compiler can build. A whole-axis shape (fsdp=16, tensor=4) is laid out silently."""
    code = (
        "import logging, jax\n"
        "from jax.experimental import topologies\n"
        "from jaxpt import mesh\n"
        "logging.basicConfig(level=logging.WARNING, format='%(name)s %(message)s')\n"
        "devs = topologies.get_topology_desc(platform='tpu', topology_name='v5p:4x4x4', chip_config_name='default',"
        " chips_per_host_bounds=(2, 2, 1), num_slices=1).devices\n"
        "for spec in ('fsdp=8,expert=8', 'fsdp=16,tensor=4'):\n"
        "    m = mesh.make_mesh(spec, devs)\n"
        "    print('MESH', spec, dict(m.shape), len({d.id for d in m.devices.flat}))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MESH")]
    assert lines == ["MESH fsdp=8,expert=8 {'stage': 1, 'data': 1, 'fsdp': 8, 'sequence': 1, 'expert': 8, 'tensor': 1} 64",
                     "MESH fsdp=16,tensor=4 {'stage': 1, 'data': 1, 'fsdp': 16, 'sequence': 1, 'expert': 1, 'tensor': 4} 64"]
    warnings = [line for line in proc.stderr.splitlines() if "splitting physical axes" in line]
    assert len(warnings) == 1 and "fsdp=8,expert=8" in warnings[0], proc.stderr[-2000:]


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu not installed (pip install -e '.[tpu]'); TPU topology devices need it")
def test_the_dry_run_plans_a_target_slice_from_any_host_quietly_and_notes_the_default_data(prepared_sample, tmp_path):
    """``--dry-run --topology v5p-128`` plans the 8B preset for 64 v5p chips (the slice's mesh, its HBM) from a CPU
    host, where it used to plan for the one local device (682.95 GiB per device) and say every check passed; libtpu
    prints nothing; a config that names no training data is told it reads the quickstart's sample."""
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "sample").symlink_to(prepared_sample)  # DataConfig's default paths, relative
    env = {k: v for k, v in os.environ.items() if k not in ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")}
    r = subprocess.run([sys.executable, "-m", "jaxpt.train", "--config", str(REPO / "configs/models/llama3_8b.gin"),
                        "--config", str(REPO / "configs/slices/v5p-128.gin"), "--workdir", str(tmp_path / "w"),
                        "--dry-run", "--topology", "v5p-128"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "target v5p:4x4x4: 64 chips in 1 slice(s)" in r.stdout and "mesh fsdp=64 over 64 x TPU v5" in r.stdout
    gib = float(re.search(r"memory per device \(estimate, a floor\): ([0-9.]+) GiB \(fits\)", r.stdout).group(1))
    assert 5 < gib < 95  # the 8B preset's per-chip share, against v5p's 95 GiB, not one device's whole model
    assert "note: no data config: the training data is DataConfig's default" in r.stdout
    assert not any(s in r.stderr for s in ("Failed to find host bounds", "E0000", "INVALID_ARGUMENT")), r.stderr[-2000:]
    assert not (tmp_path / "w").exists()
