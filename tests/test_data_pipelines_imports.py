"""data_pipelines' import graph, drawn from the source (module-level and function-local imports), holds its layering.

The layers, lowest first (a module may import its own layer and those below it, never one above; no circle among
data_pipelines modules, counting imports inside functions):

    lib  <  steps  <  pipeline  <  config  <  programs

``lib``: the pieces below every step (``sources``, ``draws``, ``minhash``, ``readers``, ``sink``, ``writer``,
``manifest``, ``progress``, ``quality_model``, ``tokenizer_training``). ``steps``: ``data_pipelines.steps.*``, one
module per step of the build. ``pipeline``: the ordered step list and the Beam graph it composes. ``config``: the
build's gin entry point (`BuildConfig`, gathered from the steps). ``programs``: the command lines (``build``,
``calibrate``, ``label_sample``, ``review``, ``tokenizer``, ``vocab_report``, ``neardup_eval``), ``testing`` and the
package's ``__init__``. A function-local import of a
data_pipelines module is allowed only with a ``# defers <heavy optional dependency>`` comment (tests/test_imports.py).
"""

import pathlib

import test_imports as ti

ROOT = pathlib.Path(__file__).resolve().parents[1]

LAYERS = ["lib", "steps", "pipeline", "config", "programs"]
LIB = {"sources", "draws", "minhash", "readers", "sink", "writer", "manifest", "progress", "quality_model",
       "tokenizer_training"}


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """``{dotted name: path}`` of every data_pipelines module under ``root``."""
    return ti.modules(root, "data_pipelines")


def import_graph(root: pathlib.Path) -> dict[str, list[tuple[str, int, bool, str]]]:
    """``{module: [(imported data_pipelines module, line, inside a function, source line), ...]}``, drawn as
    `test_imports.import_graph` draws jaxpt's."""
    return ti.import_graph(root, "data_pipelines")


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (``data_pipelines.steps.rules`` -> ``steps``)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == "steps":
        return LAYERS.index("steps")
    if len(parts) == 2 and parts[1] in LIB:
        return LAYERS.index("lib")
    if module in ("data_pipelines.pipeline", "data_pipelines.config"):
        return LAYERS.index(parts[1])
    return LAYERS.index("programs")


def upward(graph) -> list[str]:
    """Imports of a higher layer: ``'a (layer) -> b (layer), line N'``."""
    return [f"{m} ({LAYERS[layer(m)]}) -> {t} ({LAYERS[layer(t)]}), line {line}" for m, edges in sorted(graph.items())
            for t, line, _, _ in edges if layer(t) > layer(m)]


def test_the_graph_holds_the_layering():
    g = import_graph(ROOT)
    assert len(g) > 30 and sum(len(e) for e in g.values()) > 60  # the walk saw the package and its imports
    assert ti.circles(g) == []
    assert upward(g) == []
    assert ti.undeclared_local_imports(g) == []


def test_every_step_is_in_the_steps_layer_and_the_build_lists_it():
    from data_pipelines import pipeline

    listed = {type(s).__module__ for s in pipeline.STEPS}
    on_disk = {m for m in modules(ROOT) if m.startswith("data_pipelines.steps.") and m != "data_pipelines.steps.base"}
    assert listed == on_disk


def test_the_checks_catch_a_planted_back_import(tmp_path):
    """A planted tree: a library module importing a step inside a function with no comment, and the step importing
    the library back, is reported as a circle, an upward arrow and an undeclared local import; a step importing a
    program at module level is an upward arrow."""
    pkg = tmp_path / "data_pipelines"
    (pkg / "steps").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "steps" / "__init__.py").write_text("")
    (pkg / "minhash.py").write_text("def f():\n    from data_pipelines.steps import rules\n")
    (pkg / "steps" / "rules.py").write_text("from .. import minhash\nfrom data_pipelines import build\n")
    (pkg / "build.py").write_text("from data_pipelines.steps import rules\n")
    g = import_graph(tmp_path)
    assert g["data_pipelines.minhash"] == [("data_pipelines.steps.rules", 2, True,
                                            "    from data_pipelines.steps import rules")]
    assert any({"data_pipelines.minhash", "data_pipelines.steps.rules"} <= set(c) for c in ti.circles(g))
    assert "data_pipelines.minhash (lib) -> data_pipelines.steps.rules (steps), line 2" in upward(g)
    assert "data_pipelines.steps.rules (steps) -> data_pipelines.build (programs), line 2" in upward(g)
    assert ti.undeclared_local_imports(g) == ["data_pipelines.minhash:2: from data_pipelines.steps import rules"]
