"""Test-wide setup. Runs before any test module imports jax."""

import contextlib
import fcntl
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

# The tiers' hooks (tests/tiers.py): the markers set at collection, the unit tier's checks, the summary.
from tiers import pytest_runtest_call, pytest_runtest_makereport, pytest_runtest_setup  # noqa: F401  (hooks)
import tiers


def simulated_cpu_flags(devices: int = 8) -> str:
    """XLA_FLAGS for `devices` simulated CPU devices.

    The simulated devices share the host's cores, and each in-process collective waits for all of its
    participant threads. On a loaded 2-core CI host a participant can arrive more than XLA's default 40 s
    after the first, and XLA then aborts the process ("Termination timeout ... Expected 4 threads to join
    the rendezvous"), so the collective timeouts are raised to 10 minutes (flags from openxla/xla#32115).
    The thread pools the devices share are sized by ``PJRT_NPROC`` (:data:`PJRT_NPROC`), set below.
    """
    return (f"--xla_force_host_platform_device_count={devices} "
            "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60 "
            "--xla_cpu_collective_call_terminate_timeout_seconds=600 "
            "--xla_cpu_collective_timeout_seconds=600")


# Eight simulated CPU devices so sharding is tested on a real mesh, not one device. This must happen before
# jax is imported anywhere in the test process.
os.environ["XLA_FLAGS"] = simulated_cpu_flags(8)

#: Threads of XLA:CPU's two pools (the client's, which runs each device's program, and the intra-op one, which runs
#: its thunks), read when the CPU client starts; XLA's default is max(cores, devices), 8 on a 2-core host. A
#: collective holds its intra-op thread while it waits in the rendezvous, and the stage=4 step loaded from the
#: persistent compilation cache can have two collectives waiting on one device; on 8 threads the first devices then
#: hold every thread, their partners get none, and XLA aborts at the terminate timeout (the SIGABRT of
#: test_pipeline.py::test_restores_across_pipeline_layouts; benchmarks/repro/cpu_collective_starvation.py). 4 threads
#: per device; inherited by every child process the tests start.
PJRT_NPROC = 4 * 8
os.environ.setdefault("PJRT_NPROC", str(PJRT_NPROC))

# With the `tpu` extra installed, jax would also try to start libtpu (and take its one-process lockfile);
# tests run on CPU. Tests that compile for TPU topologies do so in a subprocess (tests/test_compile.py).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RAW_V1 = REPO_ROOT.parent / "shared" / "corpus" / "raw-v1"


