"""How much a mixture of experts' training routing moves its held-out loss, and why: later tokens, or the routing.

    python benchmarks/moe_heldout_routing.py --workdir RUN [--step N] [--windows 32] [--batch-size 16]

Restores an MoE checkpoint (e.g. ``configs/quickstart_moe.gin`` trained a few hundred steps) and scores the same
held-out windows (the run's held-out set, one document-aligned window per row, as
:func:`jaxpt.eval.heldout.perplexity_report` cuts them; the first ``--windows`` of them) three ways, over the same
scored tokens:

* ``causal``: each token routed by itself (what evaluation and decoding use, ``routing='causal'``);
* ``train, whole row``: the training routing over the whole window (capacity and Sinkhorn offsets from the whole
  routing group, later tokens included): what held-out figures were before causal routing;
* ``train, prefix only``: the training routing, each scored token predicted from a row holding only the tokens
  before it (one row per scored token), so no later token takes part in any routing decision.

``train, whole row`` minus ``train, prefix only`` is what seeing later tokens is worth; ``train, prefix only``
minus ``causal`` what the training routing's balancing is worth without them. For the whole held-out set's two
routings side by side use ``python -m jaxpt.tools.evaluate heldout --workdir RUN --routing causal|train``.

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
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--step", type=int)
    ap.add_argument("--windows", type=int, default=32, help="held-out windows scored (default 32)")
    ap.add_argument("--batch-size", type=int, default=16, help="rows per device call (default 16)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxpt import mesh as mesh_lib
    from jaxpt.eval import heldout
    from jaxpt.infer.restore import restore

    r = restore(args.workdir, args.step)
    cfg = r.config
    L, B = cfg.seq_len, args.batch_size
    docs = heldout.load_documents(heldout.run_sources(cfg.data)[0], "heldout")
    windows = heldout.HeldoutSet.build(docs, r.tokenizer, seq_len=L, document_boundary=cfg.data.document_boundary).windows[:args.windows]
    graphdef, params = nnx.split(r.model, nnx.Param)
    batch_s = mesh_lib.batch_sharding(r.mesh, cfg.logical_axis_rules)

    def logp(p, tokens, seg, routing):
        with mesh_lib.activation_sharding(r.mesh, cfg.logical_axis_rules):
            pos = jnp.cumsum(seg, axis=1) * seg - seg
            logits = nnx.merge(graphdef, p)(tokens, seg, pos, routing=routing)
            return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)

    fn = jax.jit(logp, static_argnums=3)

    def run(rows, routing):
        """``rows``: (token ids, [(position, target)]) each; returns the summed log-probability of the targets."""
        total = 0.0
        for b0 in range(0, len(rows), B):
            tokens, seg = np.zeros((B, L), np.int32), np.zeros((B, L), np.int32)
            for i, (ids, _) in enumerate(rows[b0:b0 + B]):
                tokens[i, :len(ids)], seg[i, :len(ids)] = ids, 1
            put = lambda a: jax.make_array_from_callback(a.shape, batch_s, lambda idx: a[idx])  # noqa: E731
            out = np.asarray(jax.device_get(fn(params, put(tokens), put(seg), routing)))
            for i, (_, targets) in enumerate(rows[b0:b0 + B]):
                total += sum(float(out[i, t, y]) for t, y in targets)
        return total

    whole = [(w.tokens, [(k - 1, int(w.tokens[k])) for k in range(w.first, len(w.tokens))]) for w in windows]
    prefix = [(w.tokens[:k], [(k - 1, int(w.tokens[k]))]) for w in windows for k in range(w.first, len(w.tokens))]
    n = sum(len(t) for _, t in whole)
    print(f"step {r.step}: {len(windows)} windows, {n} scored tokens, rows of {L}")
    for name, rows, routing in (("causal", whole, "causal"), ("train, whole row", whole, "train"),
                                ("train, prefix only", prefix, "train")):
        loss = -run(rows, routing) / n
        print(f"  {name:<20} held-out loss {loss:.4f}  perplexity {np.exp(loss):.2f}")


if __name__ == "__main__":
    main()
