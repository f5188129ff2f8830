"""jaxpt: a JAX pretraining stack for decoder-only language models.

Modules (one-way dependencies, top to bottom): ``config`` (gin + validation), ``mesh`` (devices and
logical-axis sharding), ``model`` (Flax NNX decoder), ``optim`` (optax), ``data`` (tokenizer, Grain,
packing), ``state`` (sharded train state), ``step`` (pure train/eval steps), ``flops``/``monitor``
(MFU and metric writers), ``train`` (the entry point and loop).
"""

__version__ = "0.1.0"
