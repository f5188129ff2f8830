"""One contract per file format: the same malformed document files get the same answer from every reader.

Strict readers (every jaxpt entry point that reads documents, and data_pipelines' tokenizer, near-duplicate
evaluation and decontamination eval sets) raise ``DocumentFormatError`` (a ConfigError: exit 2) naming the file,
the 1-based line and the reason. The corpus build's raw reader counts the same line as one drop with the same
reason, and a build over the files completes with counts that add up. metrics.jsonl has its own reader that
tolerates exactly one half-written last line.

Each variant is its own small gzip file: a good line, the bad line (line 2), a good line.
"""

import collections
import gzip
import json
import os
import pathlib
import random

import pytest

from data_pipelines import build, neardup_eval, readers, testing
from data_pipelines import tokenizer as dt
from data_pipelines.config import AdmissionConfig, BuildConfig, DecontamConfig, Source
from jaxpt.util import jsonl
from jaxpt.run import monitor
from jaxpt.data import documents
from jaxpt.data.documents import DocumentFormatError
from jaxpt.util.errors import ConfigError

BAD_LINE = 2
REPO = pathlib.Path(__file__).resolve().parents[1]


def _record(doc_id: str, text: str | None) -> dict:
    """A raw-v1 schema record (what prepare needs; the others ignore the extra fields)."""
    rec = {"id": doc_id, "source": "t", "domain": "reference", "lang": "en", "url_or_path": doc_id,
           "license": "CC0-1.0"}
    if text is not None:
        rec["text"] = text
    return rec


def _line(rec: dict) -> bytes:
    return json.dumps(rec).encode("utf-8")


def _good(i: int) -> bytes:
    rng = random.Random(i)
    return _line(_record(f"t/good-{i}", testing.prose(rng, testing.EN, 2)))


#: variant -> (bad line 2, the reason every reader gives). One reason per variant, computed independently of
#: the readers: these are the names `jaxpt.util.jsonl` and `jaxpt.data.documents` document.
VARIANTS = {
    "blank_line": (b"", "blank_line"),
    "bad_json": (b'{"id": "t/broken", "text": "unterminated', "bad_json"),
    "invalid_utf8": (b'{"id": "t/utf8", "text": "caf\xc3\x28 au lait"}', "invalid_utf8"),
    "missing_text": (_line(_record("t/notext", None)), "missing_text"),
    "not_an_object": (b"[1, 2, 3]", "not_an_object"),
}


def _write_variant(directory, name: str) -> str:
    bad, _ = VARIANTS[name]
    path = directory / f"{name}.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"\n".join([_good(1), bad, _good(3)]) + b"\n")
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from jaxpt.data import tokenizer as tokenizer_lib
    rng = random.Random(0)
    path = tokenizer_lib.train_sentencepiece([testing.prose(rng, testing.EN, 5) for _ in range(60)],
                                             tmp_path_factory.mktemp("tok") / "t.model", 400)
    return tokenizer_lib.Tokenizer.load(path)


def _assert_names(err: Exception, path: str, reason: str, where: str = "") -> None:
    assert isinstance(err, DocumentFormatError) and isinstance(err, ConfigError), (where, type(err))
    assert (err.path, err.line, err.reason) == (path, BAD_LINE, reason), where
    assert f"{path}:{BAD_LINE}: {reason}:" in str(err), where


