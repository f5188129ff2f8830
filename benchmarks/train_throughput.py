"""Train-step throughput of the reference model, with two ceilings, a plain-JAX step and MaxText, side by side.

Reference model (issue 2): d_model 256, 4 layers, 4 heads of 64, MLP 1024, vocab 8192, sequence 256,
global batch 16, fp32, 8 simulated CPU devices. Prints tokens/s, step time and MFU against:
  * the host's large square matmul (2048^3 fp32) FLOP/s, and
  * the same GEMMs as the model's train step at the model's own shapes, data-parallel on the same devices.
A plain-JAX train step (one jit, params replicated, batch split over all devices, no NNX, no logical
rules) runs in the same process as a baseline for the ratio. Each mesh is timed with the optimizer state
replicated (the default) and sharded over the data-parallel axes (``TrainConfig.shard_optimizer_state``, ZeRO-1).

With ``MAXTEXT_PYTHON`` naming a Python 3.12 interpreter with ``maxtext[tpu]`` installed, MaxText's trainer runs the
same model on synthetic data in a subprocess for each mesh (``ici_data/fsdp/tensor_parallelism`` set to match),
alternating with jaxpt round by round (A B A B, ``--rounds``) so that drift hits both; its tokens/s is the median of
its "Tokens/s/device" log lines over steps >= 5, times the device count. ``--json`` prints one object:
``{"meshes": {"data=8": {"jaxpt_tokens_per_sec", "jaxpt_zero1_tokens_per_sec", "maxtext_tokens_per_sec", "ratio",
"gemm_ceiling_fraction", "comm_share", "comm_share/<axes>", "trace_dir"}, ...}, ...}`` (``ratio``: jaxpt / MaxText,
the better of jaxpt's two optimizer layouts; ``comm_share``: the share of device time in collectives over 2 profiled
steps of each mesh, by mesh axis, from a ``jax.profiler`` trace left in ``trace_dir``, :mod:`jaxpt.run.profile_comm`).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/train_throughput.py [--mesh data=8] [--json]

Figures only; never part of the test pass/fail. These 2-core machines are noisy: compare ratios from
one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxpt.run import build as builder  # noqa: E402

from jaxpt.training import optim
from jaxpt.training import flops as flops_lib  # noqa: E402
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


class JaxptStep:
    """The train step exactly as ``jaxpt.train`` builds it (:func:`jaxpt.run.build.build`: stability policy, z-loss,
    schedule and shardings included) on the reference model, compiled once and timed in rounds."""

    def __init__(self, mesh_spec: str, shard_optimizer_state: bool = False):
        cfg = TrainConfig(model=REF, optimizer=optim.OptimizerConfig(warmup_steps=10, decay_steps=1000),
                          mesh=mesh_spec, global_batch_size=BATCH, seq_len=SEQ, steps=1000, z_loss_weight=1e-4,
                          shard_optimizer_state=shard_optimizer_state, compilation_cache_dir="")
        self.built = builder.build_for(cfg)
        shard = self.built.batch_shardings()["tokens"]
        self.batch = {k: jax.device_put(v, shard)
                      for k, v in batch_arrays(np.random.default_rng(0), REF.vocab_size).items()}
        self.state = self.built.init_state()

    def time(self, steps: int) -> float:
        """Median seconds per step over ``steps`` (after 2 warm-up steps)."""
        out = [self.state]

        def step(state, batch):
            out[0], metrics = self.built.train_step(state, batch)
            return out[0], metrics

        t = time_fn(step, self.state, self.batch, steps=steps, carry=True)
        self.state = out[0]
        return t


    def profile(self, trace_dir: str, steps: int = 2) -> dict[str, float]:
        """Trace ``steps`` steps with ``jax.profiler`` into ``trace_dir`` (Perfetto and TensorBoard files, as the
        trainer's ``--profile-steps`` window writes them) and return their communication share by mesh axis
        (:func:`jaxpt.run.profile_comm.comm_share_by_axis`: ``comm_share``, ``comm_share/<axes>``, fractions of device
        time)."""
        from jaxpt.run import profile_comm
        state = jax.block_until_ready(self.state)
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(steps):
            state, _ = self.built.train_step(state, self.batch)
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        self.state = state
        return profile_comm.comm_share_by_axis(trace_dir, self.built.mesh.devices, self.built.mesh.axis_names)


def jaxpt_step_time(mesh_spec: str, steps: int, shard_optimizer_state: bool = False) -> float:
    """Median step time of :class:`JaxptStep` on ``mesh_spec``."""
    return JaxptStep(mesh_spec, shard_optimizer_state).time(steps)


#: ``TrainConfig.mesh`` axis -> MaxText's ICI parallelism key.
MAXTEXT_AXES = {"data": "ici_data_parallelism", "fsdp": "ici_fsdp_parallelism", "tensor": "ici_tensor_parallelism"}
_MAXTEXT_STEP = re.compile(r"completed step: (\d+),.*?Tokens/s/device: ([0-9.]+)")


def maxtext_command(python: str, mesh_spec: str, out_dir: str, steps: int = 30) -> list[str]:
    """MaxText's trainer on the reference model (the command of issue 21), its mesh matching ``mesh_spec``.

    Raises:
      ValueError: ``mesh_spec`` uses an axis MaxText's command here has no key for (only data, fsdp, tensor).
    """
    sizes = {a: 1 for a in MAXTEXT_AXES}
    for part in filter(None, mesh_spec.split(",")):
        axis, size = part.split("=")
        if axis not in MAXTEXT_AXES:
            raise ValueError(f"--mesh {mesh_spec}: no MaxText parallelism key for axis {axis!r}")
        sizes[axis] = int(size)
    base = subprocess.run([python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    per_device = BATCH // jax.device_count()
    return [python, "-m", "maxtext.trainers.pre_train.train", os.path.join(base, "configs", "base.yml"),
            "run_name=peer", f"base_output_directory={out_dir}", "hardware=cpu", "dataset_type=synthetic",
            f"steps={steps}", "enable_checkpointing=false", f"per_device_batch_size={per_device}",
            f"max_target_length={SEQ}", f"vocab_size={REF.vocab_size}", f"base_emb_dim={REF.d_model}",
            f"base_num_query_heads={REF.num_heads}", f"base_num_kv_heads={REF.num_kv_heads}",
            f"head_dim={REF.head_dim}", f"base_mlp_dim={REF.mlp_dim}", f"base_num_decoder_layers={REF.num_layers}",
            "log_period=10", "skip_jax_distributed_system=true", "enable_tensorboard=false", "dtype=float32",
            *(f"{MAXTEXT_AXES[a]}={n}" for a, n in sizes.items())]


def parse_maxtext_tokens_per_sec(log: str, devices: int, first_step: int = 5) -> float:
    """Median of MaxText's "Tokens/s/device" over the steps >= ``first_step``, times ``devices`` (tokens/s, host).

    Raises:
      ValueError: no such step line in ``log``.
    """
    rates = [float(r) for s, r in _MAXTEXT_STEP.findall(log) if int(s) >= first_step]
    if not rates:
        raise ValueError(f"no MaxText 'completed step: N (>= {first_step}) ... Tokens/s/device' line in its log")
    return statistics.median(rates) * devices


def maxtext_tokens_per_sec(python: str, mesh_spec: str, steps: int = 30, timeout_s: float = 1800) -> float:
    """Run MaxText once on ``mesh_spec`` (8 simulated CPU devices) and return its tokens/s.

    Raises:
      RuntimeError: the trainer failed (the end of its log in the message), or ValueError from the parser.
    """
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={jax.device_count()}",
               JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE")
    with tempfile.TemporaryDirectory(prefix="maxtext_") as out:
        proc = subprocess.run(maxtext_command(python, mesh_spec, out, steps), env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"MaxText on {mesh_spec} exited with {proc.returncode}: {log[-3000:]}")
    return parse_maxtext_tokens_per_sec(log, jax.device_count())


def plain_jax_step():
    """A straightforward data-parallel step: dict params, one jit, einsum attention, optax adamw.

    Returns ``(step, carry, batch)``: the jitted ``(carry, batch) -> (carry, loss)``, the replicated
    ``(params, opt_state)`` and the batch split over all devices.
    """
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
    return step, carry, batch


def plain_jax_step_time(steps: int) -> float:
    """Median seconds per step of :func:`plain_jax_step`."""
    step, carry, batch = plain_jax_step()
    return time_fn(step, carry, batch, steps=steps, carry=True)


def model_gemm_ceiling(repeats: int = 5) -> float:
    """FLOP/s of the train step's GEMMs alone, at the model's shapes, data-parallel over all devices: per layer
    and for the output head, each projection's forward ``x W``, ``dX = dY W^T`` and ``dW = X^T dY``; per layer the
    attention's forward ``S = Q K^T``, ``O = S V`` and backward ``dP = dO V^T``, ``dV = S^T dO``, ``dQ = dP K``,
    ``dK = dP^T Q``. Every GEMM reads distinct buffers, so XLA cannot merge two of them (common-subexpression
    elimination), and the FLOPs counted are exactly the GEMMs computed. Units: FLOP/s for the whole host."""
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
    qkvo = [jax.device_put(jnp.full((BATCH, H, SEQ, Hd), 0.01 * (i + 1), jnp.float32), dp) for i in range(4)]

    @jax.jit
    def gemms(x, xf, qkvo, ws):
        q, k, v, do = qkvo
        acc = 0.0
        for _ in range(cfg.num_layers):
            for w in ws[:4] + ws[4:6]:
                y = x @ w                                   # forward
                acc += y.sum() + (y @ w.T).sum() + jnp.einsum("bld,ble->de", x, y).sum()  # dX, dW
            y = xf @ ws[6]
            acc += y.sum() + (y @ ws[6].T).sum() + jnp.einsum("blf,bld->fd", xf, y).sum()
            s = jnp.einsum("bhld,bhmd->bhlm", q, k)         # S = Q K^T
            dp_ = jnp.einsum("bhld,bhmd->bhlm", do, v)      # dP = dO V^T
            acc += (s.sum() + jnp.einsum("bhlm,bhmd->bhld", s, v).sum()     # O = S V
                    + jnp.einsum("bhlm,bhld->bhmd", s, do).sum()           # dV = S^T dO
                    + dp_.sum() + jnp.einsum("bhlm,bhmd->bhld", dp_, k).sum()  # dQ = dP K
                    + jnp.einsum("bhlm,bhld->bhmd", dp_, q).sum())         # dK = dP^T Q
        y = x @ ws[7]
        acc += y.sum() + (y @ ws[7].T).sum() + jnp.einsum("bld,blv->dv", x, y).sum()
        return acc

    proj = 4 * D * H * Hd + 2 * D * F + F * D
    flops = 3 * 2 * T * (cfg.num_layers * proj + D * V) + cfg.num_layers * 6 * 2 * BATCH * H * SEQ * SEQ * Hd
    t = time_fn(gemms, x, xf, qkvo, ws, steps=repeats)
    return flops / t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", action="append", default=None,
                    help="mesh(es) for the jaxpt step (default: data=8, fsdp=8 and data=2,fsdp=2,tensor=2)")
    ap.add_argument("--steps", type=int, default=10, help="timed jaxpt steps per round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of jaxpt then MaxText (A B A B); medians over them")
    ap.add_argument("--maxtext-steps", type=int, default=30, help="steps of each MaxText run")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--profile-dir", default=None,
                    help="after the timed rounds, trace 2 steps of each mesh (default optimizer layout) into "
                         "DIR/<mesh> and report their communication share by mesh axis (default: a temporary "
                         "directory; 'none' skips it)")
    args = ap.parse_args()
    meshes = args.mesh or ["data=8", "fsdp=8", "data=2,fsdp=2,tensor=2"]
    maxtext = os.environ.get("MAXTEXT_PYTHON")
    tokens = BATCH * SEQ
    fpt = flops_lib.flops_per_token(REF, SEQ)
    step_flops = tokens * fpt
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print  # noqa: E731
    say(f"reference model: {REF.d_model=} {REF.num_layers=} {REF.num_heads=}x{REF.head_dim} "
        f"{REF.mlp_dim=} {REF.vocab_size=} seq {SEQ} batch {BATCH} fp32; {jax.device_count()} devices")
    say(f"model FLOPs per token {fpt / 1e6:.1f} MFLOP (6N_matmul + causal attention); "
        f"per step {step_flops / 1e9:.1f} GFLOP")
    square = flops_lib.measure_matmul_peak(n=2048, dtype=jnp.float32)
    gemm = model_gemm_ceiling()
    say(f"ceiling 1, square 2048^3 fp32 matmul on one device: {square / 1e9:.1f} GFLOP/s (host)")
    say(f"ceiling 2, the model's GEMMs at its shapes on {jax.device_count()} devices: {gemm / 1e9:.1f} GFLOP/s (host)")
    t_plain = plain_jax_step_time(args.steps)
    steps = {(m, z): JaxptStep(m, z) for m in meshes for z in (False, True)}
    times: dict = {k: [] for k in steps}
    mt: dict[str, list[float]] = {m: [] for m in meshes}
    for r in range(args.rounds):  # A B A B: jaxpt, then MaxText, per mesh, each round
        for m in meshes:
            for z in (False, True):
                times[(m, z)].append(steps[(m, z)].time(args.steps))
            if maxtext:
                mt[m].append(maxtext_tokens_per_sec(maxtext, m, args.maxtext_steps))
                say(f"round {r + 1}: {m}: jaxpt {tokens / times[(m, False)][-1]:.0f} (ZeRO-1 "
                    f"{tokens / times[(m, True)][-1]:.0f}), MaxText {mt[m][-1]:.0f} tokens/s")
    shares = {}
    if args.profile_dir != "none":
        root = args.profile_dir or tempfile.mkdtemp(prefix="jaxpt-throughput-profile-")
        for m in meshes:
            trace_dir = os.path.join(root, m.replace(",", "_").replace("=", ""))
            shares[m] = {"trace_dir": trace_dir, **steps[(m, False)].profile(trace_dir)}
            say(f"{m}: collectives {shares[m]['comm_share']:.1%} of device time ("
                + ", ".join(f"{k.split('/', 1)[1]} {v:.1%}" for k, v in shares[m].items()
                            if k.startswith("comm_share/")) + f"); trace in {trace_dir}")
    med = {k: float(np.median(v)) for k, v in times.items()}
    out = {"meshes": {}, "plain_jax_tokens_per_sec": tokens / t_plain, "gemm_ceiling_flops": gemm,
           "square_matmul_flops": square, "rounds": args.rounds, "maxtext": bool(maxtext)}
    for m in meshes:
        best = min(med[(m, False)], med[(m, True)])
        row = {"jaxpt_tokens_per_sec": tokens / med[(m, False)], "jaxpt_zero1_tokens_per_sec": tokens / med[(m, True)],
               "maxtext_tokens_per_sec": statistics.median(mt[m]) if mt[m] else None,
               "gemm_ceiling_fraction": step_flops / best / gemm, "vs_plain_jax": t_plain / best}
        row["ratio"] = tokens / best / row["maxtext_tokens_per_sec"] if mt[m] else None
        row.update(shares.get(m, {}))
        out["meshes"][m] = row
    if args.json:
        print(json.dumps(out, indent=2))
        return
    rows = [("plain JAX (data-parallel, one jit)", t_plain, None)]
    for m in meshes:
        rows.append((f"jaxpt mesh {m}", med[(m, False)], None))
        rows.append((f"jaxpt mesh {m}, ZeRO-1", med[(m, True)], None))
        if mt[m]:
            rows.append((f"MaxText {m}", tokens / out["meshes"][m]["maxtext_tokens_per_sec"], None))
    print(f"\n{'step':42s} {'step s':>8s} {'tokens/s':>9s} {'GFLOP/s':>8s} {'MFU/sq':>7s} {'MFU/gemm':>8s} {'vs plain':>8s}")
    for name, t, _ in rows:
        achieved = step_flops / t
        print(f"{name:42s} {t:8.3f} {tokens / t:9.0f} {achieved / 1e9:8.1f} {achieved / square:7.1%} "
              f"{achieved / gemm:8.1%} {t_plain / t:8.2f}x")


if __name__ == "__main__":
    main()
