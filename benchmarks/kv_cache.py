"""Greedy-decoding throughput with and without the KV cache (jaxpt.infer.kv_cache.KVCacheStep vs decode.NoCacheStep).

The quickstart model's shape (d_model 256, 4 layers, 4 heads of 64, 2 kv heads, MLP 768; vocab 8192 here),
random params, fp32, B prompts of different lengths (32 .. 96 tokens) in rows of L = 256 tokens, 64 new
tokens each. Reports new tokens per second (all rows together) after a warm-up generation that compiles both
programs, and checks the two give the same tokens.

    python benchmarks/kv_cache.py [--batch 8] [--seq-len 256] [--new 64] [--mesh data=8]

Figures only, never pass/fail; on a shared 2-core host compare the ratio within one run.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpt.infer import decode  # noqa: E402
from jaxpt.util import cli  # noqa: E402
from jaxpt import mesh as mesh_lib  # noqa: E402
from jaxpt.infer.kv_cache import KVCacheStep  # noqa: E402
from jaxpt.model import Decoder, ModelConfig  # noqa: E402


def model(seq_len: int):
    cfg = ModelConfig(vocab_size=8192, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                      mlp_dim=768, max_seq_len=seq_len)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda a: jax.numpy.asarray(0.05 * rng.standard_normal(a.shape), a.dtype), state)
    return nnx.merge(graphdef, state)


def tokens_per_sec(step, prompts, new: int, repeats: int = 2) -> tuple[float, list]:
    gens = decode.greedy(step, prompts, new)  # compiles
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        gens = decode.greedy(step, prompts, new)
        best = min(best, time.perf_counter() - t0)
    return len(prompts) * new / best, [g.ids for g in gens]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    cli.add_flag(p, "--seq-len", "--seq_len", type=int, default=256)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--mesh", default="data=8")
    args = p.parse_args()
    m = model(args.seq_len)
    mesh = mesh_lib.mesh_from_config(args.mesh)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 8192, size=int(n)).astype(np.int32) for n in rng.integers(32, 97, args.batch)]
    out = {}
    for name, cls in (("no cache", decode.NoCacheStep), ("KV cache", KVCacheStep)):
        step = cls.from_model(m, mesh, seq_len=args.seq_len, batch_size=args.batch)
        out[name] = tokens_per_sec(step, prompts, args.new)
    same = out["no cache"][1] == out["KV cache"][1]
    print(f"{jax.device_count()} x {jax.devices()[0].platform}, mesh {args.mesh}, {args.batch} rows of "
          f"{args.seq_len}, prompts 32..96 tokens, {args.new} new tokens each; same tokens: {same}")
    for name, (tps, _) in out.items():
        print(f"  {name:9s} {tps:10.1f} new tokens/s")
    print(f"  speed-up  {out['KV cache'][0] / out['no cache'][0]:10.2f}x")


if __name__ == "__main__":
    main()
