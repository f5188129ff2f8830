"""Behaviour goldens: what jaxpt's programs produce, recorded before a refactor and compared after it.

Recorded values (one JSON file per jax version, ``behaviour-jax<version>.json``):

* ``hlo``: sha256 of the lowered train step's StableHLO text (no debug locations, so moving code between files
  does not change it) for the quickstart, MoE and staged configs on ``data=8``, ``fsdp=8``,
  ``data=2,fsdp=2,tensor=2``, a ``stage=2`` and a ``sequence=2`` layout; a layout a config cannot run is
  recorded as its refusal message.
* ``dry_run``: the text of ``python -m jaxpt.train --dry-run`` for the quickstart (the workdir as ``<tmp>``).
* ``compile``: ``python -m jaxpt.tools.compile --topology cpu:8 --json`` for each slice preset on the quickstart model
  (``blockwise`` attention: the presets' ``splash`` kernel is TPU-only), timings left out.
* ``run``: a 50-step quickstart-model run: every logged loss, the final held-out figures, ``config.gin``, the
  newest checkpoint's meta and ``run.json`` (ids, times, paths and versions left out).
* ``refusals``: refused commands, each with its exit status and its message (temporary paths as ``<tmp>``).

``python tests/goldens/behaviour.py record`` writes the file for the installed jax; ``compare`` prints the
differences (exact, as on the machine that recorded them); :mod:`tests.test_behaviour_goldens` runs the same
comparison with tolerances for the values that depend on the CPU (losses, compiled bytes).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]
GOLDENS = pathlib.Path(__file__).resolve().parent
QUICKSTART = str(REPO / "configs" / "quickstart.gin")
CONFIGS = {"quickstart": [QUICKSTART],
           "moe": [str(REPO / "configs" / "quickstart_moe.gin")],
           "staged": [QUICKSTART, str(REPO / "configs" / "quickstart_staged.gin")]}
LAYOUTS = ["data=8", "fsdp=8", "data=2,fsdp=2,tensor=2", "stage=2,data=4", "sequence=2,data=4"]
SLICES = ["v5p-128", "v5p-512", "v5e-256", "v6e-256"]
# The quickstart model on a slice preset's layout and numerics, at a size that compiles in seconds on CPU.
SLICE_OVERRIDES = ["ModelConfig.attention_impl = 'blockwise'", "ModelConfig.loss_chunk_size = 64",
                   "TrainConfig.seq_len = 128", "TrainConfig.global_batch_size = 16", "ModelConfig.max_seq_len = 256"]
RUN_STEPS = 50


def golden_path() -> pathlib.Path:
    import jax
    return GOLDENS / f"behaviour-jax{jax.__version__}.json"


def data_bindings(prepared: pathlib.Path) -> list[str]:
    return [f"DataConfig.train_path = {str(prepared / 'train.jsonl.gz')!r}",
            f"DataConfig.heldout_path = {str(prepared / 'heldout_small.jsonl.gz')!r}",
            f"DataConfig.tokenizer_path = {str(prepared / 'tokenizer.model')!r}"]


def _gin_args(bindings: list[str]) -> list[str]:
    return [a for b in bindings for a in ("--gin", b)]


def _config_args(files: list[str]) -> list[str]:
    return [a for f in files for a in ("--config", f)]


def _scrub(text: str, tmp: pathlib.Path) -> str:
    return text.replace(str(tmp.resolve()), "<tmp>").replace(str(tmp), "<tmp>").replace(str(REPO), "<repo>")


# ------------------------------------------------------------------------------------------------ the values


def hlo_fingerprints(prepared: pathlib.Path) -> dict[str, str]:
    """``{'<config> <layout>': sha256 of the lowered train step, or 'refused: <message>'}``."""
    from jaxpt import config as config_lib
    from jaxpt.util.errors import ConfigError
    build = _build_function()
    out = {}
    for name, files in CONFIGS.items():
        for layout in LAYOUTS:
            try:
                cfg = config_lib.parse(files, [*data_bindings(prepared), f"TrainConfig.mesh = {layout!r}"])
                out[f"{name} {layout}"] = build(cfg).hlo_fingerprint()
            except ConfigError as e:
                out[f"{name} {layout}"] = f"refused: {e}"
    return out


def _build_function():
    from jaxpt.run.build import build_for
    return build_for


def _train_main():
    from jaxpt import train
    return train.main


def _dry_run_flag() -> str:
    """The trainer's dry-run flag: ``--dry-run`` (one kebab-case grammar), ``--dry_run`` before it."""
    return "--dry-run" if "--dry-run" in (REPO / "jaxpt" / "train.py").read_text() else "--dry_run"


