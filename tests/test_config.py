"""Config parsing and the typed validation pass: every error names its key, before any compile."""

import dataclasses
import os

import pytest

from jaxpt import config as C
from jaxpt.run.validate import validate

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.gin")


def parse(*bindings, **flags):
    return C.parse([QUICKSTART], list(bindings), **flags)


def test_quickstart_parses_and_validates_on_8_devices():
    cfg = parse()
    sizes = validate(cfg, 8)
    assert sizes == {"stage": 1, "data": 2, "fsdp": 2, "sequence": 1, "expert": 1, "tensor": 2}
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
    (("TrainConfig.global_batch_size = 6",), {"mesh": "data=4,fsdp=2"}, "global_batch_size"),
    (("ModelConfig.num_heads = 6", "ModelConfig.num_kv_heads = 1"), {"mesh": "data=2,tensor=4"}, "num_heads"),
    (("ModelConfig.num_kv_heads = 1",), {"mesh": "data=4,tensor=2"}, "num_kv_heads"),
    (("TrainConfig.seq_len = 512",), {}, "TrainConfig.seq_len"),                    # longer than max_seq_len
    (("OptimizerConfig.warmup_steps = 2000", "OptimizerConfig.decay_steps = 0"), {},  # past --steps
     "OptimizerConfig.warmup_steps"),
    (("DataConfig.num_shards = 3",), {}, "DataConfig.num_shards"),                  # does not divide the batch
])
def test_validation_errors_name_the_key(bindings, flags, key):
    """Checks across configs or against the 8 devices: the config builds, validate() refuses it."""
    cfg = parse(*bindings, **flags)
    with pytest.raises(C.ConfigError, match=key.replace(".", r"\.")):
        validate(cfg, 8)


@pytest.mark.parametrize("binding, message", [
    ("ModelConfig.d_model = '256'", "ModelConfig.d_model = '256': expected int, got str"),
    ("ModelConfig.d_model = 0", "ModelConfig.d_model = 0: must be positive"),
    ("ModelConfig.head_dim = 63", "ModelConfig.head_dim = 63: must be even"),
    ("ModelConfig.num_heads = 3", "ModelConfig.num_heads = 3: must be a multiple of ModelConfig.num_kv_heads = 2"),
    ("ModelConfig.compute_dtype = 'float8'", "ModelConfig.compute_dtype = 'float8': choose one of ('float32', "),
    ("ModelConfig.remat_policy = 'most'", "ModelConfig.remat_policy = 'most': choose one of ('none', "),
    ("ModelConfig.vocab_size = -1", "ModelConfig.vocab_size = -1: must be >= 0"),
    ("OptimizerConfig.schedule = 'linear'", "OptimizerConfig.schedule = 'linear': choose one of ('cosine', "),
    ("OptimizerConfig.b2 = 1.0", "OptimizerConfig.b2 = 1.0: must be in [0, 1)"),
    ("OptimizerConfig.peak_learning_rate = 0.0", "OptimizerConfig.peak_learning_rate = 0.0: must be positive"),
    ("OptimizerConfig.warmup_steps = 2000", "OptimizerConfig.warmup_steps = 2000 must be below the decay horizon "
     "OptimizerConfig.decay_steps = 900"),
    ("DataConfig.source = 'web'", "DataConfig.source = 'web': choose one of ('jsonl', 'sample', 'corpus')"),
    ("DataConfig.source = 'corpus'", "DataConfig.corpus_dir = '': must be set when DataConfig.source = 'corpus'"),
    ("CheckpointConfig.keep_last = 0", "CheckpointConfig.keep_last = 0: must be >= 1 when CheckpointConfig.enabled"),
    ("CheckpointConfig.save_every_steps = -1", "CheckpointConfig.save_every_steps = -1: must be >= 0"),
    ("StabilityConfig.lr_damping = 1.5", "StabilityConfig.lr_damping = 1.5: must be in (0, 1]"),
    ("StabilityConfig.rollback_loss_ratio = 1.0", "StabilityConfig.rollback_loss_ratio = 1.0: must be > 1"),
    ("HeldoutEvalConfig.group_by = ('domain', 'site')", "HeldoutEvalConfig.group_by = ('domain', 'site'): each grouping"),
    ("HeldoutEvalConfig.stride = -2", "HeldoutEvalConfig.stride = -2: must be >= 0"),
    ("TrainConfig.mesh = 'data=2,pipeline=4'", "TrainConfig.mesh = 'data=2,pipeline=4': unknown mesh axis 'pipeline'"),
    ("TrainConfig.dcn_mesh = 'data=-1'", "TrainConfig.dcn_mesh = 'data=-1': sizes across slices are explicit"),
    ("TrainConfig.grad_accum_steps = 0", "TrainConfig.grad_accum_steps = 0: must be positive"),
    ("TrainConfig.progress_bar = 1", "TrainConfig.progress_bar = 1: expected bool, got int"),
    ("TrainConfig.profile_steps = '898:901'", "TrainConfig.profile_steps = '898:901': the window must end by "
     "TrainConfig.steps = 900"),
    ("TrainConfig.logical_axis_rules = (('embed', 'fsdpp'),)",
     "TrainConfig.logical_axis_rules: 'embed' maps to unknown mesh axis 'fsdpp'"),
])
def test_each_config_refuses_its_own_bad_fields_at_parse(binding, message):
    """A field check fails as gin builds the config, with the class, field, value and what is allowed, and
    without gin's 'In call to configurable' note."""
    with pytest.raises(C.ConfigError) as e:
        parse(binding)
    assert str(e.value).startswith(message), str(e.value)
    assert "In call to configurable" not in str(e.value)


