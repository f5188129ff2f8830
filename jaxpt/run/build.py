"""One builder: a checked layout (+ devices) -> mesh, train state (abstract and concrete), compiled steps.

Every entry point that runs or compiles the train step goes through :func:`build` (``jaxpt.train``,
``jaxpt.tools.sweep``, ``jaxpt.tools.compile``, the benchmarks), so they all run the same program: the same
gradient accumulation, stability policy, z-loss, clipping, schedule and shardings as training. It validates
nothing: its input is a :class:`jaxpt.run.resolve.Layout`, checked once by :func:`jaxpt.run.resolve.resolve` (a run)
or :func:`jaxpt.run.resolve.layout` (a build without a run; :func:`build_for` does both).

    built = build_for(cfg, tokenizer=tok)        # layout (validates; ConfigError naming the key), then build
    state = built.init_state()                   # sharded at creation, never whole on one device
    state, metrics = built.train_step(state, batch)
    lowered = built.lower_train_step()           # for AOT compiles and HLO fingerprints
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jaxpt import config as config_lib, mesh as mesh_lib
from jaxpt.config import TrainConfig
from jaxpt.model import parametrization
from jaxpt.run import resolve
from jaxpt.training import batch_ramp, optim, state as state_lib, step as step_lib


@dataclasses.dataclass
class Built:
    """What :func:`build` returns: the static parts of a run, ready to initialize, run or compile.

    Attributes:
      cfg: the validated config, ``ModelConfig.vocab_size`` resolved.
      sizes: resolved mesh sizes ``{axis: size}`` (ICI x DCN).
      mesh: the device mesh.
      spec: graph definition, optimizer, abstract state and state shardings.
      lr_schedule: ``num_updates -> learning rate`` (optax schedule).
      train_step: jitted ``(state, batch) -> (state, metrics)``; state donated (unless ``donate_state=False``).
      eval_step: jitted ``(params, batch) -> {"loss_sum", "num_target_tokens"}``.
      ramp: the batch sizes by step (:mod:`jaxpt.training.batch_ramp`; constant without ``batch_size_schedule``).
      make_train_step: ``(grad_accum, lr_factor) -> jitted train step``, for the ramp's smaller batches.
    """

    cfg: TrainConfig
    sizes: dict[str, int]
    mesh: jax.sharding.Mesh
    spec: state_lib.StateSpec
    lr_schedule: Any
    train_step: Any
    eval_step: Any
    ramp: batch_ramp.BatchRamp | None = None
    make_train_step: Any = None
    _steps: dict = dataclasses.field(default_factory=dict, repr=False)

    def train_step_for(self, step: int):
        """The jitted train step for step ``step``'s batch size (``train_step`` at the full batch; each other size
        of the ramp is its own jitted step with its micro-batch count and learning-rate factor, one compile each)."""
        rows = self.ramp.batch_size(step) if self.ramp is not None else self.cfg.global_batch_size
        if rows == self.cfg.global_batch_size:
            return self.train_step
        if rows not in self._steps:
            self._steps[rows] = self.make_train_step(self.ramp.grad_accum_for(rows), self.ramp.lr_factor(rows))
        return self._steps[rows]

    def init_state(self, seed: int | None = None) -> state_lib.TrainState:
        """A fresh train state placed in its shardings (``TrainConfig.seed`` unless ``seed`` is given)."""
        return state_lib.init_state(self.spec, self.cfg.model, self.cfg.seed if seed is None else seed)

    def batch_shardings(self) -> dict[str, jax.sharding.NamedSharding]:
        """Sharding of each device-batch key (``step.BATCH_KEYS``)."""
        return step_lib.batch_shardings(self.mesh, self.cfg.logical_axis_rules)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """Shape-only global batch: ``int32[global_batch_size, seq_len]`` per key, with its sharding."""
        shape = (self.cfg.global_batch_size, self.cfg.seq_len)
        return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=s) for k, s in self.batch_shardings().items()}

    def lower_train_step(self) -> jax.stages.Lowered:
        """The train step lowered for the abstract state and batch (no arrays allocated)."""
        return self.train_step.lower(self.spec.abstract, self.abstract_batch())

    def hlo_fingerprint(self) -> str:
        """sha256 (hex) of the lowered train step's StableHLO text: equal iff the programs are equal."""
        return hashlib.sha256(self.lower_train_step().as_text().encode()).hexdigest()


def build(lay: resolve.Layout, *, devices: Sequence[Any] | None = None, donate_state: bool = True) -> Built:
    """Build ``lay``'s mesh, state spec and jitted train/eval steps (no check: ``lay`` was checked for as many
    devices as ``devices`` holds).

    Args:
      lay: the checked config and mesh sizes (:func:`jaxpt.run.resolve.resolve` or :func:`jaxpt.run.resolve.layout`).
      devices: the devices of the mesh (default ``jax.devices()``); compile-only TPU topology devices work too.
      donate_state: whether the train step donates the state (:func:`jaxpt.training.step.jit_train_step`: on CPU,
        1.15x the step rate without, but not the default).
    """
    cfg, sizes = lay.cfg, lay.sizes
    devices = list(jax.devices() if devices is None else devices)
    mesh = mesh_lib.mesh_from_config(cfg.mesh, cfg.dcn_mesh, devices)
    rules = cfg.logical_axis_rules
    horizon = cfg.steps - config_lib.start_step(cfg)  # a stage's schedule starts afresh at its first step
    lr_schedule = optim.learning_rate_schedule(cfg.optimizer, horizon)

    def make_tx(params):  # µP's per-parameter learning rates need the params tree, as the decay mask does
        return optim.make_optimizer(cfg.optimizer, horizon, params, parametrization.lr_multipliers(cfg.model, params))

    spec = state_lib.make_state_spec(
        cfg.model, make_tx, mesh, rules, cfg.stability, offload_optimizer_state=cfg.offload_optimizer_state, shard_optimizer_state=cfg.shard_optimizer_state)

    def make_train_step(grad_accum: int, lr_factor: float = 1.0):
        return step_lib.jit_train_step(spec, mesh, rules, z_loss_weight=cfg.z_loss_weight, lr_schedule=lr_schedule,
                                       grad_clip_norm=cfg.optimizer.grad_clip_norm, grad_accum=grad_accum,
                                       lr_factor=lr_factor, donate_state=donate_state)

    eval_step = step_lib.jit_eval_step(spec, mesh, rules)
    return Built(cfg, sizes, mesh, spec, lr_schedule, make_train_step(cfg.grad_accum_steps), eval_step,
                 batch_ramp.from_config(cfg), make_train_step)


def build_for(cfg: TrainConfig, *, devices: Sequence[Any] | None = None, tokenizer=None,
              donate_state: bool = True) -> Built:
    """:func:`jaxpt.run.resolve.layout` of ``cfg`` for ``devices`` (default ``jax.devices()``), then :func:`build`:
    for a build without a run (a compile for a target slice, a benchmark, a test).

    Raises:
      ConfigError: naming the key, from :func:`jaxpt.run.validate.validate` or :func:`jaxpt.run.resolve.resolve_vocab`.
    """
    devices = list(jax.devices() if devices is None else devices)
    return build(resolve.layout(cfg, len(devices), tokenizer), devices=devices, donate_state=donate_state)
