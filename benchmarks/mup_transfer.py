"""Does the best learning rate transfer across width? A learning-rate sweep at several widths, SP and µP, side by side.

    python -m jaxpt.data.prepare --output artifacts/sample            # the bundled sample, once
    python benchmarks/mup_transfer.py run --output artifacts/mup_transfer.jsonl
    python benchmarks/mup_transfer.py report artifacts/mup_transfer.jsonl --plot artifacts/mup_transfer.png

``run`` trains, for each parametrization (``sp``, ``mup`` with base width 64), width (64, 128, 256, 512: heads and
MLP grow, head_dim and depth fixed), learning rate (a x2 grid) and seed, one small decoder on the same token stream of
the bundled sample (jaxpt's own train step and optimizer: AdamW, warmup then cosine to 10%), and appends its final
held-out loss to the JSON Lines file; runs already there are skipped, so an interrupted sweep resumes. At width 64
µP is SP exactly (m = 1, tested in tests/test_parametrization.py), so those runs are shared.

``report`` prints, per parametrization and width, the mean held-out loss over seeds at each learning rate, the best
learning rate, how many grid steps it moves from width 64 to the widest, and the transfer figure: the loss at the
widest width with the learning rate that was best at width 64, against the best loss of the widest width's sweep
(relative difference, %), with the seed spread beside it. Benchmarks print figures; they are never tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

import numpy as np

HEAD_DIM = 16
BASE_WIDTH = 64


@dataclasses.dataclass(frozen=True)
class Sweep:
    widths: tuple[int, ...] = (64, 128, 256, 512)
    lr_exponents: tuple[int, ...] = (-10, -9, -8, -7, -6, -5)   # learning rates 2^e
    seeds: tuple[int, ...] = (0, 1)
    layers: int = 2
    steps: int = 150
    warmup: int = 15
    batch: int = 16
    seq_len: int = 64
    eval_batches: int = 16


def _tokens(path: str, tokenizer, limit: int) -> np.ndarray:
    """Documents of a prepared JSON Lines file, tokenized and joined with EOS, up to ``limit`` tokens (int32)."""
    from jaxpt.util import jsonl
    out, n = [], 0
    for _, doc in jsonl.iter_objects(path):
        ids = list(tokenizer.encode(doc["text"])) + [tokenizer.eos_id]
        out.append(np.asarray(ids, np.int32))
        n += len(ids)
        if n >= limit:
            break
    return np.concatenate(out)[:limit]


def _rows(stream: np.ndarray, batch: int, seq_len: int) -> np.ndarray:
    n = len(stream) // (batch * seq_len)
    return stream[: n * batch * seq_len].reshape(n, batch, seq_len)


def _batch(tokens: np.ndarray) -> dict[str, np.ndarray]:
    return {"tokens": tokens, "segment_ids": np.ones_like(tokens),
            "positions": np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape).copy()}


def one_run(kind: str, width: int, lr: float, seed: int, sweep: Sweep, data) -> dict:
    """Train one model; returns its record (held-out loss in nats per token, tokens, seconds)."""
    import jax

    from jaxpt import mesh as M
    from jaxpt.model import ModelConfig, parametrization
    from jaxpt.training import optim, state as S, step as step_lib
    train_rows, heldout_rows, vocab = data
    cfg = ModelConfig(vocab_size=vocab, d_model=width, num_layers=sweep.layers, num_heads=width // HEAD_DIM,
                      num_kv_heads=width // HEAD_DIM, head_dim=HEAD_DIM, mlp_dim=4 * width, max_seq_len=sweep.seq_len,
                      parametrization=kind, mup_base_d_model=BASE_WIDTH if kind == "mup" else 0)
    ocfg = optim.OptimizerConfig(peak_learning_rate=lr, schedule="cosine", warmup_steps=sweep.warmup,
                                 decay_steps=sweep.steps)
    mesh = M.make_mesh("data=1")
    spec = S.make_state_spec(
        cfg, lambda p: optim.make_optimizer(ocfg, sweep.steps, p, parametrization.lr_multipliers(cfg, p)), mesh,
        M.DEFAULT_RULES)
    step = step_lib.jit_train_step(spec, mesh, M.DEFAULT_RULES, z_loss_weight=1e-4,
                                   lr_schedule=optim.learning_rate_schedule(ocfg, sweep.steps),
                                   grad_clip_norm=ocfg.grad_clip_norm)
    evaluate = step_lib.jit_eval_step(spec, mesh, M.DEFAULT_RULES)
    t0 = time.perf_counter()
    state = S.init_state(spec, cfg, seed=seed)
    order = np.random.default_rng(seed).permutation(len(train_rows))   # the seed also picks the data order
    for i in range(sweep.steps):
        state, metrics = step(state, _batch(train_rows[order[i % len(order)]]))
    train_loss = float(metrics["loss"])
    loss_sum = tokens = 0.0
    for rows in heldout_rows[: sweep.eval_batches]:
        out = jax.device_get(evaluate(state.params, _batch(rows)))
        loss_sum += float(out["loss_sum"])
        tokens += float(out["num_target_tokens"])
    heldout = loss_sum / tokens
    return {"parametrization": kind, "width": width, "lr": lr, "seed": seed, "heldout_loss": heldout,
            "train_loss": train_loss, "diverged": not math.isfinite(heldout),
            "tokens": sweep.steps * sweep.batch * sweep.seq_len, "seconds": round(time.perf_counter() - t0, 2)}


def run(args) -> None:
    from jaxpt.data.tokenizer import Tokenizer
    sweep = Sweep(widths=tuple(args.widths), seeds=tuple(args.seeds), steps=args.steps,
                  lr_exponents=tuple(args.lr_exponents))
    tok = Tokenizer.load(os.path.join(args.data, "tokenizer.model"))
    need = sweep.steps * sweep.batch * sweep.seq_len
    train = _rows(_tokens(os.path.join(args.data, "train.jsonl.gz"), tok, need), sweep.batch, sweep.seq_len)
    heldout = _rows(_tokens(os.path.join(args.data, "heldout.jsonl.gz"), tok,
                            sweep.eval_batches * sweep.batch * sweep.seq_len), sweep.batch, sweep.seq_len)
    data = (train, heldout, tok.vocab_size)
    out = pathlib.Path(args.output)
    done = {(r["parametrization"], r["width"], r["lr"], r["seed"]) for r in _read(out)}
    todo = [(k, w, 2.0 ** e, s) for w in sweep.widths for k in ("sp", "mup") for e in sweep.lr_exponents
            for s in sweep.seeds if not (k == "mup" and w == BASE_WIDTH)]
    todo = [t for t in todo if t not in done]
    print(f"{len(todo)} runs to do ({len(done)} done); {sweep}", flush=True)
    for i, (k, w, lr, s) in enumerate(todo):
        rec = one_run(k, w, lr, s, sweep, data)
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"[{i + 1}/{len(todo)}] {k} width {w} lr 2^{math.log2(lr):.0f} seed {s}: held-out "
              f"{rec['heldout_loss']:.4f} ({rec['seconds']} s)", flush=True)


def _read(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _table(records: list[dict]) -> dict:
    """``{kind: {width: {lr: [losses over seeds]}}}``; µP at the base width reuses SP's runs (they are equal)."""
    table: dict = {}
    for r in records:
        kinds = ("sp", "mup") if r["width"] == BASE_WIDTH and r["parametrization"] == "sp" else (r["parametrization"],)
        for k in kinds:
            loss = r["heldout_loss"] if math.isfinite(r["heldout_loss"]) else float("inf")
            table.setdefault(k, {}).setdefault(r["width"], {}).setdefault(r["lr"], []).append(loss)
    return table


