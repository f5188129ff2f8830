"""Config parsing and the typed validation pass: every error names its key, before any compile."""

import os

import pytest

from jaxpt import config as C

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.gin")


def parse(*bindings, **flags):
    return C.parse([QUICKSTART], list(bindings), **flags)


def test_quickstart_parses_and_validates_on_8_devices():
    cfg = parse()
    sizes = C.validate(cfg, 8)
    assert sizes == {"data": 2, "fsdp": 2, "sequence": 1, "expert": 1, "tensor": 2}
    assert cfg.model.d_model == 256 and cfg.seq_len == 128


def test_later_bindings_win_and_flags_apply(tmp_path):
    extra = tmp_path / "extra.gin"
    extra.write_text("TrainConfig.seed = 7\nModelConfig.num_layers = 2\n")
    cfg = C.parse([QUICKSTART, str(extra)], ["TrainConfig.seed = 9"], workdir="/tmp/w", steps=20, mesh="fsdp=8")
    assert cfg.seed == 9                      # --gin beats a later file
    assert cfg.model.num_layers == 2          # later file beats the first
    assert (cfg.workdir, cfg.steps, cfg.mesh) == ("/tmp/w", 20, "fsdp=8")
    # --gin also beats the plain flags
    cfg = C.parse([QUICKSTART], ["TrainConfig.steps = 30"], steps=20)
    assert cfg.steps == 30


def test_unknown_binding_names_the_key():
    with pytest.raises(C.ConfigError, match="num_layerz"):
        parse("ModelConfig.num_layerz = 3")
    with pytest.raises(C.ConfigError, match="NoSuchConfig"):
        parse("NoSuchConfig.x = 3")


def test_unknown_binding_in_file_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("TrainConfig.seed = 1\nModelConfig.widht = 3\n")
    with pytest.raises(C.ConfigError) as e:
        C.parse([str(bad)])
    assert "bad.gin" in str(e.value) and "widht" in str(e.value) and "line 2" in str(e.value)


def test_missing_config_file():
    with pytest.raises(C.ConfigError, match="no such file"):
        C.parse(["/nonexistent/x.gin"])


@pytest.mark.parametrize("bindings, flags, key", [
    ((), {"mesh": "data=3"}, "TrainConfig.mesh"),                                   # product != devices
    ((), {"mesh": "data=2,fsdp=2,tensor=4"}, "TrainConfig.mesh"),
    ((), {"mesh": "data=2,pipeline=4"}, "TrainConfig.mesh"),                        # unknown axis
    (("TrainConfig.global_batch_size = 6",), {"mesh": "data=4,fsdp=2"}, "global_batch_size"),
    (("ModelConfig.num_heads = 3", "ModelConfig.num_kv_heads = 1"), {"mesh": "data=4,tensor=2"}, "num_heads"),
    (("ModelConfig.num_kv_heads = 1",), {"mesh": "data=4,tensor=2"}, "num_kv_heads"),
    (("TrainConfig.seq_len = 512",), {}, "TrainConfig.seq_len"),                    # longer than max_seq_len
    (("ModelConfig.head_dim = 63",), {}, "head_dim"),
    (("ModelConfig.d_model = '256'",), {}, "ModelConfig.d_model"),                  # wrong type
    (("ModelConfig.compute_dtype = 'float8'",), {}, "compute_dtype"),
    (("OptimizerConfig.schedule = 'linear'",), {}, "OptimizerConfig.schedule"),
    (("TrainConfig.logical_axis_rules = (('embed', 'fsdpp'),)",), {}, "logical_axis_rules"),
])
def test_validation_errors_name_the_key(bindings, flags, key):
    cfg = parse(*bindings, **flags)
    with pytest.raises(C.ConfigError, match=key.replace(".", r"\.")):
        C.validate(cfg, 8)


def test_mesh_minus_one_takes_remaining_devices():
    cfg = parse(mesh="data=-1,tensor=2")
    assert C.validate(cfg, 8)["data"] == 4
    with pytest.raises(C.ConfigError, match="TrainConfig.mesh"):
        C.validate(parse(mesh="data=-1,tensor=3"), 8)


def test_cli_reports_config_error_without_traceback(capsys):
    from jaxpt import train
    rc = train.main(["--config", QUICKSTART, "--mesh", "data=3", "--workdir", "/tmp/jaxpt-never"])
    assert rc == 2
    assert "TrainConfig.mesh" in capsys.readouterr().err
