"""Hostile input: what jaxpt reads from files, data and other users is never run as code, never writes outside its
folder, and never takes a shared machine's word for what it is. One test (or a few) per kind of fault."""

import os
import pathlib
import sys

import gin
import pytest

from jaxpt import config as C
from jaxpt.util.errors import ConfigError

CANARY = "import pathlib, os\npathlib.Path(os.environ['JAXPT_CANARY']).write_text('ran')\n"


@pytest.fixture
def canary(tmp_path, monkeypatch):
    """A module that, if imported, writes a file: proof that a config ran code."""
    (tmp_path / "canary_mod.py").write_text(CANARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("JAXPT_CANARY", str(tmp_path / "ran"))
    yield tmp_path / "ran"
    sys.modules.pop("canary_mod", None)


@pytest.mark.parametrize("text, refused", [
    ("import canary_mod\nTrainConfig.steps = 3\n", "gin import runs a module's code"),
    ("from __gin__ import dynamic_registration\nimport canary_mod\ncanary_mod.f.x = 1\n", "gin import runs"),
    ("TrainConfig.workdir = @canary_mod.f()\n", r"reference @canary_mod\.f\(\) is refused"),
    ("TrainConfig.mesh = [@evil]\n", "reference @evil is refused"),
])
def test_gin_that_would_run_code_is_refused_before_anything_runs(tmp_path, canary, text, refused):
    """Gin is code: an import, dynamic registration or a reference in a config file (or a --gin binding, or a run's
    config.gin read back by a tool) ran arbitrary Python. They are refused, naming the file and line, before gin
    parses anything."""
    path = tmp_path / "x.gin"
    path.write_text(text)
    with pytest.raises(ConfigError, match=refused) as e:
        C.parse([str(path)])
    assert str(path) in str(e.value) and ":" in str(e.value)
    with pytest.raises(ConfigError, match=refused):
        C.parse([], [text.splitlines()[-1]] if "@" in text else [text.replace("\n", " ; ").split(" ; ")[0]])
    assert not canary.exists()


def test_an_included_file_is_checked_too(tmp_path, canary):
    (tmp_path / "evil.gin").write_text("import canary_mod\n")
    (tmp_path / "main.gin").write_text(f"include '{tmp_path / 'evil.gin'}'\nTrainConfig.steps = 3\n")
    with pytest.raises(ConfigError, match="evil.gin:1: `import canary_mod` is refused"):
        C.parse([str(tmp_path / "main.gin")])
    (tmp_path / "loop.gin").write_text(f"include '{tmp_path / 'loop.gin'}'\n")
    with pytest.raises(ConfigError, match="includes nest deeper than"):
        C.parse([str(tmp_path / "loop.gin")])
    assert not canary.exists()


def test_binding_a_configurable_another_package_registered_is_refused(tmp_path):
    @gin.configurable("EvilThing", module="evil_package")
    def evil_thing(command="echo"):
        return command

    path = tmp_path / "x.gin"
    path.write_text("EvilThing.command = 'rm -rf /'\n")
    with pytest.raises(ConfigError, match="EvilThing is registered by evil_package, not by jaxpt's configs"):
        C.parse([str(path)])


def test_the_repository_configs_and_plain_bindings_still_parse():
    """What the project's own configs use (plain bindings, macros, includes, the corpus build's one import) passes."""
    root = pathlib.Path(__file__).resolve().parents[1]
    for path in sorted((root / "configs").rglob("*.gin")):
        C.check_gin_text(path.read_text(), str(path))
    cfg = C.parse([str(root / "configs" / "quickstart.gin")], ["TrainConfig.seed = 3", "A = 5", "TrainConfig.steps = %A"])
    assert (cfg.seed, cfg.steps) == (3, 5)


# ------------------------------------------------------------------------------------------ shared machines


def _cfg(prepared, workdir, **extra):
    from conftest import tiny_bindings
    return C.parse(["configs/quickstart.gin"], tiny_bindings(prepared, workdir, **extra), mesh="data=8")


def test_a_workdir_or_compilation_cache_others_can_write_is_refused_before_anything_runs(prepared_sample, tmp_path):
    """A compilation cache is code the run loads: a program planted in a workdir (or cache directory) another user
    made, or can write, ran as this user's. Such a directory is refused by the pre-start checks, naming it."""
    from jaxpt.run import resolve
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match=r"TrainConfig.workdir = .*shared' is writable by its group and everyone"):
        resolve.resolve(_cfg(prepared_sample, shared))
    mine = tmp_path / "mine"
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o775)
    with pytest.raises(ConfigError, match=r"TrainConfig.compilation_cache_dir = .*cache' is writable by its group"):
        resolve.resolve(_cfg(prepared_sample, mine, **{"TrainConfig.compilation_cache_dir": repr(str(cache))}))
    os.chmod(cache, 0o700)
    resolve.resolve(_cfg(prepared_sample, mine, **{"TrainConfig.compilation_cache_dir": repr(str(cache))}))
    assert not mine.exists()  # the checks wrote nothing


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to give a folder to another uid")
def test_a_workdir_another_user_owns_is_refused(prepared_sample, tmp_path):
    from jaxpt.run import resolve
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(ConfigError, match=r"owned by uid 12345, not by this user"):
        resolve.resolve(_cfg(prepared_sample, theirs))


