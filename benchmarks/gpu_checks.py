"""Checks that need a CUDA GPU (never run by the tests): ``attention_impl = 'cudnn'`` against ``xla`` and host
offload of the optimizer state, on the GPU at hand. Prints one JSON object per check.

    python benchmarks/gpu_checks.py            # on a host whose jax sees a CUDA GPU

1. ``attention``: cuDNN's kernel (through :func:`jaxpt.model.dot_product_attention`, ``impl='cudnn'``) against
   ``xla`` on packed GQA rows with padding, bf16 inputs: forward and gradients, each compared with an fp32 ``xla``
   reference; cuDNN's error is reported beside the bf16 ``xla`` error (the yardstick: the same rounding of inputs).
2. ``decoder``: a 4-layer bf16-compute model's loss and gradients with ``cudnn`` vs ``xla``.
3. ``long_rows``: compiled temp bytes (``memory_analysis``) and time of one forward + backward at L = 8192
   (32 heads, 8 kv heads, head_dim 128) for ``cudnn``, ``blockwise`` and ``xla``.
4. ``offload``: three AdamW train steps with the optimizer state in ``pinned_host`` memory equal those without,
   and the compiled step's device and host bytes.
Figures only; nothing here passes or fails a build.
"""

from __future__ import annotations

import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _packed(B, L, seed=0):
    """Rows of documents of random lengths; the last row ends in padding (segment 0). Returns segs, positions."""
    rng = np.random.default_rng(seed)
    segs = np.zeros((B, L), np.int32)
    pos = np.zeros((B, L), np.int32)
    for b in range(B):
        t, doc = 0, 1
        end = L - (L // 5 if b == B - 1 else 0)
        while t < end:
            n = min(end - t, int(rng.integers(L // 16, L // 2)))
            segs[b, t:t + n], pos[b, t:t + n] = doc, np.arange(n)
            t, doc = t + n, doc + 1
        pos[b, end:] = np.arange(L - end)
    return jnp.asarray(segs), jnp.asarray(pos)


def check_attention():
    from jaxpt.model import dot_product_attention
    B, L, H, K, Hd = 2, 1024, 8, 2, 128
    kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kx, (B, L, n, Hd), jnp.float32) for kx, n in ((kq, H), (kk, K), (kv, K)))
    cot = jax.random.normal(kc, (B, L, H, Hd), jnp.float32)
    segs, _ = _packed(B, L)

    def run(impl, dtype):
        def f(q, k, v):
            out, _ = dot_product_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), segs, impl=impl)
            return jnp.sum(out.astype(jnp.float32) * cot), out
        (_, out), g = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(q, k, v)
        return out, g

    ref_out, ref_g = run("xla", jnp.float32)
    res = {"check": "attention", "shape": [B, L, H, K, Hd]}
    for impl in ("cudnn", "xla", "auto"):
        out, g = run(impl, jnp.bfloat16)
        res[impl] = {"out_rel": _rel(out, ref_out), **{f"d{n}_rel": _rel(a, b) for n, a, b in zip("qkv", g, ref_g)}}
    hlo = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, segs, impl="cudnn")[0]).lower(
        *(x.astype(jnp.bfloat16) for x in (q, k, v))).compile().as_text()
    res["cudnn_custom_call_in_hlo"] = "__cudnn$fmha" in hlo
    return res


def check_decoder():
    import dataclasses
    from flax import nnx
    from jaxpt.training import step as step_lib
    from jaxpt.model import Decoder, ModelConfig
    B, L = 4, 512
    cfg = ModelConfig(vocab_size=1024, d_model=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
                      mlp_dim=512, max_seq_len=L, compute_dtype="bfloat16", param_dtype="float32")
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    segs, pos = _packed(B, L, seed=3)
    tokens = jax.random.randint(jax.random.key(1), (B, L), 1, 1024)
    batch = {"tokens": tokens, "segment_ids": segs, "positions": pos}
    out = {"check": "decoder"}
    results = {}
    for impl in ("xla", "cudnn", "blockwise"):
        gd, p = nnx.split(Decoder(dataclasses.replace(cfg, attention_impl=impl), rngs=nnx.Rngs(0)), nnx.Param)
        f = jax.jit(jax.value_and_grad(lambda p: step_lib.loss_fn(p, gd, batch, 1e-4)[0]))
        results[impl] = f(p)
    for impl in ("cudnn", "blockwise"):
        (l0, g0), (l1, g1) = results["xla"], results[impl]
        out[impl] = {"loss_xla": float(l0), "loss": float(l1), "loss_rel": abs(float(l1 - l0)) / abs(float(l0)),
                     "grad_rel_max": max(_rel(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)))}
    return out


