"""Train-step throughput of the reference model, with two ceilings and a plain-JAX step, side by side.

Reference model (issue 2): d_model 256, 4 layers, 4 heads of 64, MLP 1024, vocab 8192, sequence 256,
global batch 16, fp32, 8 simulated CPU devices. Prints tokens/s, step time and MFU against:
  * the host's large square matmul (2048^3 fp32) FLOP/s, and
  * the same GEMMs as the model's train step at the model's own shapes, data-parallel on the same devices.
A plain-JAX train step (one jit, params replicated, batch split over all devices, no NNX, no logical
rules) runs in the same process as a baseline for the ratio.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/train_throughput.py [--mesh data=8]

Figures only; never part of the test pass/fail. These 2-core machines are noisy: compare ratios from
one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxpt import builder, optim  # noqa: E402
from jaxpt import flops as flops_lib  # noqa: E402
from jaxpt.config import TrainConfig  # noqa: E402
from jaxpt.model import ModelConfig  # noqa: E402

REF = ModelConfig(vocab_size=8192, d_model=256, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=64,
                  mlp_dim=1024, max_seq_len=256, compute_dtype="float32", param_dtype="float32")
SEQ, BATCH = 256, 16


def batch_arrays(rng, vocab):
    tokens = rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int32)
    # Realistic packing: 3 documents per row.
    seg = np.repeat(np.arange(1, 4), [100, 100, 56])[None].repeat(BATCH, 0).astype(np.int32)
    pos = np.concatenate([np.arange(100), np.arange(100), np.arange(56)])[None].repeat(BATCH, 0).astype(np.int32)
    return {"tokens": tokens, "segment_ids": seg, "positions": pos}


def time_fn(fn, *args, steps: int, warmup: int = 2, carry: bool = False):
    """Median seconds per call (state threaded through when ``carry``)."""
    out = None
    for _ in range(warmup):
        out = fn(*args)
        args = (out[0],) + args[1:] if carry else args
        jax.block_until_ready(out)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
        args = (out[0],) + args[1:] if carry else args
    return float(np.median(times))


def jaxpt_step_time(mesh_spec: str, steps: int) -> float:
    """Median step time of the train step exactly as ``jaxpt.train`` builds it (:func:`jaxpt.builder.build`:
    stability policy, z-loss, schedule and shardings included) on the reference model."""
    cfg = TrainConfig(model=REF, optimizer=optim.OptimizerConfig(warmup_steps=10, decay_steps=1000),
                      mesh=mesh_spec, global_batch_size=BATCH, seq_len=SEQ, steps=1000, z_loss_weight=1e-4)
    built = builder.build(cfg)
    shard = built.batch_shardings()["tokens"]
    batch = {k: jax.device_put(v, shard) for k, v in batch_arrays(np.random.default_rng(0), REF.vocab_size).items()}
    return time_fn(built.train_step, built.init_state(), batch, steps=steps, carry=True)


def plain_jax_step_time(steps: int) -> float:
    """A straightforward data-parallel step: dict params, one jit, einsum attention, optax adamw."""
    cfg = REF
    D, H, Hd, F, V = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
    k = iter(jax.random.split(jax.random.key(0), 64))
    n = lambda *s: 0.02 * jax.random.normal(next(k), s)  # noqa: E731
    params = {"emb": n(V, D), "out": n(D, V), "norm": jnp.ones(D),
              "layers": [{"wq": n(D, H * Hd), "wk": n(D, H * Hd), "wv": n(D, H * Hd), "wo": n(H * Hd, D),
                          "wg": n(D, F), "wu": n(D, F), "wd": n(F, D), "n1": jnp.ones(D), "n2": jnp.ones(D)}
                         for _ in range(cfg.num_layers)]}
    tx = optax.adamw(1e-3)
    opt = tx.init(params)

    def rms(x, s):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * s

    def rope(x, pos):
        inv = 1.0 / (10000 ** (jnp.arange(0, Hd, 2) / Hd))
        a = pos[..., None].astype(jnp.float32) * inv
        c, s_ = jnp.cos(a)[:, :, None], jnp.sin(a)[:, :, None]
        x1, x2 = jnp.split(x, 2, -1)
        return jnp.concatenate([x1 * c - x2 * s_, x2 * c + x1 * s_], -1)

    def loss(p, b):
        x = p["emb"][b["tokens"]]
        B, L = b["tokens"].shape
        seg = b["segment_ids"]
        mask = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((L, L), bool))
        for lp in p["layers"]:
            h = rms(x, lp["n1"])
            q = rope((h @ lp["wq"]).reshape(B, L, H, Hd), b["positions"])
            kk = rope((h @ lp["wk"]).reshape(B, L, H, Hd), b["positions"])
            v = (h @ lp["wv"]).reshape(B, L, H, Hd)
            s = jnp.einsum("blhd,bmhd->bhlm", q, kk) / np.sqrt(Hd)
            s = jnp.where(mask[:, None], s, -1e30)
            o = jnp.einsum("bhlm,bmhd->blhd", jax.nn.softmax(s, -1), v).reshape(B, L, H * Hd)
            x = x + o @ lp["wo"]
            h = rms(x, lp["n2"])
            x = x + (jax.nn.silu(h @ lp["wg"]) * (h @ lp["wu"])) @ lp["wd"]
        logits = rms(x, p["norm"]) @ p["out"]
        tgt = jnp.concatenate([b["tokens"][:, 1:], b["tokens"][:, :1]], 1)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tgt[..., None], -1)[..., 0])

    mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    rep, dp = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))

    @jax.jit
    def step(carry, b):
        p, o = carry
        l, g = jax.value_and_grad(loss)(p, b)
        u, o = tx.update(g, o, p)
        return (optax.apply_updates(p, u), o), l

    carry = jax.device_put((params, opt), rep)
    batch = {kk: jax.device_put(v, dp) for kk, v in batch_arrays(np.random.default_rng(0), V).items()}
    return time_fn(step, carry, batch, steps=steps, carry=True)


def model_gemm_ceiling(repeats: int = 5) -> float:
    """FLOP/s of the train step's GEMMs alone (fwd: x@W per projection, QK^T, AV; bwd: 2 GEMMs per fwd GEMM),
    at the model's shapes, data-parallel over all devices. Units: FLOP/s for the whole host."""
    cfg = REF
    D, H, Hd, F, V = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
    T = BATCH * SEQ
    mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    dp = NamedSharding(mesh, P("d"))
    rep = NamedSharding(mesh, P())
    shapes = [(D, H * Hd)] * 4 + [(D, F)] * 2 + [(F, D)]
    ws = [jax.device_put(jnp.full(s, 0.01, jnp.float32), rep) for s in shapes] + [
        jax.device_put(jnp.full((D, V), 0.01, jnp.float32), rep)]
    x = jax.device_put(jnp.ones((BATCH, SEQ, D), jnp.float32), dp)
    xf = jax.device_put(jnp.ones((BATCH, SEQ, F), jnp.float32), dp)
    q = jax.device_put(jnp.ones((BATCH, H, SEQ, Hd), jnp.float32), dp)

    @jax.jit
    def gemms(x, xf, q, ws):
        acc = 0.0
        for _ in range(cfg.num_layers):
            for w in ws[:4] + ws[4:6]:
                y = x @ w                                   # forward
                acc += y.sum() + (y @ w.T).sum() + jnp.einsum("bld,ble->de", x, y).sum()  # dX, dW
            y = xf @ ws[6]
            acc += y.sum() + (y @ ws[6].T).sum() + jnp.einsum("blf,bld->fd", xf, y).sum()
            s = jnp.einsum("bhld,bhmd->bhlm", q, q)
            o = jnp.einsum("bhlm,bhmd->bhld", s, q)
            acc += s.sum() + o.sum() + 2 * jnp.einsum("bhlm,bhld->bhmd", s, o).sum() + jnp.einsum("bhlm,bhmd->bhld", s, q).sum() + jnp.einsum("bhld,bhmd->bhlm", o, q).sum()
        y = x @ ws[7]
        acc += y.sum() + (y @ ws[7].T).sum() + jnp.einsum("bld,blv->dv", x, y).sum()
        return acc

    flops = cfg.num_layers * (6 * 2 * T * D * H * Hd * 4 / 4 * 1 + 0)  # placeholder, recomputed below
    proj = 4 * D * H * Hd + 2 * D * F + F * D
    flops = 3 * 2 * T * (cfg.num_layers * proj + D * V) + cfg.num_layers * 3 * 2 * 2 * BATCH * H * SEQ * SEQ * Hd
    t = time_fn(gemms, x, xf, q, ws, steps=repeats)
    return flops / t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", action="append", default=None,
                    help="mesh(es) for the jaxpt step (default: data=8 and data=2,fsdp=2,tensor=2)")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    meshes = args.mesh or ["data=8", "data=2,fsdp=2,tensor=2"]
    tokens = BATCH * SEQ
    fpt = flops_lib.flops_per_token(REF, SEQ)
    step_flops = tokens * fpt
    print(f"reference model: {REF.d_model=} {REF.num_layers=} {REF.num_heads=}x{REF.head_dim} "
          f"{REF.mlp_dim=} {REF.vocab_size=} seq {SEQ} batch {BATCH} fp32; {jax.device_count()} devices")
    print(f"model FLOPs per token {fpt / 1e6:.1f} MFLOP (6N_matmul + causal attention); per step {step_flops / 1e9:.1f} GFLOP")
    square = flops_lib.measure_matmul_peak(n=2048, dtype=jnp.float32)
    gemm = model_gemm_ceiling()
    print(f"ceiling 1, square 2048^3 fp32 matmul on one device: {square / 1e9:.1f} GFLOP/s (host)")
    print(f"ceiling 2, the model's GEMMs at its shapes on {jax.device_count()} devices: {gemm / 1e9:.1f} GFLOP/s (host)")
    t_plain = plain_jax_step_time(args.steps)
    rows = [("plain JAX (data-parallel, one jit)", t_plain)]
    for m in meshes:
        rows.append((f"jaxpt mesh {m}", jaxpt_step_time(m, args.steps)))
    print(f"\n{'step':42s} {'step s':>8s} {'tokens/s':>9s} {'GFLOP/s':>8s} {'MFU/sq':>7s} {'MFU/gemm':>8s} {'vs plain':>8s}")
    for name, t in rows:
        achieved = step_flops / t
        print(f"{name:42s} {t:8.3f} {tokens / t:9.0f} {achieved / 1e9:8.1f} {achieved / square:7.1%} "
              f"{achieved / gemm:8.1%} {t_plain / t:8.2f}x")


if __name__ == "__main__":
    main()
