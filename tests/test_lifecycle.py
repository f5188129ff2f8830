"""A run's start answers each question once: one validation, one vocabulary resolution, one lineage trace with one
admission per candidate checkpoint, one metadata read per checkpoint, one data version; for a fresh run, a resume,
a stage started from ``init_from`` and a start from a converted model (``jaxpt.run``: resolve -> build -> lineage
-> loop).

The counters wrap the functions themselves (every module binding of each), so a second call from anywhere counts.
Before the lifecycle had one home, a fresh run validated twice and a resume read its checkpoint's metadata three
times and admitted it twice."""

import collections
import sys

import jax
import pytest

from conftest import tiny_bindings
from jaxpt import config as C
from jaxpt.checkpoint import Checkpointer
from jaxpt.data import stream
from jaxpt.run import lineage, resolve, session, validate

pytestmark = pytest.mark.slow

COUNTED = {"validate": (validate, "validate"), "resolve_vocab": (resolve, "resolve_vocab"),
           "trace": (lineage, "trace"), "admit": (lineage, "admit"), "data_version": (stream, "data_version")}


@pytest.fixture
def counts(monkeypatch):
    """``{name: calls}`` of each counted function (and ``read_meta``: checkpoint metadata reads) while a test runs."""
    seen = collections.Counter()

    def counted(name, original):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return original(*args, **kwargs)
        return wrapper

    for name, (owner, attr) in COUNTED.items():
        original = getattr(owner, attr)
        wrapper = counted(name, original)
        for module in [m for n, m in list(sys.modules.items()) if n.startswith("jaxpt") and m is not None]:
            for key, value in list(vars(module).items()):
                if value is original:
                    monkeypatch.setattr(module, key, wrapper)
    monkeypatch.setattr(Checkpointer, "read_meta", counted("read_meta", Checkpointer.read_meta))
    return seen


def _cfg(prepared, workdir, steps, **extra):
    b = tiny_bindings(prepared, workdir, **{"CheckpointConfig.enabled": "True",
                                            "CheckpointConfig.save_every_steps": "2", **extra})
    return C.parse(["configs/quickstart.gin"], b, steps=steps, mesh="data=2,fsdp=2,tensor=2")


def _run(cfg, counts) -> dict:
    counts.clear()
    session.run_training(cfg)
    return dict(counts)


def test_each_check_runs_once_per_start(prepared_sample, tmp_path, counts):
    base = tmp_path / "base"
    fresh = _run(_cfg(prepared_sample, base, 2), counts)
    assert fresh == {"validate": 1, "resolve_vocab": 1, "trace": 1, "data_version": 1}  # nothing to admit or read

    resumed = _run(_cfg(prepared_sample, base, 4), counts)
    assert resumed == {"validate": 1, "resolve_vocab": 1, "trace": 1, "admit": 1, "read_meta": 1, "data_version": 1}

    staged = _run(_cfg(prepared_sample, tmp_path / "stage", 6, **{"TrainConfig.init_from": repr(str(base))}), counts)
    assert staged == {"validate": 1, "resolve_vocab": 1, "trace": 1, "admit": 1, "read_meta": 1, "data_version": 1}

    converted = _converted_model(prepared_sample, tmp_path / "converted")
    started = _run(_cfg(prepared_sample, tmp_path / "cont", 2, **{"TrainConfig.init_from": repr(converted)}), counts)
    assert started == {"validate": 1, "resolve_vocab": 1, "trace": 1, "admit": 1, "read_meta": 1, "data_version": 1}


def _converted_model(prepared, out) -> str:
    """A params-only checkpoint as ``python -m jaxpt.tools.convert hf-to-jaxpt`` writes one (random params of the
    tiny model, the run's tokenizer), without a Hugging Face model to convert."""
    from jaxpt.data.tokenizer import Tokenizer
    from jaxpt.run import build
    from jaxpt.hf import convert
    cfg = _cfg(prepared, out, 2)
    tok = Tokenizer.load(cfg.data.tokenizer_path)
    built = build.build_for(cfg, tokenizer=tok)
    params = jax.device_get(built.init_state().params)
    convert.write_params_checkpoint(str(out), built.cfg, params, built.mesh, tok, {"path": "a test's random model"})
    return str(out)