def run_in_child(function, directory: pathlib.Path, *, timeout: float = 1200):
    """Run ``function(directory)``, a module-level function of a test module, in a fresh Python process with this
    session's environment (simulated devices, thread pools, compilation cache): an abort inside XLA's runtime then
    fails the test with XLA's message and every thread's Python stack instead of taking a pytest-xdist worker
    down with them. Any failure fails at once, a death by signal included (never rerun).

    Raises ``pytest.fail`` with the child's exit status and its stderr's last 6,000 characters."""
    code = ("import importlib, pathlib, sys; sys.path[:0] = [sys.argv[1]]; "
            "getattr(importlib.import_module(sys.argv[2]), sys.argv[3])(pathlib.Path(sys.argv[4]))")
    directory.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-X", "faulthandler", "-c", code, str(pathlib.Path(__file__).parent),
            function.__module__, function.__name__, str(directory)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if proc.returncode != 0:
        pytest.fail(f"{function.__name__} in a child process exited {proc.returncode}; stderr ends:\n"
                    f"{proc.stderr[-6000:]}", pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the tier markers must be on the items by then
def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker (tests/tiers.py). Tests marked ``first`` go to the front of the run, the
    rest keep their order. pytest-xdist hands out the first tests one per worker, so a long test marked ``first``
    (the whole raw-v1 build: about 9 minutes on one core) runs beside the rest of the suite instead of starting
    late and leaving the other worker idle at the end."""
    tiers.mark_tiers(items)
    items.sort(key=lambda item: item.get_closest_marker("first") is None)


def pytest_terminal_summary(terminalreporter):
    tiers.terminal_summary(terminalreporter)


@pytest.fixture(scope="session")
def raw_v1_dir() -> pathlib.Path:
    """The full raw-v1 corpus; tests using it skip (with the reason) when it is not next to the repo."""
    if not (RAW_V1 / "MANIFEST.json").is_file():
        pytest.skip(f"raw-v1 corpus not found at {RAW_V1}")
    return RAW_V1


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared_dir(tmp_path_factory, worker_id: str, name: str, build) -> pathlib.Path:
    """A directory built once per test session by ``build(path)``, even across pytest-xdist workers: the first
    worker to ask builds it under a file lock in the session's base temp folder, the others wait and reuse it
    (a ``.done`` marker tells a finished build from one that died half-way, which is rebuilt). Callers must treat
    it as read-only: every worker sees the same files."""
    if worker_id == "master":
        path = tmp_path_factory.getbasetemp() / name
        if not path.exists():
            build(path)
        return path
    root = tmp_path_factory.getbasetemp().parent
    path = root / name
    with _locked(root / f"{name}.lock"):
        if not (path / ".done").exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            (path / ".done").touch()
    return path


@pytest.fixture(scope="session")
def worker_id(request) -> str:
    """The pytest-xdist worker's id (``gw0``, ...), or ``master`` without xdist."""
    return getattr(request.config, "workerinput", {}).get("workerid", "master")


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory, worker_id) -> pathlib.Path | None:
    """One persistent JAX compilation cache for the whole test session (both xdist workers and every trainer
    subprocess they start, through ``JAX_COMPILATION_CACHE_DIR``), so a program compiled by one test (the tiny
    model's train step, say) is loaded, not compiled again, by the next test that builds the same program.

    Correctness: an entry is keyed by the program's HLO, the compile options, the XLA flags, the devices and the
    jax/jaxlib version, so only an identical program is ever loaded; a half-written entry read by another process
    fails to decompress and is compiled afresh (a warning, never a wrong program). The trainer's ``'auto'`` setting
    (``TrainConfig.compilation_cache_dir``) picks this directory up; tests of the cache itself set their own
    (tests/test_compile_cache.py, tests/test_checkpoint.py). ``JAXPT_TEST_COMPILATION_CACHE=0`` turns it off."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    if os.environ.get("JAXPT_TEST_COMPILATION_CACHE", "1") == "0":
        return None
    base = tmp_path_factory.getbasetemp()
    path = (base if worker_id == "master" else base.parent) / "jax_compilation_cache"
    path.mkdir(exist_ok=True)
    # Every program, however quick to compile: most of a tiny test model's programs compile in under JAX's default
    # 1 s threshold, and loading one costs less than compiling it (measured on tests/test_batch_ramp.py: 82 s of
    # CPU without the cache, 69 s with the 1 s threshold, 63 s with none).
    os.environ.update(JAX_COMPILATION_CACHE_DIR=str(path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax_cache.reset_cache()  # a cache object made during collection would keep the old (no) directory
    return path


@pytest.fixture
def without_session_compilation_cache():
    """For one test, no JAX cache directory set (as outside the tests), so the trainer's ``'auto'`` cache setting
    falls back to ``<workdir>/jax_cache``; the session's cache (:func:`compilation_cache`) is restored after it."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    previous, env = jax.config.jax_compilation_cache_dir, os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    jax.config.update("jax_compilation_cache_dir", None)
    jax_cache.reset_cache()
    yield
    if env is not None:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = env
    jax.config.update("jax_compilation_cache_dir", previous)
    jax_cache.reset_cache()


@pytest.fixture(scope="session")
def prepared_sample(tmp_path_factory, worker_id) -> pathlib.Path:
    """The bundled sample prepared as `make quickstart` does, with a small (2048-piece) tokenizer for speed.
    Prepared once per session and shared by the xdist workers (read-only; see :func:`shared_dir`): preparing
    trains a tokenizer, which took ~100 s per worker on a loaded CI host."""
    from jaxpt.data.prepare import PrepareSettings, prepare

    def build(out: pathlib.Path) -> None:
        out.mkdir(parents=True)
        prepare(REPO_ROOT / "data" / "sample", out, PrepareSettings(vocab_size=2048))
        _write_small_heldout(out / "heldout.jsonl.gz", out / HELDOUT_SMALL)

    return shared_dir(tmp_path_factory, worker_id, "prepared", build)


# The prepared held-out set is ~600 documents (~280k tokens): scoring all of it at the end of every tiny test run
# cost more than the run itself. Tests train on the full train split and, by default (tiny_bindings), finish with
# an evaluation of this subset: the shortest documents of each domain up to 6,000 characters per domain (about
# 8k tokens, every domain present). Tests that need the whole set point DataConfig.heldout_path at heldout.jsonl.gz.
HELDOUT_SMALL = "heldout_small.jsonl.gz"


def _heldout_file(prepared: pathlib.Path) -> pathlib.Path:
    small = prepared / HELDOUT_SMALL
    return small if small.exists() else prepared / "heldout.jsonl.gz"


