"""jaxpt: a JAX pretraining stack for decoder-only language models.

Modules (one-way dependencies, top to bottom): ``config`` (gin + validation), ``mesh`` (devices and
logical-axis sharding), ``model`` (Flax NNX decoder), ``optim`` (optax), ``data`` (tokenizer, Grain,
packing), ``state`` (sharded train state), ``step`` (pure train/eval steps), ``flops``/``monitor``
(MFU and metric writers), ``checkpoint`` (Orbax), ``train`` (the entry point and loop), ``decode`` (the one
greedy decoder, batched, behind a step interface), ``inference`` (restore a checkpoint anywhere, generate text),
``drill`` (kill-and-resume recovery drill).

``jaxpt.restore`` and ``jaxpt.generate`` are imported on first use, so ``import jaxpt`` stays light.
"""

__version__ = "0.1.0"

_LAZY = {"restore": "jaxpt.inference", "generate": "jaxpt.inference", "Restored": "jaxpt.inference"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxpt' has no attribute {name!r}")