def report(args) -> None:
    table = _table(_read(pathlib.Path(args.results)))
    summary = {}
    for kind, by_width in sorted(table.items()):
        widths = sorted(by_width)
        print(f"\n{kind}: mean held-out loss over seeds (nats/token) by learning rate")
        lrs = sorted({lr for w in widths for lr in by_width[w]})
        print("width " + " ".join(f"{'2^%d' % round(math.log2(lr)):>8}" for lr in lrs) + "   best")
        best = {}
        for w in widths:
            means = {lr: float(np.mean(v)) for lr, v in by_width[w].items()}
            best[w] = min(means, key=means.get)
            print(f"{w:5d} " + " ".join(f"{means.get(lr, float('nan')):8.4f}" for lr in lrs)
                  + f"   2^{round(math.log2(best[w]))}")
        lo, hi = widths[0], widths[-1]
        shift = round(math.log2(best[hi] / best[lo]))
        at_hi = by_width[hi]
        transferred = float(np.mean(at_hi[best[lo]])) if best[lo] in at_hi else float("nan")
        best_hi = float(np.mean(at_hi[best[hi]]))
        spread = float(np.ptp(at_hi[best[hi]])) if len(at_hi[best[hi]]) > 1 else float("nan")
        gap = 100 * (transferred / best_hi - 1)
        print(f"best lr moves {shift:+d} grid steps from width {lo} to {hi}; width {hi} with width {lo}'s best lr: "
              f"{transferred:.4f} vs its best {best_hi:.4f} ({gap:+.2f}%; seed spread at its best {spread:.4f})")
        summary[kind] = {"best_lr": {w: best[w] for w in widths}, "shift_steps": shift, "transfer_gap_pct": gap}
    print(json.dumps(summary))
    if args.plot:
        _plot(table, args.plot)


def _plot(table: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(table), figsize=(5 * len(table), 4), sharey=True)
    for ax, (kind, by_width) in zip(np.atleast_1d(axes), sorted(table.items())):
        for w in sorted(by_width):
            lrs = sorted(by_width[w])
            ax.plot([math.log2(lr) for lr in lrs], [np.mean(by_width[w][lr]) for lr in lrs], marker="o",
                    label=f"width {w}")
        ax.set_title({"sp": "SP", "mup": "µP (base width 64)"}[kind])
        ax.set_xlabel("log2 learning rate")
        ax.legend()
    np.atleast_1d(axes)[0].set_ylabel("held-out loss (nats/token)")
    finite = [np.mean(v) for bw in table.values() for d in bw.values() for v in d.values() if np.isfinite(np.mean(v))]
    if finite:
        plt.ylim(min(finite) - 0.05, min(finite) + 1.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--output", default="artifacts/mup_transfer.jsonl")
    r.add_argument("--data", default="artifacts/sample")
    r.add_argument("--widths", type=int, nargs="+", default=list(Sweep.widths))
    r.add_argument("--seeds", type=int, nargs="+", default=list(Sweep.seeds))
    r.add_argument("--lr-exponents", type=int, nargs="+", default=list(Sweep.lr_exponents))
    r.add_argument("--steps", type=int, default=Sweep.steps)
    q = sub.add_parser("report")
    q.add_argument("results")
    q.add_argument("--plot", default="")
    args = p.parse_args(argv)
    (run if args.cmd == "run" else report)(args)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    sys.exit(main())
