"""Hostile input: what jaxpt reads from files, data and other users is never run as code, never writes outside its
folder, and never takes a shared machine's word for what it is. One test (or a few) per kind of fault."""

import os
import pathlib
import subprocess
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
    with pytest.raises(ConfigError, match=r"TrainConfig.workdir = .*shared' is writable by its group and everyone "
                                          r"\(owner uid \d+, mode 0o777\)"):
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
    ours = tmp_path / "ours"                   # a private workdir whose checkpoints folder anyone can write
    (ours / "checkpoints").mkdir(parents=True, mode=0o700)
    os.chmod(ours, 0o700)
    os.chmod(ours / "checkpoints", 0o777)
    with pytest.raises(ConfigError, match=r"TrainConfig.workdir's checkpoints folder = .* is writable by its group "
                                          r"and everyone"):
        resolve.resolve(_cfg(prepared_sample, ours))


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to give a folder to another uid")
def test_a_workdir_another_user_owns_is_refused(prepared_sample, tmp_path):
    from jaxpt.run import resolve
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, 12345)
    with pytest.raises(ConfigError, match=r"owned by uid 12345, not by this user .* \(owner uid 12345, mode 0o7"):
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
    (tmp_path / "notes.txt").write_text("keep me too")     # a file, not a folder: a named error, not a traceback
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=r"notes.txt: is a file, not a folder"):
            build.check_output(str(tmp_path / "notes.txt"), overwrite=overwrite)
    assert (tmp_path / "notes.txt").read_text() == "keep me too"


# ------------------------------------------------------------------------------------------ malformed files


def _safetensors(path, header_edit=None, raw_header=None, tail=b""):
    """A valid two-tensor safetensors file, then its header edited (``header_edit(header)``) or replaced."""
    import json

    import numpy as np

    from jaxpt.hf import safetensors as hf_st
    hf_st.write_safetensors(path, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.float32)})
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
    from jaxpt.hf import families as hf_families, safetensors as hf_st
    _safetensors(tmp_path / "model.safetensors", edit, raw, tail)
    with pytest.raises(hf_families.ConvertError, match=message):
        hf_st.SafetensorsFolder(tmp_path)


def test_a_huge_header_length_is_refused(tmp_path):
    from jaxpt.hf import families as hf_families, safetensors as hf_st
    (tmp_path / "model.safetensors").write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")
    with pytest.raises(hf_families.ConvertError, match="header of 1000000000000 bytes"):
        hf_st.SafetensorsFolder(tmp_path)


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", "64", "hidden_size = '64': not an integer"),
    ("num_hidden_layers", 2.5, "not an integer"),
    ("num_attention_heads", True, "not an integer"),
    ("vocab_size", -5, "not an integer >= 1"),
    ("rms_norm_eps", "tiny", "rms_norm_eps = 'tiny': not a finite positive number"),
    ("rope_theta", "ten thousand", "RoPE settings"),
])
def test_a_non_numeric_config_value_is_a_named_error(key, value, message):
    from jaxpt.hf import configs as hf_configs, families as hf_families
    hf = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 128, "vocab_size": 256, key: value}
    with pytest.raises(hf_families.ConvertError, match=message):
        hf_configs.model_config_from_hf(hf)


def _converted(prepared, out):
    """A small params-only checkpoint (as python -m jaxpt.tools.convert writes one) and the path of its meta file."""
    import jax

    from conftest import tiny_bindings
    from jaxpt.data.tokenizer import Tokenizer
    from jaxpt.hf import convert
    from jaxpt.run import build
    cfg = C.parse(["configs/quickstart.gin"], tiny_bindings(prepared, out), mesh="data=8")
    tok = Tokenizer.load(cfg.data.tokenizer_path)
    built = build.build_for(cfg, tokenizer=tok)
    convert.write_params_checkpoint(str(out), built.cfg, jax.device_get(built.init_state().params), built.mesh, tok,
                                    {"path": "a test"})
    (meta,) = (out / "checkpoints" / "0" / "meta").glob("*metadata*")
    return meta


@pytest.mark.integration
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


# --- Bounded corpus builds: a reader bounds its work before it holds it --------------------------------------------

def _source(fmt="jsonl", **kw):
    from data_pipelines.config import Source
    return Source(name="s", domain="web", path="x", format=fmt, license="CC0-1.0", acquired="2026-12-03", **kw)


def _reasons(elements):
    return [e.get("reason", "kept") for e in elements]