def check_long_rows():
    from jaxpt.model import dot_product_attention
    B, L, H, K, Hd = 1, 8192, 32, 8, 128
    q = jnp.zeros((B, L, H, Hd), jnp.bfloat16) + 0.01
    kv = jnp.zeros((B, L, K, Hd), jnp.bfloat16) + 0.01
    segs, _ = _packed(B, L, seed=5)
    res = {"check": "long_rows", "shape": [B, L, H, K, Hd]}
    for impl in ("cudnn", "blockwise", "xla"):
        f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, segs, impl=impl)[0]
                                                     .astype(jnp.float32)), (0, 1, 2)))
        c = f.lower(q, kv, kv).compile()
        jax.block_until_ready(c(q, kv, kv))
        t0 = time.perf_counter()
        for _ in range(5):
            r = c(q, kv, kv)
        jax.block_until_ready(r)
        res[impl] = {"temp_bytes": int(c.memory_analysis().temp_size_in_bytes),
                     "ms_fwd_bwd": 1000 * (time.perf_counter() - t0) / 5}
    return res


def check_offload():
    from jaxpt import mesh as mesh_lib
    from jaxpt.training import optim
    from jaxpt.training import state as state_lib
    from jaxpt.training import step as step_lib
    from jaxpt.model import ModelConfig
    B, L = 8, 256
    cfg = ModelConfig(vocab_size=1024, d_model=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
                      mlp_dim=512, max_seq_len=L, compute_dtype="bfloat16", param_dtype="float32")
    mesh = mesh_lib.mesh_from_config("data=-1", "", jax.devices()[:1])
    rules = mesh_lib.DEFAULT_RULES
    ocfg = optim.OptimizerConfig()
    sched = optim.learning_rate_schedule(ocfg, 100)
    segs, pos = _packed(B, L, seed=7)
    res = {"check": "offload", "memories": [m.kind for m in jax.devices()[0].addressable_memories()]}
    runs = {}
    for offload in (False, True):
        spec = state_lib.make_state_spec(cfg, lambda p: optim.make_optimizer(ocfg, 100, p), mesh, rules,
                                         offload_optimizer_state=offload)
        step = step_lib.jit_train_step(spec, mesh, rules, z_loss_weight=1e-4, lr_schedule=sched, grad_clip_norm=1.0)
        bs = step_lib.batch_shardings(mesh, rules)
        abstract_batch = {k: jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=s) for k, s in bs.items()}
        ma = step.lower(spec.abstract, abstract_batch).compile().memory_analysis()
        state = state_lib.init_state(spec, cfg, 0)
        losses = []
        for i in range(3):
            tokens = jax.random.randint(jax.random.key(10 + i), (B, L), 1, 1024)
            batch = {k: jax.device_put(v, bs[k]) for k, v in
                     {"tokens": tokens, "segment_ids": segs, "positions": pos}.items()}
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        runs[offload] = (losses, state)
        res[f"offload={offload}"] = {
            "losses": losses, "opt_state_memory_kinds": sorted({x.sharding.memory_kind
                                                                for x in jax.tree.leaves(state.opt_state)}),
            **{f: int(getattr(ma, f)) for f in ("argument_size_in_bytes", "output_size_in_bytes",
                                                "alias_size_in_bytes", "temp_size_in_bytes",
                                                "host_argument_size_in_bytes", "host_output_size_in_bytes",
                                                "host_alias_size_in_bytes", "host_temp_size_in_bytes")}}
    (l0, s0), (l1, s1) = runs[False], runs[True]
    res["loss_rel_max"] = max(abs(a - b) / abs(b) for a, b in zip(l1, l0))
    res["state_rel_max"] = max(_rel(a, b) for a, b in zip(jax.tree.leaves((s1.params, s1.opt_state)),
                                                          jax.tree.leaves((s0.params, s0.opt_state))))
    return res


def main() -> None:
    print(json.dumps({"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
                      "compute_capability": getattr(jax.devices()[0], "compute_capability", None)}), flush=True)
    for check in (check_attention, check_decoder, check_offload, check_long_rows):
        try:
            print(json.dumps(check()), flush=True)
        except Exception:  # noqa: BLE001 - report every check, whichever fails
            print(json.dumps({"check": check.__name__, "error": traceback.format_exc()[-3000:]}), flush=True)


if __name__ == "__main__":
    main()
