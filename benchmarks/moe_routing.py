"""Why MoE routing collapses on the quickstart: what enters each MoE router during the first training steps.

    python benchmarks/moe_routing.py [--steps 20] [--gin BINDING ...]
    python benchmarks/moe_routing.py --gin "OptimizerConfig.peak_learning_rate = 3e-3" \
        --gin "ModelConfig.moe_router_sinkhorn_iters = 0"          # the collapse, plain top-k

Trains ``configs/quickstart_moe.gin`` (its data, 8 simulated devices) with the given bindings and, before each
step, runs the same batch through the model unsharded to read each MoE layer's router input ``h [T, D]`` (the
block's normalized hidden states, real tokens only) and prints, per layer:

* ``common``: ``|mean_t h_t|^2 / mean_t |h_t|^2``, the share of the inputs' squared norm that every token has in
  common (0: no shared part; 1: all tokens the same vector).
* ``expert_spread``: std over experts of the token-mean logit (what moves every token's choice at once) and
  ``token_spread``: mean over experts of the std over tokens of the logit around that mean (what can tell tokens
  apart). Plain top-k balances only while ``token_spread`` dominates.
* ``plain``: the expert shares plain top-k of these logits would give, ``share``: the shares the step reports
  (with ``moe_router_sinkhorn_iters > 0``, Sinkhorn-balanced), and ``|g_lb|``: the norm of the weighted
  balancing loss's gradient on the router weights (it reaches the router).

Figures only, never pass/fail.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--gin", action="append", default=[], help="a gin binding (repeatable)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxpt.run import build as builder, resolve as preflight
    from jaxpt import config as C
    from jaxpt.data import stream
    from jaxpt.model import moe as moe_lib

    cfg = C.parse([str(REPO / "configs/quickstart_moe.gin")], args.gin)
    pre = preflight.resolve(cfg)
    built = builder.build(pre.layout)
    cfg = built.cfg
    state = built.init_state()
    batches = stream.train_batches(cfg, pre.tokenizer, stream.data_shard_count(cfg, None), first_step=1)
    weight, k = cfg.model.moe_load_balance_weight, cfg.model.moe_top_k

    captured: list[np.ndarray] = []
    router_logits = moe_lib.MoE.router_logits

    def capturing(self, x):
        if not isinstance(x, jax.core.Tracer):   # the eager forward below, not the jitted step
            captured.append(np.asarray(x, np.float32))
        return router_logits(self, x)

    moe_lib.MoE.router_logits = capturing

    @jax.jit
    def lb_grad(w, b, h):
        return jax.grad(lambda w_: moe_lib.route(jnp.einsum("td,de->te", h, w_)[None] + b, k).load_balance_loss)(w)

    for step in range(1, args.steps + 1):
        local = stream.next_batch(batches)
        model = nnx.merge(built.spec.graphdef, jax.device_get(state.params))
        captured.clear()
        model(jnp.asarray(local["tokens"]), jnp.asarray(local["segment_ids"]), jnp.asarray(local["positions"]))
        state, m = built.train_step(state, stream.to_device(built.mesh, cfg.logical_axis_rules, local))
        m = jax.device_get(m)
        valid = np.asarray(local["segment_ids"]).reshape(-1) > 0
        print(f"step {step}: loss {float(m['loss']):.3f}, load-balancing loss "
              f"{float(m['moe/load_balance_loss']):.3f}, dropped {float(m['moe/dropped_fraction']):.3f}")
        for j, h in enumerate(captured):
            h = h.reshape(-1, h.shape[-1])[valid]
            mlp = model.blocks[j].mlp
            w, b = np.asarray(mlp.w_router[...]), np.asarray(mlp.router_bias[...])
            mean = h.mean(0)
            common = float(mean @ mean / np.mean(np.sum(h * h, 1)))
            logits = h @ w + b
            mu = logits.mean(0)
            top = np.argsort(-logits, 1)[:, :k]
            plain = np.bincount(top.reshape(-1), minlength=w.shape[1]) / top.size
            share = [float(m[f"moe/expert_share/layer{j}/expert{e}"]) for e in range(w.shape[1])]
            g = weight * float(jnp.linalg.norm(lb_grad(jnp.asarray(w), jnp.asarray(b), jnp.asarray(h))))
            print(f"  layer {j}: common {common:.3f}  expert_spread {float(mu.std()):.3f}  token_spread "
                  f"{float((logits - mu).std(0).mean()):.3f}  plain {np.round(plain, 2).tolist()}  share "
                  f"{np.round(share, 2).tolist()}  |g_lb| {g:.2e}", flush=True)


if __name__ == "__main__":
    main()