@pytest.mark.integration
def test_a_long_line_is_counted_oversized_in_linear_time_without_being_held(tmp_path):
    """A 256 MiB line between two good ones: the good ones are kept, the long one is one ``oversized`` drop
    carrying its length; the reader never holds it (the old reader glued each 1 MiB chunk onto the partial
    line, time quadratic in its length, and held all of it)."""
    import gzip
    import resource
    from data_pipelines import readers
    from data_pipelines.config import AdmissionConfig

    path = tmp_path / "long.jsonl.gz"
    n = 256 << 20
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b'{"text": "a first good line"}\n')
        for _ in range(n >> 20):
            f.write(os.urandom(1 << 19).hex().encode())   # text that compresses as text does, not 1000:1
        f.write(b'\n{"text": "a last good line"}\n')
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = list(readers.read_jsonl(str(path), _source(), AdmissionConfig(max_record_bytes=1 << 20)))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert _reasons(out) == ["kept", "oversized", "kept"]
    assert out[1]["bytes"] == n and out[1]["id"] == "s/long.jsonl.gz:2"
    assert grown_mib < 64, f"peak RSS grew {grown_mib:.0f} MiB while reading a 256 MiB line"


@pytest.mark.integration
@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_a_decompression_bomb_stops_at_the_ratio_cap_with_one_named_drop(tmp_path, codec):
    """One repeated line, 1 GiB decompressed from ~1 MB: the lines before the ratio cap is judged are read, the
    rest is one ``compression_ratio`` drop naming the file; memory does not follow the decompressed size."""
    import gzip
    import resource
    import zstandard
    from data_pipelines import readers
    from data_pipelines.config import AdmissionConfig

    line = b'{"text": "' + b"spam " * 200 + b'"}\n'
    block = line * ((4 << 20) // len(line))
    path = tmp_path / f"bomb.jsonl.{codec}"
    with (gzip.open(path, "wb", compresslevel=9) if codec == "gzip"
          else zstandard.ZstdCompressor(level=19).stream_writer(open(path, "wb"))) as f:
        for _ in range(256):
            f.write(block)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    counts, last = {}, None
    for e in readers.read_jsonl(str(path), _source(), AdmissionConfig()):
        r = e.get("reason", "kept")
        counts[r] = counts.get(r, 0) + 1
        last = e
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert set(counts) == {"kept", "compression_ratio"} and counts["compression_ratio"] == 1
    assert last["file"] == str(path) and last["lines_read"] == counts["kept"]
    assert counts["kept"] * len(line) < 24 << 20     # stopped soon after the 16 MiB the ratio is judged from
    assert grown_mib < 200, grown_mib               # the kept docs themselves are held by this test: ~20 MiB


def test_a_file_past_the_decompressed_cap_keeps_what_came_before(tmp_path):
    import gzip
    from data_pipelines import readers
    from data_pipelines.config import AdmissionConfig

    lines = [b'{"text": "line %d %s"}' % (i, os.urandom(16).hex().encode()) for i in range(30000)]
    path = tmp_path / "big.jsonl.gz"
    path.write_bytes(gzip.compress(b"\n".join(lines) + b"\n"))
    out = list(readers.read_jsonl(str(path), _source(), AdmissionConfig(max_file_bytes=1 << 20)))
    assert _reasons(out)[-1] == "decompressed_cap" and set(_reasons(out)[:-1]) == {"kept"}
    # the cap is checked per decompressed step: lines within the first 1 MiB only, and at least one step's worth
    kept = len(out) - 1
    assert 0 < kept and sum(len(x) + 1 for x in lines[:kept]) <= 1 << 20
    assert out[-1]["lines_read"] == kept and out[-1]["id"] == f"s/big.jsonl.gz:{kept + 1}"


def test_a_warc_body_that_inflates_is_decoded_only_to_the_cap(tmp_path):
    """A WARC response whose HTTP body is gzip Content-Encoding of 512 MiB (0.5 MB on disk): one ``oversized``
    drop, and the next page is read; the body is never inflated past the cap."""
    import gzip
    import io
    import resource
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter
    from data_pipelines import readers
    from data_pipelines.config import AdmissionConfig

    bomb = io.BytesIO()
    with gzip.GzipFile(fileobj=bomb, mode="wb", compresslevel=9) as g:
        for _ in range(512):
            g.write(b"<p>" + b"a" * ((1 << 20) - 3))
    path = tmp_path / "pages.warc.gz"
    with open(path, "wb") as f:
        w = WARCWriter(f, gzip=True)
        for uri, body, enc in (("http://x/bomb", bomb.getvalue(), [("Content-Encoding", "gzip")]),
                               ("http://x/ok", b"<html><body><p>" + b"Hello world. " * 30 + b"</p></body></html>", [])):
            http = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")] + enc,
                                    protocol="HTTP/1.1")
            w.write_record(w.create_warc_record(uri, "response", payload=io.BytesIO(body), http_headers=http))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = list(readers.read_warc(str(path), _source("warc"), AdmissionConfig(max_record_bytes=1 << 20)))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert _reasons(out) == ["oversized", "kept"] and out[0]["id"] == "s/http://x/bomb"
    assert grown_mib < 64, grown_mib


