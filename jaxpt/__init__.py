"""jaxpt: a JAX pretraining stack for decoder-only language models.

Modules (one-way dependencies, top to bottom): ``errors`` (the one ConfigError), ``config`` (gin + validation),
``mesh`` (devices and logical-axis sharding), ``model`` (Flax NNX decoder with attention/MLP seams), ``optim``
(optax), ``data`` (tokenizer, document files, Grain loaders, packing, the run's stream), ``state`` (sharded train
state), ``step`` (pure train/eval steps), ``builder`` (config -> mesh, state, compiled steps: every entry point
uses it), ``flops``/``monitor`` (MFU and metric writers), ``checkpoint`` (Orbax), ``hooks`` (the loop's periodic
actions), ``train`` (the entry point and loop), ``decode`` (the one greedy decoder, batched, behind a step
interface), ``inference`` (restore a checkpoint anywhere, generate text), ``eval`` (held-out perplexity, probes,
eval cards). ``jaxpt.tools`` holds the command-line tools (plan, sweep, scaling, drill, runs, evaluate).
"""

__version__ = "0.1.0"

_LAZY = {"restore": "jaxpt.infer.restore", "generate": "jaxpt.infer.restore", "Restored": "jaxpt.infer.restore"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxpt' has no attribute {name!r}")