def test_the_trainer_makes_its_compilation_cache_private(tmp_path):
    from jaxpt.run import compile_cache
    with compile_cache.persistent_cache(str(tmp_path / "new_cache")):
        pass
    assert (tmp_path / "new_cache").stat().st_mode & 0o777 == 0o700


# ------------------------------------------------------------------------------------------ writes outside their folder


@pytest.mark.parametrize("name", ["../../x", "/etc/passwd", "a/../../b", "..", ""])
def test_a_name_from_data_never_leaves_its_folder(name):
    from jaxpt.util import fs
    with pytest.raises(ConfigError, match="would land outside the folder"):
        fs.contained("/out", name)
    assert fs.contained("/out", "a/b/../c.json") == "a/c.json"


def test_object_names_that_climb_out_of_a_downloaded_folder_are_refused_before_anything_is_written(
        tmp_path, monkeypatch):
    """A `gs://` model folder with an object named `../../x` wrote it outside the download cache (and conversion
    exited 0)."""
    from jaxpt.util import fs
    monkeypatch.setenv("JAXPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fs, "tree_listing", lambda root: [("config.json", 2, 0.0), ("../../escaped.txt", 3, 0.0)])
    with pytest.raises(ConfigError, match=r"'../../escaped.txt' would land outside the folder"):
        fs.local_tree("gs://bucket/model")
    assert not (tmp_path / "escaped.txt").exists() and not list((tmp_path / "cache").rglob("*.json"))


def test_the_download_cache_is_the_users_own_and_downloads_are_checked(tmp_path, monkeypatch):
    """`<tmp>/jaxpt-cache` was shared by every user of the host and trusted a `.complete` marker, so another user's
    planted weights were converted as the bucket's."""
    from jaxpt.util import fs
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("JAXPT_CACHE_DIR", str(shared))
    with pytest.raises(ConfigError, match="download cache .* is writable by its group and everyone"):
        fs.cache_dir()
    monkeypatch.delenv("JAXPT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home_cache"))
    assert fs.cache_dir() == str(tmp_path / "home_cache" / "jaxpt")
    assert (tmp_path / "home_cache" / "jaxpt").stat().st_mode & 0o777 == 0o700
    src = tmp_path / "src.bin"
    src.write_bytes(b"12345")
    with pytest.raises(OSError, match="downloaded 5 bytes, the listing says 9"):
        fs._copy_verified(str(src), str(tmp_path / "out" / "x.bin"), 9)
    assert not (tmp_path / "out" / "x.bin").exists() and not list((tmp_path / "out").iterdir())


def test_an_eval_card_task_named_like_a_path_is_refused(tmp_path):
    import yaml

    from jaxpt.eval.card import CardError, content_hash, load_card
    root = pathlib.Path(__file__).resolve().parents[1]
    raw = yaml.safe_load((root / "configs" / "eval" / "card_v1.yaml").read_text())
    raw["tasks"]["../../x"] = next(iter(raw["tasks"].values()))
    raw["content_sha256"] = content_hash(raw)  # a stamped card: only the task name is wrong
    (tmp_path / "card.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(CardError, match=r"task name '\.\./\.\./x' is not a plain name"):
        load_card(str(tmp_path / "card.yaml"))


def test_a_corpus_build_refuses_a_folder_that_is_not_a_corpus_version(tmp_path):
    """`--output` pointed at a folder of other files deleted what was there."""
    pytest.importorskip("apache_beam")
    from data_pipelines import build
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "chapter1.tex").write_text("keep me")
    with pytest.raises(ConfigError, match=r"holds chapter1.tex, which is not a corpus version.*--overwrite"):
        build.check_output(str(tmp_path / "thesis"))
    build.check_output(str(tmp_path / "thesis"), overwrite=True)
    (tmp_path / "v1" / "tfds").mkdir(parents=True)
    (tmp_path / "v1" / "manifest.json").write_text("{}")
    build.check_output(str(tmp_path / "v1"))  # an earlier version: rebuilt in place
    assert (tmp_path / "thesis" / "chapter1.tex").read_text() == "keep me"


# ------------------------------------------------------------------------------------------ malformed files