def test_configs_check_themselves_outside_gin_and_defaults_build():
    """The checks live in the dataclasses, so constructors and dataclasses.replace run them too."""
    from jaxpt.checkpoint import CheckpointConfig
    from jaxpt.eval.inloop import HeldoutEvalConfig
    from jaxpt.model.config import ModelConfig
    from jaxpt.training.optim import OptimizerConfig
    from jaxpt.training.stability import StabilityConfig
    classes = (ModelConfig, OptimizerConfig, C.DataConfig, CheckpointConfig, StabilityConfig, HeldoutEvalConfig,
               C.TrainConfig)
    assert all(cls() == cls() for cls in classes)  # every default is valid
    with pytest.raises(C.ConfigError, match=r"^StabilityConfig\.spike_window = 0: must be positive$"):
        StabilityConfig(spike_window=0)
    with pytest.raises(C.ConfigError, match=r"^TrainConfig\.model = 'big': expected ModelConfig, got str$"):
        C.TrainConfig(model="big")
    with pytest.raises(C.ConfigError, match=r"^ModelConfig\.num_heads = 4: must be a multiple of ModelConfig\.num_kv_heads = 3"):
        dataclasses.replace(ModelConfig(), num_kv_heads=3)
    # A list given for a tuple field is stored as a tuple, so configs stay hashable.
    assert HeldoutEvalConfig(group_by=["lang"]).group_by == ("lang",)


def test_heldout_eval_config_is_a_validated_train_config_field():
    cfg = parse("HeldoutEvalConfig.enabled = True", "HeldoutEvalConfig.group_by = ('domain',)")
    assert cfg.heldout_eval.enabled and cfg.heldout_eval.group_by == ("domain",)
    assert "HeldoutEvalConfig.group_by = ('domain',)" in C.operative_config_str(cfg)  # recorded with the run
    assert not parse().heldout_eval.enabled  # off by default


def test_mesh_axes_no_rule_uses_are_refused():
    """expert is used by no default rule (sequence is: length -> sequence): size 2 on it would only replicate work."""
    with pytest.raises(C.ConfigError) as e:
        validate(parse(mesh="data=2,expert=2,sequence=2"), 8)
    assert "TrainConfig.mesh = 'data=2,expert=2,sequence=2'" in str(e.value)
    assert "'expert' (size 2)" in str(e.value) and "'sequence'" not in str(e.value)
    # Rules that leave `length` unmapped make `sequence` unused again, and it is refused.
    no_cp = "TrainConfig.logical_axis_rules = (('batch', ('data', 'fsdp')), ('length', None))"
    with pytest.raises(C.ConfigError, match=r"'sequence' \(size 2\)"):
        validate(parse(no_cp, mesh="data=4,sequence=2"), 8)
    # Across slices (DCN) too: the axis size is the ICI x DCN product.
    with pytest.raises(C.ConfigError, match=r"TrainConfig\.dcn_mesh = 'expert=2'.*'expert' \(size 2\)"):
        validate(parse("TrainConfig.dcn_mesh = 'expert=2'", mesh="data=2,tensor=2"), 8)
    # A rule that maps a logical axis to the mesh axis makes it legal.
    rules = "TrainConfig.logical_axis_rules = (('batch', ('data', 'fsdp')), ('length', 'sequence'))"
    assert validate(parse(rules, mesh="data=4,sequence=2"), 8)["sequence"] == 2


def test_mesh_minus_one_takes_remaining_devices():
    cfg = parse(mesh="data=-1,tensor=2")
    assert validate(cfg, 8)["data"] == 4
    with pytest.raises(C.ConfigError, match="TrainConfig.mesh"):
        validate(parse(mesh="data=-1,tensor=3"), 8)


def test_cli_reports_config_error_without_traceback(capsys):
    from jaxpt import train
    rc = train.main(["--config", QUICKSTART, "--mesh", "data=3", "--workdir", "/tmp/jaxpt-never"])
    assert rc == 2
    assert "TrainConfig.mesh" in capsys.readouterr().err


def test_cli_refuses_unused_mesh_axes_before_compiling(capsys):
    from jaxpt import train
    rc = train.main(["--config", QUICKSTART, "--mesh", "data=2,expert=2,sequence=2", "--workdir", "/tmp/jaxpt-never"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "'expert' (size 2)" in err and "TrainConfig.mesh" in err