def _strict_entry_points(root, path: str, tokenizer) -> dict:
    """name -> a call that reads the document file ``path`` (the one file in ``root/src``) as that entry
    point does."""
    from jaxpt.data import loader
    from jaxpt.data import prepare as prepare_lib
    from jaxpt.eval import heldout

    deco = BuildConfig(source_root=str(root), decontam=DecontamConfig(eval_sets={"probe": "src/*.jsonl.gz"}))
    return {
        "train_path (loader.make_train_dataset)": lambda: loader.make_train_dataset(
            path, tokenizer, seq_len=16, local_batch_size=2, seed=0),
        "loader.make_eval_dataset": lambda: loader.make_eval_dataset(
            path, tokenizer, seq_len=16, batch_size=2),
        "loader.document_ids": lambda: loader.document_ids(path),
        "jaxpt.data.prepare": lambda: prepare_lib.prepare(root / "src", root / "prepared"),
        "heldout_path (jaxpt.eval.heldout.load_documents)": lambda: heldout.load_documents(path),
        "jaxpt.eval.heldout.training_texts": lambda: list(heldout.training_texts(path)),
        "data_pipelines.neardup_eval": lambda: neardup_eval.read_raw_docs(root, "src/*.jsonl.gz"),
        "decontamination eval sets": lambda: build.load_eval_index(deco),
    }


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_strict_reader_raises_the_same_error_naming_file_and_line(variant, tmp_path, tokenizer):
    (tmp_path / "src").mkdir()
    path = _write_variant(tmp_path / "src", variant)
    # The tokenizer reads a prepared sample: train.jsonl.gz (here the bad file) and heldout.jsonl.gz.
    (tmp_path / "sample").mkdir()
    sample_train = str(tmp_path / "sample" / "train.jsonl.gz")
    os.link(path, sample_train)
    os.link(path, tmp_path / "sample" / "heldout.jsonl.gz")
    calls = _strict_entry_points(tmp_path, path, tokenizer)
    calls["data_pipelines.tokenizer.read_corpus"] = lambda: dt.read_corpus(tmp_path / "sample", 0.1)
    calls["heldout set at training setup (inloop.load_heldout)"] = _training_heldout(tmp_path, variant, path)[1]
    assert len(calls) == 10
    for name, call in calls.items():
        with pytest.raises(DocumentFormatError) as info:
            call()
        want_path = sample_train if name.startswith("data_pipelines.tokenizer") else path
        _assert_names(info.value, want_path, VARIANTS[variant][1], name)


def _training_heldout(tmp_path, variant: str, path: str | None = None):
    """The trainer's held-out set (``DataConfig.heldout_path``), read at setup by ``inloop.load_heldout``."""
    from conftest import tiny_bindings
    from jaxpt import config as config_lib
    from jaxpt.eval import inloop

    path = path or _write_variant(tmp_path, variant)
    cfg = config_lib.parse([str(REPO / "configs" / "quickstart.gin")], tiny_bindings(
        tmp_path, tmp_path / "run", **{"DataConfig.heldout_path": repr(path)}))
    return path, lambda: inloop.load_heldout(cfg)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_training_heldout_set_names_file_line_and_reason(variant, tmp_path):
    path, call = _training_heldout(tmp_path, variant)
    with pytest.raises(ConfigError) as info:
        call()
    assert f"{path}:{BAD_LINE}: {VARIANTS[variant][1]}:" in str(info.value)


def test_training_heldout_set_raises_the_document_error_itself(tmp_path):
    _, call = _training_heldout(tmp_path, "blank_line")
    with pytest.raises(DocumentFormatError):
        call()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cli_entry_points_exit_2_naming_file_and_line(variant, tmp_path, capsys):
    """The command lines: prepare, the tokenizer (on a prepared sample) and evaluate's spot-check builder."""
    from jaxpt.data import prepare as prepare_lib
    from jaxpt.tools import evaluate

    path = _write_variant(tmp_path, variant)
    want = f"{path}:{BAD_LINE}: {VARIANTS[variant][1]}:"
    with pytest.raises(SystemExit) as info:
        prepare_lib.main(["--source", str(tmp_path), "--output", str(tmp_path / "out")])
    assert info.value.code == 2 and want in capsys.readouterr().err
    sample = tmp_path / "sample"
    sample.mkdir()
    os.link(path, sample / "train.jsonl.gz")
    os.link(path, sample / "heldout.jsonl.gz")
    tok_argv = ["--config", str(dt.DEFAULT_CONFIG), "--corpus", str(sample), "--output", str(tmp_path / "tok")]
    assert dt.main(tok_argv) == 2
    assert f"{sample / 'train.jsonl.gz'}:{BAD_LINE}: {VARIANTS[variant][1]}:" in capsys.readouterr().err
    assert evaluate.main(["spot-check-build", "--heldout", path, "--output", str(tmp_path / "s.jsonl")]) == 2
    assert want in capsys.readouterr().err


def _source(path: str) -> Source:
    return Source(name="t", domain="reference", path=path, format="jsonl", license="CC0-1.0", acquired="2026-11-29")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_corpus_build_counts_the_same_line_as_one_drop_by_the_same_reason(variant, tmp_path):
    path = _write_variant(tmp_path, variant)
    out = list(readers.read_jsonl(path, _source(path), AdmissionConfig()))
    assert len(out) == 3  # one element per line
    drops = [o for o in out if "verdict" in o]
    # A line that parses to an object keeps its own id; others get "<source>/<file>:<line>".
    want_id = "t/notext" if variant == "missing_text" else f"t/{variant}.jsonl.gz:{BAD_LINE}"
    assert [(d["id"], d["verdict"]) for d in drops] == [(want_id, f"admission:{VARIANTS[variant][1]}")]
    assert [o["id"] for o in out if "verdict" not in o] == ["t/good-1", "t/good-3"]