def _safetensors(path, header_edit=None, raw_header=None, tail=b""):
    """A valid two-tensor safetensors file, then its header edited (``header_edit(header)``) or replaced."""
    import json

    import numpy as np

    from jaxpt.tools import convert
    convert.write_safetensors(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)})
    data = pathlib.Path(path).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    if header_edit is not None:
        header_edit(header)
    blob = raw_header if raw_header is not None else json.dumps(header).encode()
    pathlib.Path(path).write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + n:] + tail)


def _set(key, value):
    def edit(h):
        h["a"][key] = value
    return edit


@pytest.mark.parametrize("edit, raw, tail, message", [
    (_set("data_offsets", [0, 12]), None, b"", "hold 12 bytes, its dtype and shape"),
    (_set("data_offsets", [8, 32]), None, b"", "starts at byte"),
    (_set("shape", [2, -3]), None, b"", "a malformed entry"),
    (_set("dtype", "F128"), None, b"", "a malformed entry"),
    (lambda h: h["b"].update(data_offsets=[20, 36]), None, b"", "starts at byte"),
    (None, b"{not json", b"", "the header is not JSON"),
    (None, None, b"trailing", "the tensors cover 40 bytes of data, the file holds 48"),
    (lambda h: h.update(__metadata__={"format": 3}), None, b"", "__metadata__ must map strings to strings"),
])
def test_a_malformed_safetensors_header_is_refused_before_any_tensor_is_read(tmp_path, edit, raw, tail, message):
    """Headers with bad offsets or sizes ended in tracebacks, or converted silently from the wrong bytes."""
    from jaxpt.tools import convert
    _safetensors(tmp_path / "model.safetensors", edit, raw, tail)
    with pytest.raises(convert.ConvertError, match=message):
        convert.SafetensorsFolder(tmp_path)


def test_a_huge_header_length_is_refused(tmp_path):
    from jaxpt.tools import convert
    (tmp_path / "model.safetensors").write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")
    with pytest.raises(convert.ConvertError, match="header of 1000000000000 bytes"):
        convert.SafetensorsFolder(tmp_path)


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", "64", "hidden_size = '64': not an integer"),
    ("num_hidden_layers", 2.5, "not an integer"),
    ("num_attention_heads", True, "not an integer"),
    ("vocab_size", -5, "not an integer >= 1"),
    ("rms_norm_eps", "tiny", "rms_norm_eps = 'tiny': not a finite positive number"),
    ("rope_theta", "ten thousand", "RoPE settings"),
])
def test_a_non_numeric_config_value_is_a_named_error(key, value, message):
    from jaxpt.tools import convert
    hf = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 128, "vocab_size": 256, key: value}
    with pytest.raises(convert.ConvertError, match=message):
        convert.model_config_from_hf(hf)


def _converted(prepared, out):
    """A small params-only checkpoint (as python -m jaxpt.tools.convert writes one) and the path of its meta file."""
    import jax

    from conftest import tiny_bindings
    from jaxpt.data.tokenizer import Tokenizer
    from jaxpt.run import build
    from jaxpt.tools import convert
    cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared, out), mesh="data=8")
    tok = Tokenizer.load(cfg.data.tokenizer_path)
    built = build.build_for(cfg, tokenizer=tok)
    convert.write_params_checkpoint(str(out), built.cfg, jax.device_get(built.init_state().params), built.mesh, tok,
                                    {"path": "a test"})
    (meta,) = (out / "checkpoints" / "0" / "meta").glob("*metadata*")
    return meta


def test_checkpoint_metadata_is_checked_before_anything_is_read_or_built(prepared_sample, tmp_path):
    """A checkpoint whose metadata named /dev/zero or a FIFO as its tokenizer hung the notebook restore helper; one
    recording 20,000 layers filled memory building them. Files named by metadata must be regular and of a bounded
    size, and the recorded model must have the stored arrays' parameter count, before anything is read or built."""
    import json
    import time

    import jaxpt
    from jaxpt.checkpoint import CheckpointError
    meta_path = _converted(prepared_sample, tmp_path / "ckpt")
    meta = json.loads(meta_path.read_text())
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for bad in ("/dev/zero", str(fifo)):
        meta["tokenizer"]["path"] = bad
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(CheckpointError, match=rf"{bad} \(not a regular file\)"):
            jaxpt.restore(tmp_path / "ckpt", tokenizer_path=bad)
        restored = jaxpt.restore(tmp_path / "ckpt")  # the metadata's path is skipped; the config's one is used
        assert restored.tokenizer.sha256 == meta["tokenizer"]["sha256"]
    meta["model"]["num_layers"] = 20000
    meta_path.write_text(json.dumps(meta))
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"records a model of [\d,]+ parameters, its arrays hold"):
        jaxpt.restore(tmp_path / "ckpt")
    assert time.perf_counter() - t0 < 60
