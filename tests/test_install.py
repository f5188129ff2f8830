"""Packaging: the lean core install imports no extra's heavy dependency; console scripts point at real mains."""

import ast
import json
import os
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO_ROOT

#: Modules that belong to an extra, not the core (pyproject.toml): importing them needs that extra.
EXTRA_MODULES = {"jaxpt.eval.seqio_tasks": "eval", "jaxpt.eval.harness": "eval"}
#: Top-level packages no core module may import (the `data` and `eval` extras' heavy dependencies).
FORBIDDEN = ("apache_beam", "tensorflow", "tensorflow_datasets", "tensorflow_text", "seqio", "lm_eval", "torch",
             "datasketch", "lingua", "trafilatura", "warcio", "pyarrow")

_PROBE = r"""
import importlib, json, pkgutil, sys
import jaxpt
extra = set(json.loads(sys.argv[1]))
names = sorted(m.name for m in pkgutil.walk_packages(jaxpt.__path__, "jaxpt.") if m.name not in extra)
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "loaded": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def _pyproject():
    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


@pytest.mark.integration
def test_core_modules_import_no_beam_tensorflow_seqio_or_lm_eval():
    # A fresh interpreter, so sys.modules holds only what importing the core (jaxpt.train and all) pulls in.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(sorted(EXTRA_MODULES))], cwd=REPO_ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"jaxpt.train", "jaxpt.evaluate", "jaxpt.data.corpus", "jaxpt.checkpoint"} <= set(out["imported"])
    assert not set(FORBIDDEN) & set(out["loaded"]), sorted(set(FORBIDDEN) & set(out["loaded"]))


def test_core_dependencies_leave_the_heavy_ones_to_extras():
    project = _pyproject()["project"]
    core = " ".join(project["dependencies"]).lower()
    for heavy in ("apache-beam", "tensorflow", "seqio", "lm-eval", "lingua", "trafilatura", "datasketch"):
        assert heavy not in core, heavy
    extras = project["optional-dependencies"]
    assert {"data", "eval", "tpu", "cuda", "test", "dev"} <= set(extras)
    assert any("apache-beam" in d for d in extras["data"]) and any("seqio" in d for d in extras["eval"])
    assert any("trafilatura" in d for d in extras["prepare"]) and any("tensorboard" in d for d in extras["viz"])
    # each EXTRA_MODULES entry names an existing extra and an existing module file
    for module, extra in EXTRA_MODULES.items():
        assert extra in extras
        assert os.path.isfile(os.path.join(REPO_ROOT, *module.split(".")) + ".py"), module


def test_console_scripts_are_declared_and_point_at_real_mains():
    # Read from the source (ast), not imported: `jaxpt-build-corpus` needs the `data` extra, and importing Beam
    # would cost half a minute.
    scripts = _pyproject()["project"]["scripts"]
    assert {"jaxpt-train", "jaxpt-evaluate", "jaxpt-compile", "jaxpt-plan"} <= set(scripts)
    for name, target in scripts.items():
        module_name, _, attr = target.partition(":")
        path = os.path.join(REPO_ROOT, *module_name.split(".")) + ".py"
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert attr in funcs, f"{name}: {module_name} has no top-level {attr}()"
        args = funcs[attr].args
        assert [a.arg for a in args.args][:1] == ["argv"] and len(args.defaults) == len(args.args), \
            f"{name}: {attr}(argv=None) expected (a console script calls it with no argument)"
        guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert guards and f"{attr}(" in ast.unparse(guards[0]), f"{name}: `python -m {module_name}` runs {attr}"
