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