def _truncated(directory, n_good: int) -> str:
    """A gzip file of ``n_good`` + 1 records, cut inside its last record's compressed data."""
    long_text = testing.prose(random.Random(99), testing.EN, 400)  # ~25 kB of text, ~8 kB compressed
    raw = b"".join(_good(10 + i) + b"\n" for i in range(n_good)) + _line(_record("t/cut", long_text)) + b"\n"
    full = gzip.compress(raw)
    assert len(full) > 2000
    path = directory / f"cut-{n_good}.jsonl.gz"
    # The last ~8 kB of the stream encode the last record (and the 8-byte trailer): keeping all but the last
    # 200 bytes cuts inside it, after the n_good short records.
    path.write_bytes(full[:-200])
    return str(path)


def test_truncated_gzip_strict_readers_name_file_and_last_good_line(tmp_path):
    for path, n_good in ((_truncated(tmp_path, 4), 4), (str(tmp_path / "t-00000.jsonl.gz"), 0)):
        if n_good == 0:  # the smallest case from the issue: 40 bytes of a one-record file
            (tmp_path / "t-00000.jsonl.gz").write_bytes(
                gzip.compress(b'{"id":"a","text":"one two three four five six"}\n')[:40])
        with pytest.raises(DocumentFormatError) as info:
            documents.read_documents(path)
        e = info.value
        assert (e.path, e.line, e.reason) == (path, n_good, "truncated_file")
        assert f"{path}: truncated_file after line {n_good}:" in str(e)


def test_truncated_gzip_in_the_raw_reader_keeps_the_lines_before_and_counts_one_drop(tmp_path):
    path = _truncated(tmp_path, 4)
    out = list(readers.read_jsonl(path, _source(path), AdmissionConfig()))
    assert [o["id"] for o in out[:4]] == [f"t/good-{10 + i}" for i in range(4)]
    assert all("verdict" not in o for o in out[:4])
    (drop,) = out[4:]
    assert (drop["id"], drop["verdict"], drop["file"], drop["lines_read"]) == (
        f"t/{os.path.basename(path)}:5", "admission:truncated_file", path, 4)
    with pytest.raises(DocumentFormatError, match="truncated_file after line 4"):
        list(readers.read_jsonl(path, _source(path), AdmissionConfig(fail_on_damaged_file=True)))


MINI_BUILD = """
import data_pipelines.config
BuildConfig.data_version = 'contracts-1'
BuildConfig.source_root = '{root}'
BuildConfig.sources = [{{'name': 't', 'domain': 'reference', 'path': '{root}/in/*.jsonl.gz', 'format': 'jsonl',
                        'license': 'CC0-1.0', 'acquired': '2026-11-29'}}]
LangIdConfig.enabled = False
QualityConfig.enabled = False
NearDedupConfig.enabled = False
DecontamConfig.enabled = False
QuotaConfig.enabled = False
OutputConfig.tokenizer_path = '{tokenizer}'
OutputConfig.owner = 'tests'
OutputConfig.shards_per_domain = 1
OutputConfig.decision_shards = 1
"""


@pytest.mark.slow  # one small Beam build: ~15 s
def test_build_over_every_variant_and_a_truncated_file_completes_and_counts_add_up(tmp_path, tokenizer):
    (tmp_path / "in").mkdir()
    for v in VARIANTS:
        _write_variant(tmp_path / "in", v)
    cut = _truncated(tmp_path / "in", 4)
    gin_path = tmp_path / "b.gin"
    gin_path.write_text(MINI_BUILD.format(root=tmp_path, tokenizer=tokenizer.path))
    m = build.run(build.load_config([str(gin_path)], []), str(tmp_path / "out"))
    admission = m["documents_dropped"]["admission"]
    want = collections.Counter(reason for _, reason in VARIANTS.values())
    want["truncated_file"] = 1
    assert {r: admission.get(r, 0) for r in want} == dict(want)
    # documents in: 3 lines per variant file, 4 complete lines + 1 damaged tail in the cut file.
    assert m["documents_in"] == 3 * len(VARIANTS) + 5
    dropped = sum(n for reasons in m["documents_dropped"].values() for n in reasons.values())
    assert m["documents_in"] == m["documents_out"] + m["documents_heldout"] + dropped
    assert m["damaged_input_files"] == [{"file": cut, "source": "t", "lines_read": 4}]
    written = sorted((tmp_path / "out").rglob("*.json"))
    assert any(p.name == "manifest.json" for p in written)
    for p in written:  # standard JSON that strict parsers (jq, JavaScript, SQLite) read: no NaN or Infinity
        _strict_json(p.read_text(encoding="utf-8"), p)
    with pytest.raises(ConfigError, match="truncated_file after line 4"):
        build.run(build.load_config([str(gin_path)], ["AdmissionConfig.fail_on_damaged_file = True"]),
                  str(tmp_path / "out2"))