def _write_small_heldout(src: pathlib.Path, dst: pathlib.Path, chars_per_domain: int = 6000) -> None:
    import gzip
    import json
    docs = [json.loads(line) for line in gzip.open(src, "rt")]
    keep = []
    for domain in sorted({d.get("domain") for d in docs}, key=str):
        total = 0
        for d in sorted((d for d in docs if d.get("domain") == domain), key=lambda d: (len(d["text"]), d["id"])):
            if total and total + len(d["text"]) > chars_per_domain:
                break
            keep.append(d)
            total += len(d["text"])
    with gzip.open(dst, "wt") as f:
        f.writelines(json.dumps(d) + "\n" for d in keep)


def tiny_bindings(prepared: pathlib.Path, workdir: pathlib.Path, **overrides) -> list[str]:
    """gin bindings for a fast run on the prepared sample: the quickstart config with a small model, evaluated on
    the small held-out subset (:data:`HELDOUT_SMALL`) where ``prepared`` has one (the shared prepared sample),
    else on ``prepared/heldout.jsonl.gz`` (tests that build their own data folder choose their own held-out)."""
    b = {
        "DataConfig.train_path": repr(str(prepared / "train.jsonl.gz")),
        "DataConfig.heldout_path": repr(str(_heldout_file(prepared))),
        "DataConfig.tokenizer_path": repr(str(prepared / "tokenizer.model")),
        "ModelConfig.d_model": "64", "ModelConfig.num_layers": "2", "ModelConfig.num_heads": "4",
        "ModelConfig.num_kv_heads": "2", "ModelConfig.head_dim": "16", "ModelConfig.mlp_dim": "128",
        "ModelConfig.max_seq_len": "64", "TrainConfig.seq_len": "64", "TrainConfig.global_batch_size": "16",
        "TrainConfig.log_every": "1", "TrainConfig.eval_batches": "2", "TrainConfig.eval_every": "0",
        "TrainConfig.progress_bar": "False", "TrainConfig.workdir": repr(str(workdir)),
        "OptimizerConfig.warmup_steps": "5", "OptimizerConfig.decay_steps": "100",
        "CheckpointConfig.enabled": "False",
    }
    b.update({k: str(v) for k, v in overrides.items()})
    return [f"{k} = {v}" for k, v in b.items()]


def packed_batch(built, rows: int, length: int, vocab: int, seed: int) -> dict:
    """A synthetic packed global batch placed with ``built``'s batch shardings: two documents per row (12 tokens,
    then ``length - 16``), the last 4 positions padding (segment id 0); tokens uniform in [1, vocab)."""
    import jax
    import numpy as np
    rng = np.random.default_rng(seed)
    segs = np.concatenate([np.full((rows, 12), 1), np.full((rows, length - 16), 2), np.zeros((rows, 4))],
                          1).astype(np.int32)
    pos = np.concatenate([np.arange(12), np.arange(length - 16), np.arange(4)]).astype(np.int32)
    host = {"tokens": rng.integers(1, vocab, size=(rows, length), dtype=np.int32), "segment_ids": segs,
            "positions": np.broadcast_to(pos, (rows, length)).copy()}
    return {k: jax.device_put(v, built.batch_shardings()[k]) for k, v in host.items()}


def hf_logits(model, tokens):
    """transformers' logits of ``model`` (a torch CausalLM) for int ``tokens`` [B, L]: float32 numpy [B, L, V]."""
    import numpy as np
    import torch
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def jaxpt_logits(restored, tokens):
    """jaxpt's logits of a restored run's model for ``tokens`` [B, L] (one segment per row): numpy [B, L, V]."""
    import jax
    import numpy as np
    from flax import nnx
    seg = np.ones_like(tokens)
    pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    graphdef, state = nnx.split(restored.model)
    return np.asarray(jax.jit(lambda s, t, g, p: nnx.merge(graphdef, s)(t, g, p))(state, tokens, seg, pos))


def word_documents(path, n: int, seed: int, words, max_words: int):
    """Write ``n`` gzip JSON Lines documents ``{"id", "text"}`` to ``path``: each text 3..max_words-1 words drawn
    from ``words`` by numpy's default_rng(seed). Returns ``path``."""
    import gzip
    import json
    import numpy as np
    rng = np.random.default_rng(seed)
    with gzip.open(path, "wt") as f:
        for i in range(n):
            text = " ".join(rng.choice(words, size=int(rng.integers(3, max_words))))
            f.write(json.dumps({"id": str(i), "text": text}) + "\n")
    return path
