"""jaxpt: a JAX pretraining stack for decoder-only language models.

Packages by concern, each importing only those before it (``tests/test_imports.py`` holds the order):

* ``util``: the filesystem layer, JSON Lines rules, progress display, config field checks, error classes;
* ``mesh``: devices and logical-axis sharding;
* ``model``: the Flax NNX decoder, its attention and MLP implementations chosen from explicit tables;
* ``training``: the train/eval steps, the sharded train state, the optimizer, stability, batch ramp, FLOP and
  memory accounting;
* ``data``: tokenizer, document files, packing, Grain loaders, token-true mixtures, the run's stream;
* ``checkpoint``: Orbax storage;
* ``config``: gin and the config dataclasses;
* ``infer``: restore a checkpoint anywhere, greedy and KV-cached decoding;
* ``eval``: held-out perplexity, probe tasks, eval cards;
* ``run``: a run's lifecycle (resolve -> build -> lineage -> loop, with hooks, records and metrics);
* programs: ``jaxpt.train`` (``python -m jaxpt.train``) and ``jaxpt.tools.*`` (plan, compile, sweep, scaling, gate,
  drill, runs, evaluate, convert, diagnose).

``jaxpt.restore`` and ``jaxpt.generate`` (:mod:`jaxpt.infer.restore`) are the notebook API. Importing jaxpt on a host
without accelerators selects JAX's CPU backend (:mod:`jaxpt.util.platform`) unless ``JAX_PLATFORMS`` is set.
"""

from jaxpt.util import platform as _platform

_platform.select_cpu_without_accelerators()

__version__ = "0.1.0"

_LAZY = {"restore": "jaxpt.infer.restore", "generate": "jaxpt.infer.restore", "Restored": "jaxpt.infer.restore"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxpt' has no attribute {name!r}")