def _strict_json(text: str, where) -> object:
    def refuse(name):
        raise AssertionError(f"{where}: non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def test_json_writers_write_non_finite_numbers_as_strings_a_strict_parser_reads():
    import numpy as np
    value = {"threshold": float("-inf"), "ok": 0.5, "nested": [np.float32("nan"), (np.float64("inf"), 2)],
             "n": np.int64(3), "flag": True, "none": None}
    text = jsonl.dumps(value, sort_keys=True)
    assert text == ('{"flag": true, "n": 3, "nested": ["nan", ["inf", 2]], "none": null, "ok": 0.5, '
                    '"threshold": "-inf"}')
    assert _strict_json(text, "dumps") == {"flag": True, "n": 3, "nested": ["nan", ["inf", 2]], "none": None,
                                           "ok": 0.5, "threshold": "-inf"}
    assert float(_strict_json(text, "dumps")["threshold"]) == float("-inf")  # readers that take float() still can
    with pytest.raises(TypeError):
        jsonl.dumps({"x": object()})


# ------------------------------------------------------------------------------------------ metrics.jsonl


def test_metrics_reader_tolerates_exactly_one_half_written_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]
    body = "".join(json.dumps(r) + "\n" for r in good)
    path.write_text(body + '{"step": 3, "lo')  # a trainer killed mid-write
    assert monitor.read_metrics(str(tmp_path)) == good
    path.write_text(body + '{"step": 3, "lo\n')  # the same bad line, but ended: not a partial write
    with pytest.raises(monitor.MetricsFormatError, match=rf"{path}:3: bad_json"):
        monitor.read_metrics(str(tmp_path))
    path.write_text('{"step": 1}\n\n{"step": 2}\n')
    with pytest.raises(monitor.MetricsFormatError, match=rf"{path}:2: blank_line"):
        monitor.read_metrics(str(tmp_path))
    path.write_text('{"loss": 1.0}\n')
    with pytest.raises(monitor.MetricsFormatError, match=rf"{path}:1: missing_step"):
        monitor.read_metrics(str(tmp_path))


def test_metric_writer_cuts_a_half_written_line_before_appending(tmp_path):
    """A run resumed after a kill mid-write: the half line is dropped, so it never ends up in the middle."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    w = monitor.MetricWriter(str(tmp_path))
    w.write({"step": 2, "loss": 1.5})
    w.close()
    assert monitor.read_metrics(str(tmp_path)) == [{"step": 1}, {"step": 2, "loss": 1.5}]


def test_tools_read_metrics_through_the_one_reader(tmp_path):
    from jaxpt.tools import drill, runs

    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 3.0, "grad_norm": 1.0, "learning_rate": 0.1}\n'
        '{"step": 2, "event": "final", "heldout_loss": 2.0}\n{"step": 3, "lo')
    assert runs.read_curves(str(tmp_path))["loss"] == [(1, 3.0)]
    assert drill.step_records(str(tmp_path)) == {1: [{"step": 1, "loss": 3.0, "grad_norm": 1.0,
                                                       "learning_rate": 0.1}]}
    assert drill.final_heldout(str(tmp_path)) == 2.0
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    for call in (runs.read_curves, drill.step_records, drill.final_heldout):
        with pytest.raises(monitor.MetricsFormatError, match=r"metrics.jsonl:2: bad_json"):
            call(str(tmp_path))


def test_drill_tail_rereads_an_unfinished_line(tmp_path):
    from jaxpt.tools import drill

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n')
    tail = drill.MetricsTail(str(tmp_path))
    with open(path, "a") as f:
        f.write('{"step": 1}\n{"step": 2, "lo')
    assert tail.poll() == [{"step": 1}]
    jsonl.drop_partial_last_line(path)  # the restarted trainer's writer
    with open(path, "a") as f:
        f.write('{"step": 2, "loss": 1.0}\n')
    assert tail.poll() == [{"step": 2, "loss": 1.0}]