def test_a_parquet_value_is_checked_from_its_length_before_it_is_decoded(tmp_path):
    """A 64 MiB value dictionary-encoded over 2,000 rows (128 GB if each row were decoded; the file is small):
    each of those rows is an ``oversized`` drop from the value's length; the good rows around are kept. A row
    group whose text column is past ``max_file_bytes`` uncompressed is dropped as ``decompressed_cap``, unread."""
    import resource
    import pyarrow as pa
    import pyarrow.parquet as pq
    from data_pipelines import readers
    from data_pipelines.config import AdmissionConfig

    values = pa.array(["a good row of text", "b" * (64 << 20), "another good row"])
    column = pa.DictionaryArray.from_arrays(pa.array([0] + [1] * 2000 + [2], pa.int32()), values)
    path = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"text": column}), path, compression="zstd")
    assert path.stat().st_size < 4 << 20
    del values, column
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = list(readers.read_parquet(str(path), _source("parquet"), AdmissionConfig(max_record_bytes=1 << 20)))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert _reasons(out) == ["kept"] + ["oversized"] * 2000 + ["kept"]
    assert out[1]["bytes"] == 64 << 20
    assert grown_mib < 512, grown_mib   # the dictionary's one value (64 MiB) and Arrow's buffers, not 2,000 copies

    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"text": ["x" * 1000] * 3000}), plain, row_group_size=1000, use_dictionary=False)
    out = list(readers.read_parquet(str(plain), _source("parquet"), AdmissionConfig(max_file_bytes=200_000)))
    assert _reasons(out) == ["decompressed_cap"] * 3000


@pytest.mark.integration
def test_html_extraction_past_its_time_budget_is_counted_and_the_next_page_is_extracted():
    """A page whose extraction takes longer than the budget is an ``extraction_timeout`` drop (the worker is
    killed); the next page is extracted in a fresh worker. The slow page takes > 1 s here (a 2 MB table).

    A budget counts the page's extraction only, not the worker's start-up (a spawned interpreter importing
    trafilatura: about 1 s, more on a loaded host): with a 0.5 s budget, a normal page is extracted by a new worker,
    after a timeout and in a thread of its own. Before, the start-up was counted, and every page after a timeout
    timed out in turn (a build fed a thousand such pages ran for hours)."""
    import threading
    import time
    from data_pipelines.steps import extraction

    cells = "".join(f"<tr><td>{i}</td><td>cell text {i}</td></tr>" for i in range(40000))
    slow = {"id": "slow", "source": "s", "domain": "web", "html": True,
            "text": f"<html><body><table>{cells}</table></body></html>"}
    ok = {"id": "ok", "source": "s", "domain": "web", "html": True,
          "text": "<html><body><article><p>" + "A sentence of main text. " * 40 + "</p></article></body></html>"}
    extraction.extract_main_text(ok, 60.0)
    t = time.monotonic()
    timed_out = extraction.extract_main_text(slow, 0.3)
    assert time.monotonic() - t < 5
    assert timed_out["reason"] == "extraction_timeout" and timed_out["id"] == "slow"
    after = extraction.extract_main_text(ok, 0.5)                # a new worker starts first; its start-up is not counted
    assert "A sentence of main text." in after.get("text", ""), after

    def cold_start(out):                                       # another thread has its own worker, started on use
        out["doc"] = extraction.extract_main_text(ok, 0.5)
        extraction._EXTRACTORS.pool.terminate()
    out = {}
    th = threading.Thread(target=cold_start, args=(out,))
    th.start()
    th.join()
    assert "A sentence of main text." in out["doc"].get("text", ""), out["doc"]
    t = time.monotonic()
    unbounded = extraction.extract_main_text(slow, 0)           # the same page without a budget: it does finish
    assert time.monotonic() - t > 0.3 and "cell text" in unbounded["text"]


