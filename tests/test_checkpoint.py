"""Checkpoints: a resumed run is the same run (losses, learning rates, batch documents, RNG and params
bitwise equal to an uninterrupted run on CPU), through clean exits, SIGTERM and SIGKILL (inside
asynchronous saves too); resharding onto other meshes and device counts; clear errors for checkpoints
that cannot be used; the keep policy; ``jaxpt.restore``, greedy generation and the notebook.

Training runs are separate ``python -m jaxpt.train`` processes (each resume builds a new process and a new
data pipeline), sharing a persistent JAX compilation cache so only the first one compiles.
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO_ROOT, shared_dir, simulated_cpu_flags, tiny_bindings
from jaxpt.tools import drill
from jaxpt.checkpoint import CheckpointConfig, CheckpointError, Checkpointer

SAVE_EVERY = 2
REF_STEPS = 30
# What the drill forces on its trainers, so the reference run below can serve it (--reference).
DRILL_BINDINGS = {"TrainConfig.log_every": "1", "TrainConfig.log_batch_documents": "True",
                  "TrainConfig.progress_bar": "False", "CheckpointConfig.enabled": "True",
                  "CheckpointConfig.async_save": "True", "CheckpointConfig.save_every_steps": str(SAVE_EVERY)}


# ------------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="session")
def ckpt_env(prepared_sample, tmp_path_factory, worker_id) -> dict:
    """Data with a small held-out set (the final evaluation stays cheap) and a shared compilation cache."""
    def build(path):
        path.mkdir(parents=True)
        for name in ("train.jsonl.gz", "tokenizer.model"):
            os.symlink(prepared_sample / name, path / name)
        with gzip.open(prepared_sample / "heldout.jsonl.gz", "rt") as f:
            lines = f.readlines()[:8]
        with gzip.open(path / "heldout.jsonl.gz", "wt") as f:
            f.writelines(lines)
        (path / "jax_cache").mkdir()
    path = shared_dir(tmp_path_factory, worker_id, "ckpt_data", build)
    return {"data": path, "cache": path / "jax_cache"}


def bindings(env: dict, workdir: pathlib.Path, **overrides) -> list[str]:
    return tiny_bindings(env["data"], workdir, **{**DRILL_BINDINGS, **overrides})


def trainer_env(env: dict, devices: int = 8) -> dict:
    e = dict(os.environ)
    e.update(XLA_FLAGS=simulated_cpu_flags(devices), PYTHONPATH=str(REPO_ROOT),
             JAX_COMPILATION_CACHE_DIR=str(env["cache"]), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    return e


def trainer_cmd(env: dict, workdir: pathlib.Path, steps: int, mesh: str = "data=2,fsdp=2,tensor=2",
                **overrides) -> list[str]:
    cmd = [sys.executable, "-m", "jaxpt.train", "--config", "configs/quickstart.gin",
           "--workdir", str(workdir), "--steps", str(steps), "--mesh", mesh]
    for b in bindings(env, workdir, **overrides):
        cmd += ["--gin", b]
    return cmd


def train(env: dict, workdir: pathlib.Path, steps: int, devices: int = 8, expect_rc: int = 0, **kw):
    """Run ``python -m jaxpt.train`` to completion; returns the CompletedProcess."""
    proc = subprocess.run(trainer_cmd(env, workdir, steps, **kw), cwd=REPO_ROOT, env=trainer_env(env, devices),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == expect_rc, proc.stderr[-3000:]
    return proc


def events(workdir: pathlib.Path) -> list[dict]:
    with open(workdir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "event" in r]


def assert_same_trajectory(ref: pathlib.Path, got: pathlib.Path, steps: range):
    """Every logged record of ``got`` for ``steps`` equals ``ref``'s bitwise (loss, lr, grad norm, ...),
    every step is there, and every logged batch holds the same documents."""
    r_rec, g_rec = drill.step_records(str(ref)), drill.step_records(str(got))
    r_doc, g_doc = drill.batch_documents(str(ref)), drill.batch_documents(str(got))
    for s in steps:
        assert g_rec.get(s), f"step {s} missing"
        for rec in g_rec[s]:
            for k in drill.DETERMINISTIC_KEYS:
                assert rec[k] == r_rec[s][-1][k], (s, k, rec[k], r_rec[s][-1][k])
        assert g_doc.get(s) and all(d == r_doc[s][-1] for d in g_doc[s]), f"step {s}: other documents"


@pytest.fixture(scope="session")
def reference30(ckpt_env, tmp_path_factory, worker_id) -> pathlib.Path:
    """An uninterrupted 30-step run (shuffling on), checkpoints every 2 steps."""
    return shared_dir(tmp_path_factory, worker_id, "reference30",
                       lambda p: train(ckpt_env, p, REF_STEPS))


@pytest.fixture(scope="session")
def trained10(ckpt_env, tmp_path_factory, worker_id) -> pathlib.Path:
    """The same run, trained by its own process to step 10 (checkpoints 6, 8, 10 kept)."""
    return shared_dir(tmp_path_factory, worker_id, "trained10", lambda p: train(ckpt_env, p, 10))


def copy_run(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".done"))
    return dst


# ------------------------------------------------------------------------------------------ resumption


@pytest.mark.slow
def test_chained_resumes_equal_an_uninterrupted_run(ckpt_env, trained10, reference30, tmp_path):
    """10 steps, then --steps 20, then --steps 30, each a new process and pipeline: steps 1-30 have the
    losses, learning rates, grad norms and batch documents of the uninterrupted 30-step run, bitwise."""
    run = copy_run(trained10, tmp_path / "run")
    train(ckpt_env, run, 20)
    train(ckpt_env, run, 30)
    assert [(e["event"], e["step"]) for e in events(run) if e["event"] in ("start", "resume")] == [
        ("start", 0), ("resume", 10), ("resume", 20)]
    assert_same_trajectory(reference30, run, range(1, REF_STEPS + 1))
    final = {e["event"]: e for e in events(run)}["final"]
    assert final["heldout_loss"] == {e["event"]: e for e in events(reference30)}["final"]["heldout_loss"]
    ref_state = drill.load_state_numpy(str(reference30), REF_STEPS)
    got_state = drill.load_state_numpy(str(run), REF_STEPS)
    np.testing.assert_array_equal(got_state["rng"], ref_state["rng"])
    for a, b in zip(jax.tree.leaves(got_state["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_sigterm_saves_exits_75_and_resumes(ckpt_env, trained10, reference30, tmp_path):
    """SIGTERM mid-run: the trainer finishes the step, commits a checkpoint of it, exits 75 (EX_TEMPFAIL);
    rerunning (two steps on from it) resumes at that step and continues the uninterrupted trajectory."""
    from jaxpt.train import PREEMPTED_EXIT_CODE
    run = copy_run(trained10, tmp_path / "run")
    tail = drill.MetricsTail(str(run))
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(trainer_cmd(ckpt_env, run, REF_STEPS), cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT, env=trainer_env(ckpt_env))
        done, deadline = 0, time.monotonic() + 300
        while done < 13 and proc.poll() is None and time.monotonic() < deadline:
            done = max([done] + [r["step"] for r in tail.poll() if "loss" in r and "event" not in r])
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    assert rc == PREEMPTED_EXIT_CODE, (tmp_path / "log.txt").read_text()[-3000:]
    preempted = [e["step"] for e in events(run) if e["event"] == "preempted"]
    assert len(preempted) == 1 and 13 <= preempted[0] < REF_STEPS
    committed, pending = drill.checkpoint_dirs(str(run))
    assert max(committed) == preempted[0] and not pending
    end = min(preempted[0] + 2, REF_STEPS)  # the same trajectory at any length: no need to train on to step 30
    train(ckpt_env, run, end)
    assert [e["step"] for e in events(run) if e["event"] == "resume"] == [10, preempted[0]]
    assert_same_trajectory(reference30, run, range(1, end + 1))


@pytest.mark.slow
def test_sigkill_inside_async_saves_ten_times(ckpt_env, reference30, tmp_path):
    """The recovery drill: 10 SIGKILLs, each right after the asynchronous save of a random step started;
    every restart resumes from the newest committed step (never the interrupted one) and the run ends
    on the reference trajectory (metrics, documents, RNG, params, held-out loss bitwise)."""
    cmd = [sys.executable, "-m", "jaxpt.tools.drill", "--config", "configs/quickstart.gin",
           "--mesh", "data=2,fsdp=2,tensor=2", "--workdir", str(tmp_path / "drill"), "--steps", str(REF_STEPS),
           "--kills", "10", "--mode", "save", "--save-every", str(SAVE_EVERY), "--seed", "3",
           "--max-kill-delay-s", "0.02", "--reference", str(reference30), "--timeout-s", "300"]
    for b in tiny_bindings(ckpt_env["data"], reference30):
        if not b.startswith("TrainConfig.workdir"):
            cmd += ["--gin", b]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=trainer_env(ckpt_env), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
    report = json.loads((tmp_path / "drill" / "drill_report.json").read_text())
    restarts = report["restarts"]
    assert len(restarts) == 10 and all(r["kind"] == "save" for r in restarts)
    assert all(r["resumed_newest_committed"] for r in restarts)
    # The kill must land inside the save at least sometimes, or this test proves nothing about it.
    assert report["summary"]["kills_inside_save"] >= 5, restarts
    for r in restarts:
        if r["inside_save"]:  # the interrupted step was not picked up: an earlier one was
            assert r["resumed_step"] < r["target_step"]
    assert report["loss_curve_continuous"] and report["learning_rate_match"]
    assert report["data_position_match"] and report["rng_match"] and report["final_params_match"]
    assert report["leftover_tmp_dirs"] == []  # each restart deleted the partial save it found


@pytest.mark.slow
@pytest.mark.parametrize("devices,mesh", [(4, "fsdp=4"), (1, "data=1")])
def test_resharded_restore_gives_the_same_next_loss(ckpt_env, trained10, reference30, tmp_path, devices, mesh):
    """A checkpoint saved on data=2,fsdp=2,tensor=2 (8 devices) restores on another mesh and device count;
    step 11's loss equals the uninterrupted 8-device run's (relative difference < 1e-5)."""
    run = copy_run(trained10, tmp_path / "run")
    train(ckpt_env, run, 11, devices=devices, mesh=mesh)
    got = drill.step_records(str(run))[11][-1]
    ref = drill.step_records(str(reference30))[11][-1]
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    assert got["learning_rate"] == ref["learning_rate"]
    assert [e["mesh"] for e in events(run) if e["event"] == "resume"] == [mesh]


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.slow
def test_other_vocabulary_exits_3_with_a_clear_message(ckpt_env, trained10, tmp_path):
    """`python -m jaxpt.train` over a checkpoint of another vocabulary stops with status 3 and says why."""
    run = copy_run(trained10, tmp_path / "run")
    proc = train(ckpt_env, run, 12, expect_rc=3, **{"ModelConfig.vocab_size": "4096"})
    assert "checkpoint error" in proc.stderr and "vocab_size: checkpoint 2048 vs config 4096" in proc.stderr
    assert "Traceback" not in proc.stderr


def _run_in_process(ckpt_env, run: pathlib.Path, steps: int, **overrides):
    from jaxpt import config as C
    from jaxpt import train as T
    cfg = C.parse(["configs/quickstart.gin"], bindings(ckpt_env, run, **overrides), steps=steps,
                  mesh="data=2,fsdp=2,tensor=2")
    return T.run_training(cfg)


@pytest.mark.slow
def test_other_shape_or_corrupt_state_raise_checkpoint_error(ckpt_env, trained10, tmp_path):
    """Another model shape is refused by name before Orbax is asked; a committed step whose arrays are
    truncated stops the run with CheckpointError naming it, and never restarts at step 0."""
    run = copy_run(trained10, tmp_path / "run")
    n_records = len((run / "metrics.jsonl").read_text().splitlines())
    with pytest.raises(CheckpointError, match=r"d_model: checkpoint 64 vs config 32"):
        _run_in_process(ckpt_env, run, 12, **{"ModelConfig.d_model": "32"})
    for f in (run / "checkpoints" / "10" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"checkpoints/10"):
        _run_in_process(ckpt_env, run, 12)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == n_records  # no "start" at step 0


def test_incomplete_saves_are_ignored_and_junk_is_an_error(trained10, tmp_path):
    """A temporary (uncommitted) save directory is never the latest step, and a trainer's checkpointer
    deletes it on start; a step directory that cannot be read, or unrecognized entries, are errors naming
    them; only incomplete saves means a fresh start."""
    run = copy_run(trained10, tmp_path / "run")
    tmp_save = run / "checkpoints" / "12.orbax-checkpoint-tmp-1795960289"
    shutil.copytree(run / "checkpoints" / "10", tmp_save)
    reader = Checkpointer(str(run), CheckpointConfig(enabled=False), read_only=True)
    assert reader.latest_step() == 10 and reader.all_steps() == [6, 8, 10] and tmp_save.exists()
    reader.close()
    ckpt = Checkpointer(str(run), CheckpointConfig())
    try:
        assert ckpt.latest_step() == 10 and ckpt.all_steps() == [6, 8, 10]
        deadline = time.monotonic() + 30
        while tmp_save.exists() and time.monotonic() < deadline:  # Orbax cleans up in the background
            time.sleep(0.05)
        assert not tmp_save.exists() and (run / "checkpoints" / "10").is_dir()
    finally:
        ckpt.close()

    empty_step = tmp_path / "empty_step"
    (empty_step / "checkpoints" / "7").mkdir(parents=True)
    from jaxpt import config as C
    from jaxpt.run import lineage
    at = lambda d: C.parse([], [f"TrainConfig.workdir = {str(d)!r}"])  # noqa: E731  # what a run would resume
    with pytest.raises(CheckpointError, match="checkpoints/7: cannot read its metadata"):
        lineage.trace(at(empty_step), None)
    junk = tmp_path / "junk"
    (junk / "checkpoints" / "notes").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"holds \['notes'\] but no restorable checkpoint"):
        lineage.trace(at(junk), None)
    only_tmp = tmp_path / "only_tmp"
    (only_tmp / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir(parents=True)
    assert lineage.trace(at(only_tmp), None)[1].kind == "fresh"


# ------------------------------------------------------------------------------------------ policies


def _toy_save(ckpt: Checkpointer, step: int) -> bool:
    import grain
    it = iter(grain.MapDataset.range(100).to_iter_dataset())
    for _ in range(step):
        next(it)
    return ckpt.save(step, {"w": np.full((4,), step, np.float32)}, it, {"step": step})


def test_keep_last_and_keep_every(tmp_path):
    """save_every_steps=1, keep_last=2, keep_every_steps=4 over steps 1..10 leaves {4, 8} and the last two."""
    cfg = CheckpointConfig(save_every_steps=1, keep_last=2, keep_every_steps=4, async_save=True)
    ckpt = Checkpointer(str(tmp_path), cfg)
    for step in range(1, 11):
        assert ckpt.should_save(step)
        assert _toy_save(ckpt, step)
    ckpt.wait()
    expected = sorted({s for s in range(1, 11) if s % 4 == 0} | {9, 10})
    assert ckpt.all_steps() == expected
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == expected
    ckpt.close()


def test_save_every_steps_and_minutes(tmp_path):
    """The step policy wants multiples of save_every_steps only; the time policy wants a save once the
    interval since the last one has passed (here 6 s), and not before. The interval is wide so that a slow save on a
    loaded host cannot use it up before the "not before" check."""
    ckpt = Checkpointer(str(tmp_path / "steps"), CheckpointConfig(save_every_steps=3))
    assert [s for s in range(1, 13) if ckpt.should_save(s)] == [3, 6, 9, 12]
    ckpt.close()
    ckpt = Checkpointer(str(tmp_path / "time"), CheckpointConfig(save_every_steps=0, save_every_minutes=0.1,
                                                                  async_save=False))
    assert ckpt.should_save(1) and _toy_save(ckpt, 1)
    assert not ckpt.should_save(2)
    time.sleep(6.1)
    assert ckpt.should_save(3)
    ckpt.close()


# ------------------------------------------------------------------------------------------ restore, generate


def _heldout_loss(model, cfg, tokenizer, heldout_path) -> float:
    """Mean held-out cross-entropy of ``model`` as the trainer defines it (each document + EOS cut into rolling
    windows of ``seq_len`` with stride ``seq_len // 2``, every token after a document's first scored once), computed
    here with the model alone: one window at a time, unpacked, no scorer and no train/eval step."""
    from flax import nnx
    from jaxpt.data.documents import read_texts
    from jaxpt.eval.scorer import rolling_windows
    graphdef, state = nnx.split(model)

    L = cfg.seq_len

    @jax.jit
    def nll_sum(state, tokens, n, first):
        # One window per call, right-padded to L (segment 0) so one program serves every length: causal
        # attention means the padding after the window cannot change its logits.
        real = jnp.arange(L) < n
        logits = nnx.merge(graphdef, state)(tokens, real.astype(jnp.int32)[None], jnp.arange(L)[None])
        logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
        scored = (jnp.arange(1, L) >= first) & (jnp.arange(1, L) < n)
        return jnp.sum(jnp.where(scored, nll, 0.0))

    total = count = 0.0
    for text in read_texts(str(heldout_path)):
        ids = np.append(np.asarray(tokenizer.encode(text), np.int32), np.int32(tokenizer.eos_id))
        for w in rolling_windows(ids, L, L // 2):
            row = np.zeros((1, L), np.int32)
            row[0, :len(w.tokens)] = w.tokens
            total += float(nll_sum(state, row, len(w.tokens), w.first))
            count += w.num_scored
    return total / count


@pytest.mark.integration
def test_restore_anywhere_gives_the_trained_model(ckpt_env, trained10):
    """jaxpt.restore returns the run's config, tokenizer and params: on the saved 8-device mesh and on one
    device, the restored model's held-out loss equals the one the trainer logged at its end (rel 1e-5)."""
    import jaxpt
    from jaxpt import mesh as mesh_lib
    from jaxpt.model import count_params
    logged = [e for e in events(trained10) if e["event"] == "final"][-1]["heldout_loss"]
    for mesh in (None, mesh_lib.make_mesh("data=1", devices=jax.devices()[:1])):
        r = jaxpt.restore(trained10, mesh=mesh)
        assert r.step == 10 and r.config.steps == 10 and r.config.model.d_model == 64
        assert r.config.model.vocab_size == r.tokenizer.vocab_size == 2048
        assert r.num_params == count_params(r.config.model)["total"]
        assert r.mesh.size == (8 if mesh is None else 1)
        assert {p.sharding.mesh.size for p in jax.tree.leaves(r.params)} == {r.mesh.size}
        loss = _heldout_loss(r.model, r.config, r.tokenizer, ckpt_env["data"] / "heldout.jsonl.gz")
        assert loss == pytest.approx(logged, rel=1e-5)
    assert jaxpt.restore(trained10, step=8).step == 8
    with pytest.raises(CheckpointError, match="no committed step 7"):
        jaxpt.restore(trained10, step=7)


@pytest.mark.slow
def test_generate_matches_unpadded_greedy_reference(trained10):
    """Each token the padded fixed-row greedy decoder (jaxpt.infer.decode over NoCacheStep) picks is the argmax of the
    model's logits at the previous position when run once, unpadded, on the prompt plus the generated tokens
    (causal masking makes that single call see exactly the context each decoding step saw). A prompt longer than
    max_seq_len - max_new_tokens (64 - 4) keeps its last 60 tokens."""
    import jaxpt
    from jaxpt.infer import decode
    from jaxpt import mesh as mesh_lib
    r = jaxpt.restore(trained10, mesh=mesh_lib.make_mesh("data=1", devices=jax.devices()[:1]))

    def unpadded_argmax(ids, first):
        ids = np.asarray([ids], np.int32)
        n = ids.shape[1]
        logits = np.asarray(r.model(ids, np.ones((1, n), np.int32), np.arange(n, dtype=np.int32)[None]))
        return [int(np.argmax(logits[0, k])) for k in range(first - 1, n - 1)]

    prompt = list(r.tokenizer.encode("The river flows"))
    (gen,) = decode.greedy(decode.NoCacheStep.from_model(r.model, seq_len=len(prompt) + 8), [prompt], 8)
    got = gen.ids
    assert len(got) == 8 and gen.stop_reason == "length"
    assert got == unpadded_argmax(prompt + got, len(prompt))
    eos = r.tokenizer.eos_id
    until_eos = got[:got.index(eos) + 1] if eos in got else got
    assert jaxpt.generate(r.model, r.tokenizer, "The river flows", 8) == r.tokenizer.decode(until_eos)
    long_prompt = list(r.tokenizer.encode("The river flows into the sea. " * 12))[:70]
    (gen,) = decode.greedy(decode.NoCacheStep.from_model(r.model), [long_prompt], 4)
    assert len(gen.ids) == 4
    assert gen.ids == unpadded_argmax(long_prompt[-60:] + gen.ids, 60)
    with pytest.raises(ValueError, match="at least one token"):
        jaxpt.generate(r.model, r.tokenizer, "", 3)
    with pytest.raises(ValueError, match="max_new_tokens = 64"):
        jaxpt.generate(r.model, r.tokenizer, "The river", 64)


@pytest.mark.slow
def test_notebook_runs(trained10, monkeypatch):
    """notebooks/restore_checkpoint.ipynb executes under nbclient: it restores the run, prints its step and
    parameter count, generates, and draws the loss curve."""
    import nbclient
    import nbformat
    from jaxpt.model import ModelConfig, count_params
    monkeypatch.setenv("JAXPT_WORKDIR", str(trained10))
    nb = nbformat.read(REPO_ROOT / "notebooks" / "restore_checkpoint.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO_ROOT)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    n = count_params(ModelConfig(vocab_size=2048, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                 head_dim=16, mlp_dim=128))["total"]
    assert f"step 10: {n:,} parameters" in text
    assert "The history of the" in text and "logged steps" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)


# ------------------------------------------------------------------------------------------ the drill itself


def test_drill_comparisons_catch_mismatches():
    """The drill's checks fail on a changed loss, a changed learning rate, a missing step or another batch."""
    ref = {s: [{"step": s, "loss": 1.0 / s, "learning_rate": 0.1, "grad_norm": 1.0}] for s in (1, 2, 3)}
    assert drill.compare_metrics(ref, copy.deepcopy(ref), 3, 0.0)["loss_curve_continuous"]
    bad = copy.deepcopy(ref)
    bad[2].append({**bad[2][0], "loss": 0.5 + 1e-12})  # a later launch logged step 2 slightly differently
    assert not drill.compare_metrics(ref, bad, 3, 0.0)["loss_curve_continuous"]
    lr = {s: [{**v[0], "learning_rate": 0.2}] for s, v in ref.items()}
    out = drill.compare_metrics(ref, lr, 3, 0.0)
    assert out["loss_curve_continuous"] and not out["learning_rate_match"]
    assert drill.compare_metrics(ref, {1: ref[1], 3: ref[3]}, 3, 0.0)["missing_steps"] == [2]
    docs = {1: [[1, 2]], 2: [[3]]}
    assert drill.compare_batches(docs, {1: [[1, 2]], 2: [[3], [3]]}, 2)["data_position_match"]
    assert drill.compare_batches(docs, {1: [[1, 2]], 2: [[3], [4]]}, 2)["batch_mismatch_steps"] == [2]


def test_kill_plan_targets_are_distinct_increasing_and_on_saves():
    """Save kills target save steps; every plan's targets are distinct, increasing and before the end."""
    for mode in ("save", "step", "mixed"):
        plan = drill.plan_kills(30, 10, 2, mode, seed=5, max_delay_s=0.1)
        targets = [k.target for k in plan]
        assert len(plan) == 10 and targets == sorted(set(targets)) and 1 <= targets[0] and targets[-1] < 30
        assert all(k.target % 2 == 0 for k in plan if k.kind == "save")
        assert all(0 <= k.delay_s <= 0.1 for k in plan)
    assert {k.kind for k in drill.plan_kills(30, 10, 2, "save", 0, 0.1)} == {"save"}
    with pytest.raises(drill.DrillError, match="raise --steps"):
        drill.plan_kills(10, 6, 2, "save", 0, 0.1)


def test_drill_verdict_compares_recovery_with_the_checkpoint_interval():
    """Interval = save_every x step time: 5 steps x 2 s = 10 s; a worst recovery of 12 s is not shorter."""
    v = drill.recovery_verdict([3.0, 12.0], 5, 2.0)
    assert v == {"checkpoint_interval_s": 10.0, "recovery_time_s_max": 12.0, "recovery_shorter_than_interval": False}
    assert drill.recovery_verdict([3.0, 9.5], 5, 2.0)["recovery_shorter_than_interval"] is True
    assert drill.recovery_verdict([], 5, 2.0)["recovery_shorter_than_interval"] is None