def _capture(fn, argv) -> tuple[int, str, str]:
    """Run an entry point's ``main(argv)`` in this process: ``(status, stdout, stderr)``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = fn(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def dry_run_text(prepared: pathlib.Path, tmp: pathlib.Path) -> str:
    rc, out, err = _capture(_train_main(), [*_config_args([QUICKSTART]), *_gin_args(data_bindings(prepared)),
                                            "--workdir", str(tmp / "dry"), _dry_run_flag()])
    assert rc == 0, err
    return _scrub(out, tmp)


def compile_reports(prepared: pathlib.Path) -> dict[str, dict]:
    from jaxpt.tools import compile as compile_lib
    main = getattr(compile_lib, "main")
    out = {}
    for s in SLICES:
        rc, text, err = _capture(main, [*_config_args([QUICKSTART, str(REPO / "configs" / "slices" / f"{s}.gin")]),
                                        *_gin_args([*data_bindings(prepared), *SLICE_OVERRIDES]),
                                        "--topology", "cpu:8", "--json"])
        assert rc == 0, err
        r = json.loads(text)
        for k in ("compile_seconds", "lower_seconds"):
            r.pop(k)
        out[s] = r
    return out


def _run_trainer(argv: list[str], tmp: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    return subprocess.run([sys.executable, "-m", "jaxpt.train", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)


RUN_RECORD_DROP = {"run_id", "workdir", "started_at", "ended_at", "git", "sessions", "config_hash", "tokenizer"}


def short_run(prepared: pathlib.Path, tmp: pathlib.Path) -> dict:
    """A 50-step quickstart-model run on the prepared sample: its losses, final figures and the files it wrote."""
    workdir = tmp / "run"
    argv = [*_config_args([QUICKSTART]), *_gin_args([*data_bindings(prepared), "TrainConfig.progress_bar = False",
                                                     "TrainConfig.eval_batches = 2", "TrainConfig.eval_every = 25",
                                                     "CheckpointConfig.save_every_steps = 25"]),
            "--workdir", str(workdir), "--steps", str(RUN_STEPS)]
    p = _run_trainer(argv, tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    losses = {str(r["step"]): r["loss"] for r in records if "loss" in r and "event" not in r}
    final = [r for r in records if r.get("event") == "final"][-1]
    evals = [{k: v for k, v in r.items() if k.startswith("heldout") or k == "step"} for r in records
             if any(k.startswith("heldout") for k in r) and r.get("event") != "final"]
    step_dirs = sorted((workdir / "checkpoints").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    meta = _read_meta(workdir, int(step_dirs[-1].name))
    for k in ("libraries", "config_gin", "train_time_s"):
        meta.pop(k, None)
    meta["tokenizer"] = {"sha256": meta["tokenizer"]["sha256"]}
    run = json.loads((workdir / "run.json").read_text())
    for k in RUN_RECORD_DROP:
        run.pop(k, None)
    run.get("final", {}).pop("train_time_s", None)
    run["stages"] = [{k: v for k, v in s.items() if k != "workdir"} for s in run.get("stages", [])]
    # The prepared sample's data version hashes its prepare.json (paths, times): the same data prepared twice
    # differs there, so it is recorded as present, not compared.
    version = meta.get("data_version", "")
    meta, run = (json.loads(json.dumps(x).replace(version, "<data_version>")) for x in (meta, run))
    return {"losses": losses, "evals": evals,
            "final": {k: v for k, v in final.items() if k.startswith("heldout") or k in ("step", "train_loss")},
            "config_gin": _scrub((workdir / "config.gin").read_text(), tmp).replace(str(prepared), "<prepared>"),
            "checkpoint_steps": [d.name for d in step_dirs], "meta": json.loads(_scrub(json.dumps(meta), tmp)),
            "run_record": run}


def _read_meta(workdir: pathlib.Path, step: int) -> dict:
    from jaxpt import checkpoint as ckpt_lib
    c = ckpt_lib.Checkpointer(str(workdir), ckpt_lib.CheckpointConfig(enabled=False), read_only=True)
    try:
        return c.read_meta(step)
    finally:
        c.close()


def refusals(prepared: pathlib.Path, tmp: pathlib.Path) -> dict[str, dict]:
    """Refused commands: ``{name: {"status": int, "message": last stderr line(s)}}``. ``tmp/run`` holds the
    50-step run's checkpoints (:func:`short_run`), which some of them try to resume."""
    data = _gin_args(data_bindings(prepared))
    qs = _config_args([QUICKSTART])
    run = ["--workdir", str(tmp / "run")]
    dry = _dry_run_flag()
    cases = {
        "moe on stage=2": [*_config_args(CONFIGS["moe"]), *data, "--mesh", "stage=2,data=4", "--workdir",
                           str(tmp / "r1"), dry],
        "mesh does not fit": [*qs, *data, "--mesh", "data=3", "--workdir", str(tmp / "r2"), dry],
        "unknown setting": [*qs, *data, "--gin", "ModelConfig.d_modle = 3", dry],
        "batch not divisible": [*qs, *data, "--gin", "TrainConfig.global_batch_size = 6", dry],
        "no train data": [*qs, "--gin", f"DataConfig.train_path = {str(tmp / 'none.jsonl.gz')!r}",
                          *_gin_args(data_bindings(prepared)[1:]), "--workdir", str(tmp / "r3"), dry],
        "unknown mixture group": [*qs, *data, "--gin", "DataConfig.mixture_weights = (('nope', 1.0),)",
                                  "--workdir", str(tmp / "r4"), dry],
        "steps below checkpoint": [*qs, *data, *run, "--steps", "10", dry],
        "resume another model": [*qs, *data, *run, "--gin", "ModelConfig.d_model = 128", dry],
        "resume another ramp": [*qs, *data, *run, "--gin", "TrainConfig.batch_size_schedule = '1:8,5:16'", dry],
        "resume names a parent": [*qs, *data, *run, "--gin", f"TrainConfig.init_from = {str(tmp / 'run')!r}", dry],
        "parent missing": [*qs, *data, "--workdir", str(tmp / "r5"), "--gin",
                           f"TrainConfig.init_from = {str(tmp / 'nowhere')!r}", dry],
        "parent at or above steps": [*qs, *data, "--workdir", str(tmp / "r6"), "--steps", "50", "--gin",
                                     f"TrainConfig.init_from = {str(tmp / 'run')!r}", dry],
        "stage of another model": [*qs, *data, "--workdir", str(tmp / "r7"), "--steps", "60", "--gin",
                                   f"TrainConfig.init_from = {str(tmp / 'run')!r}", "--gin", "ModelConfig.num_layers = 2",
                                   dry],
        "profile window after the end": [*qs, *data, "--steps", "5", "--gin", "TrainConfig.profile_steps = '4:9'", dry],
    }
    out = {}
    for name, argv in cases.items():
        rc, _, err = _capture(_train_main(), argv)
        lines = [ln for ln in err.strip().splitlines() if ln.startswith(("config error", "checkpoint error", "hint"))]
        out[name] = {"status": rc, "message": _scrub("\n".join(lines) or err.strip()[-500:], tmp)
                     .replace(str(prepared), "<prepared>")}
    return out