@pytest.mark.integration
def test_a_document_line_past_the_limit_is_refused_before_it_is_held_wherever_documents_are_read(tmp_path):
    """The readers of document files outside the corpus build (prepare, the trainer's and evaluation's
    `documents.read_documents`) refuse a line past their limit as ``oversized``, naming file and line, without
    holding it: a 16 MiB line read with a 4 MiB limit grows memory by far less than the line. Before, prepare held
    any line and tokenized it (a 48 MiB line took it past 14 GB), and the trainer's reader the same."""
    import gzip
    import resource

    from jaxpt.data import documents, prepare
    from jaxpt.util.errors import FileFormatError

    path = tmp_path / "docs.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b'{"text": "a good document before the long one"}\n{"text": "')
        for _ in range(16):
            f.write(os.urandom(1 << 19).hex().encode())
        f.write(b'"}\n{"text": "a good document after it"}\n')
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(documents.DocumentFormatError) as e:
        prepare.clean_and_split([str(path)], prepare.PrepareSettings())
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert e.value.reason == "oversized" and e.value.line == 2 and str(path) in str(e.value)
    assert f"{(16 << 20) + 12:,} bytes" in str(e.value) and "--max-document-bytes" in str(e.value), str(e.value)
    assert grown_mib < 12, grown_mib
    with pytest.raises(FileFormatError, match=r"docs.jsonl.gz:2: oversized"):
        documents.read_documents(path)
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "' + "x" * 2000 + '"}\n')
    assert len(documents.read_documents(small)) == 1
    with pytest.raises(documents.DocumentFormatError, match="small.jsonl:1: oversized"):
        prepare.clean_and_split([str(small)], prepare.PrepareSettings(), max_document_bytes=1000)
    proc = subprocess.run([sys.executable, "-m", "jaxpt.data.prepare", "--source", str(small), "--output",
                           str(tmp_path / "out"), "--max-document-bytes", "1000"], capture_output=True, text=True)
    assert proc.returncode == 2 and "small.jsonl:1: oversized" in proc.stderr and not (tmp_path / "out").exists()


def test_a_json_file_that_is_not_json_is_named_wherever_a_tool_reads_one(tmp_path, capsys):
    """A truncated or wrong file where a JSON record is expected (a run.json, a compile report, an evaluation report)
    is refused naming the file and what it should be, and a listing over many runs says which one it skipped:
    never an anonymous "Expecting value" or a silently shorter list."""
    from jaxpt.tools import evaluate, gate, runs
    from jaxpt.util import fs
    bad = tmp_path / "broken" / "run.json"
    bad.parent.mkdir()
    bad.write_text('{"run_id": "r1", "status": ')  # a writer killed mid-file
    with pytest.raises(ConfigError, match=rf"{bad}: not valid JSON \(a run record\): Expecting value"):
        fs.read_json(str(bad), "a run record")
    # A directory given where the JSON file is expected (plan --rules DIR crashed with IsADirectoryError).
    with pytest.raises(ConfigError, match=rf"{bad.parent}: a directory where a file was expected \(a run record\)"):
        fs.read_json(str(bad.parent), "a run record")
    with pytest.raises(ConfigError, match=rf"{bad}: not valid JSON \(a run record\)"):
        runs.load_run(str(bad.parent))
    with pytest.raises(ConfigError, match=rf"{bad}: not valid JSON \(the run record\)"):
        gate._run_json(str(bad.parent))
    good = tmp_path / "ok" / "run.json"
    good.parent.mkdir()
    good.write_text('{"run_id": "r2", "started": "2026-12-04T00:00:00"}')
    assert [r["run_id"] for r in runs.find_runs(str(tmp_path))] == ["r2"]
    assert f"warning: skipped {bad}: {bad}: not valid JSON" in capsys.readouterr().err
    sheet = tmp_path / "report.safety.jsonl"
    sheet.write_text('{"set": "harmful"}\n{"set": "refusal"}\n')
    assert evaluate.main(["compare", str(sheet), str(sheet)]) == 2
    assert f"{sheet}: not valid JSON (a report is one JSON object" in capsys.readouterr().err


def test_a_pretty_printed_json_document_given_as_json_lines_is_named_as_such(tmp_path):
    """An indented JSON document or a JSON array where JSON Lines is expected (a runs file, a documents file) is
    refused at its first line with the usual cause said, in the shared line reader every JSON Lines file goes
    through; a plain broken line gets no such guess."""
    import json
    from jaxpt.lab import scaling
    from jaxpt.util import jsonl
    from jaxpt.util.errors import FileFormatError
    pretty = tmp_path / "runs.jsonl"
    pretty.write_text(json.dumps({"name": "r1", "lr": 1e-3}, indent=1) + "\n")
    with pytest.raises(FileFormatError, match=rf"{pretty}:1: bad_json: not JSON .*; a pretty-printed JSON document\? "
                       "JSON Lines holds one whole object per line"):
        scaling.read_grid_runs([str(tmp_path)])
    array = tmp_path / "docs.jsonl"
    array.write_text('[{"text": "a"}, {"text": "b"}]\n')
    with pytest.raises(FileFormatError, match=rf"{array}:1: not_an_object: a JSON list, not an object \(a JSON array: "
                       "JSON Lines holds one object per line\\)"):
        jsonl.read_objects(str(array))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "unterminated\n')
    with pytest.raises(FileFormatError, match=rf"{broken}:1: bad_json: not JSON \(Unterminated string") as e:
        jsonl.read_objects(str(broken))
    assert "pretty-printed" not in str(e.value)
