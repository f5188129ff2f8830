"""Per-device activation (temp) memory of one transformer layer at L = 8192 on CPU, with the row on one device
(``sequence=1``) and split over four (``sequence=4``, context parallelism), from the compiled train step's
``memory_analysis()``.

The model is the quickstart's layer (d_model 256, 4 heads over 2 kv heads of 64, SwiGLU 768, fp32, no remat)
with one layer and a 512-token vocabulary (so the output logits do not dominate); one row of 8192 tokens per
step. ``sequence=1`` compiles for 1 simulated CPU device, ``sequence=N`` for N, so both hold the same row and
the ratio is what splitting it saves per device. Nothing is run, only compiled.

    python benchmarks/context_parallel_memory.py [--impl xla blockwise] [--seq-len 8192] [--sequence 4]

Prints one line per (implementation, sequence size) and the ratio; figures only, never pass/fail.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
MIB = 2 ** 20


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", nargs="+", default=["xla", "blockwise"])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--sequence", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.sequence}"
    sys.path.insert(0, str(REPO))
    import jax
    from jaxpt.run import build as builder

    from jaxpt import config
    def temp_bytes(impl: str, sequence: int) -> int:
        cfg = config.parse([str(REPO / "configs/quickstart.gin")], [
            "ModelConfig.vocab_size = 512", "ModelConfig.num_layers = 1", f"ModelConfig.max_seq_len = {args.seq_len}",
            f"ModelConfig.attention_impl = {impl!r}", f"TrainConfig.seq_len = {args.seq_len}",
            "TrainConfig.global_batch_size = 1"], mesh=f"sequence={sequence}")
        built = builder.build_for(cfg, devices=jax.devices()[:sequence])
        return built.lower_train_step().compile().memory_analysis().temp_size_in_bytes

    for impl in args.impl:
        one, many = temp_bytes(impl, 1), temp_bytes(impl, args.sequence)
        print(f"{impl:10s} L={args.seq_len}: temp per device sequence=1 {one / MIB:9.1f} MiB, "
              f"sequence={args.sequence} {many / MIB:9.1f} MiB, ratio {one / many:.2f}x", flush=True)


if __name__ == "__main__":
    main()