def record_all(prepared: pathlib.Path) -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="goldens-"))
    try:
        values = {"hlo": hlo_fingerprints(prepared), "dry_run": dry_run_text(prepared, tmp),
                  "compile": compile_reports(prepared), "run": short_run(prepared, tmp)}
        values["refusals"] = refusals(prepared, tmp)
        return values
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_sample(out: pathlib.Path) -> pathlib.Path:
    """The tests' prepared sample (2048-piece tokenizer, small held-out subset), as ``tests/conftest.py`` makes it."""
    sys.path.insert(0, str(REPO / "tests"))
    import conftest
    from jaxpt.data.prepare import PrepareSettings, prepare
    if not (out / "heldout_small.jsonl.gz").exists():
        out.mkdir(parents=True, exist_ok=True)
        prepare(REPO / "data" / "sample", out, PrepareSettings(vocab_size=2048))
        conftest._write_small_heldout(out / "heldout.jsonl.gz", out / conftest.HELDOUT_SMALL)
    return out


def differences(want, got, path="", rel: float = 0.0) -> list[str]:
    """Where ``got`` differs from ``want`` (floats within ``rel`` relative tolerance count as equal; a perplexity is
    compared as its log, the loss, with the same relative tolerance)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}/{k}: missing" for k in want if k not in got]
        out += [f"{path}/{k}: new" for k in got if k not in want]
        for k in want:
            if k in got:
                out += differences(want[k], got[k], f"{path}/{k}", rel)
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in differences(a, b, f"{path}[{i}]", rel)]
    if isinstance(want, float) and isinstance(got, (int, float)) and rel and path.endswith("perplexity") \
            and want > 1 and got > 0:
        # exp(loss): compared as the loss it is, so a loss within rel is a perplexity within tolerance (rel on the
        # perplexity itself would be rel on the loss times the loss, ~5x tighter at a loss of 5.5)
        want_loss, got_loss = math.log(want), math.log(got)
        return [] if abs(got_loss - want_loss) <= rel * want_loss else [f"{path}: {want!r} -> {got!r}"]
    if isinstance(want, float) and isinstance(got, (int, float)) and rel:
        return [] if abs(got - want) <= rel * max(abs(want), 1e-12) else [f"{path}: {want!r} -> {got!r}"]
    return [] if want == got else [f"{path}: {want!r} -> {got!r}"]


def main(argv: list[str]) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    prepared = prepare_sample(pathlib.Path(argv[1]) if len(argv) > 1 else
                              pathlib.Path(tempfile.gettempdir()) / "jaxpt-goldens-sample")
    got = record_all(prepared)
    if argv[0] == "record":
        golden_path().write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {golden_path()}")
        return 0
    want = json.loads(golden_path().read_text())
    diffs = differences(want, got)
    print("\n".join(diffs) if diffs else "no differences")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
