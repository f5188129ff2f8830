"""Length extrapolation: held-out loss by position at several context lengths, and the effective extrapolation length.

The held-out documents are tokenized and joined (EOS between them when the run adds EOS) into one token stream;
its first ``T = max(lengths) * floor(min(len(stream), max_tokens) / max(lengths))`` tokens are cut, for each
length ``L``, into ``T / L`` windows of ``L`` tokens, each one segment with positions ``0 .. L-1``: every length
scores the same tokens, so the lengths differ only in how much context (and how far out in RoPE positions) each
token gets. A window's token at index ``p >= 1`` is scored by ``log p(w[p] | w[0..p-1])``
(:class:`jaxpt.eval.scorer.Scorer`); position ``p`` below means that index. Documents shorter than ``L`` make the
context cross document boundaries, as in packed pretraining rows without segment masking; the report counts how
many held-out documents are at least ``L`` tokens long.

Per length the report gives the mean loss (nats per token) over all scored positions, over the *tail*
(positions ``[L/2, L)``), and per position bucket ``[1, b0), [b0, 2 b0), [2 b0, 4 b0), ...`` (powers of two).

**Effective extrapolation length** (the tolerance rule): with ``T0`` the trained length (the checkpoint's
``seq_len`` unless given) and ``tail(L)`` the tail loss at length ``L``, the longest measured ``L >= T0`` such that
``tail(L') <= (1 + tolerance) * tail(T0)`` for every measured ``L'`` in ``[T0, L]``. The tail is used rather
than the whole window because positions beyond ``T0`` are where a model fails to extrapolate, and a whole-window
mean would dilute them with the short-context positions every length shares. ``T0`` is always measured.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from jaxpt.data import boundary
from jaxpt.eval.scorer import Scorer, Window
from jaxpt.util import fs

#: Default relative tolerance of the effective extrapolation length.
DEFAULT_TOLERANCE = 0.05


def token_stream(texts: Sequence[str], tokenizer, document_boundary: str = "eos") -> np.ndarray:
    """The texts tokenized and concatenated, each with the BOS/EOS of ``document_boundary``
    (:mod:`jaxpt.data.boundary`; ConfigError if the tokenizer lacks a token it needs): int32 [n]."""
    marks = boundary.for_tokenizer(document_boundary, tokenizer)
    parts = [marks.wrap(tokenizer.encode(t)) for t in texts]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def bucket_edges(max_len: int, first: int = 64) -> list[int]:
    """``[1, first, 2 first, 4 first, ..., max_len]``: edges of the position buckets (last one clipped)."""
    edges, b = [1], first
    while b < max_len:
        edges.append(b)
        b *= 2
    return edges + [max_len]


def _mean(losses: np.ndarray) -> float:
    return float(np.mean(losses, dtype=np.float64)) if losses.size else float("nan")


def length_report(nll_WxL: np.ndarray, edges: Sequence[int]) -> dict[str, Any]:
    """Figures of one length from per-token losses ``nll[w, p]`` (float, [windows, L]; column 0 unused):
    ``loss`` (positions 1..L-1), ``tail_loss`` (``[L/2, L)``), ``tokens`` and ``buckets`` (``start``, ``end``,
    ``loss``, ``tokens`` for each edge pair below ``L``)."""
    W, L = nll_WxL.shape
    scored = nll_WxL[:, 1:]
    buckets = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if lo >= L:
            break
        part = nll_WxL[:, lo:min(hi, L)]
        buckets.append({"start": lo, "end": min(hi, L), "loss": _mean(part), "tokens": int(part.size)})
    return {"loss": _mean(scored), "tail_loss": _mean(nll_WxL[:, L // 2:]), "tokens": int(scored.size),
            "windows": W, "buckets": buckets}


def effective_length(tail_by_length: dict[int, float], trained_length: int, tolerance: float) -> int | None:
    """The longest length ``L >= trained_length`` with every measured ``L'`` in ``[trained_length, L]`` within
    ``(1 + tolerance) * tail_by_length[trained_length]`` (module docstring); None if ``trained_length`` was not
    measured or its loss is not finite.

    Raises:
      ValueError: a negative ``tolerance``.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance = {tolerance} must be >= 0")
    ref = tail_by_length.get(trained_length)
    if ref is None or not math.isfinite(ref):
        return None
    best = trained_length
    for L in sorted(x for x in tail_by_length if x > trained_length):
        if not tail_by_length[L] <= (1 + tolerance) * ref:
            break
        best = L
    return best


def _window_nll(restored, graphdef, params, stream: np.ndarray, L: int, batch_size: int) -> np.ndarray:
    """Per-token negative log-likelihood (nats, float64 [len(stream) // L, L]; position 0 has no prediction and
    stays 0) of ``stream`` cut into consecutive windows of ``L`` tokens, each scored from its own start."""
    cfg = restored.config
    # The Scorer is built directly (not Scorer.from_model): measuring beyond max_seq_len is the point.
    scorer = Scorer(graphdef, params, restored.mesh, cfg.logical_axis_rules, seq_len=L,
                    batch_size=batch_size, pad_id=restored.tokenizer.pad_id, num_ids=restored.tokenizer.vocab_size)
    windows = [Window(stream[s:s + L], 1) for s in range(0, len(stream) - L + 1, L)]
    scores = scorer.score(windows, pack=False, keep_tokens=True, progress=f"length {L}")
    nll = np.zeros((len(windows), L), np.float64)
    for i, lp in enumerate(scores.token_logp):
        nll[i, 1:] = -lp.astype(np.float64)
    return nll


def measure(restored, lengths: Sequence[int], *, texts: Sequence[str], trained_length: int | None = None,
            tolerance: float = DEFAULT_TOLERANCE, max_tokens: int = 16384, batch_size: int = 1,
            first_bucket: int = 64) -> dict[str, Any]:
    """The extrapolation report of a :func:`jaxpt.restore` result on held-out ``texts`` (module docstring).

    Args:
      restored: the checkpoint (model, params, mesh, config, tokenizer).
      lengths: context lengths in tokens (each >= 2); the trained length is added when missing.
      texts: held-out document texts.
      trained_length: ``T0``; default the checkpoint's ``TrainConfig.seq_len``.
      tolerance: relative tolerance of the effective extrapolation length.
      max_tokens: tokens of the stream to score per length (rounded down to a multiple of the longest length).
      batch_size: windows per device call (rounded up to the data-parallel size).
      first_bucket: the first position-bucket edge after 1.

    Returns a JSON-ready dict: ``checkpoint``, ``trained_length``, ``tolerance``, ``rule``, ``tokens_per_length``,
    ``rope`` (the model's RoPE settings), ``lengths`` ({str(L): :func:`length_report` + ``documents_at_least``}),
    ``effective_extrapolation_length``.

    Raises:
      ValueError: a length below 2, or a held-out stream shorter than the longest length.
    """
    from flax import nnx
    cfg = restored.config
    T0 = int(trained_length or cfg.seq_len)
    lengths = sorted({int(L) for L in lengths} | {T0})
    if lengths[0] < 2:
        raise ValueError(f"lengths: {lengths[0]} is below 2")
    longest = lengths[-1]
    stream = token_stream(texts, restored.tokenizer, cfg.data.document_boundary)
    total = (min(len(stream), max_tokens) // longest) * longest
    if total == 0:
        raise ValueError(f"the held-out set has {len(stream)} tokens, fewer than the longest length {longest} "
                         "(raise --max-tokens or give a larger --heldout)")
    doc_lengths = np.array([len(restored.tokenizer.encode(t)) for t in texts])
    graphdef, params = nnx.split(restored.model, nnx.Param)
    report_lengths, tails = {}, {}
    edges = bucket_edges(longest, first_bucket)
    for L in lengths:
        entry = length_report(_window_nll(restored, graphdef, params, stream[:total], L, batch_size), edges)
        entry["documents_at_least"] = int(np.sum(doc_lengths >= L))
        report_lengths[str(L)] = entry
        tails[L] = entry["tail_loss"]
    m = cfg.model
    rope = {k: getattr(m, k) for k in ("rope_theta", "rope_scaling", "rope_scaling_factor", "rope_original_max_len",
                                       "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast",
                                       "rope_beta_slow", "rope_attention_factor")}
    return {
        "checkpoint": {"step": restored.step, "stage": (restored.meta.get("stage") or {}).get("name")},
        "trained_length": T0, "tolerance": tolerance,
        "rule": (f"effective extrapolation length: the longest measured L >= {T0} whose tail loss (positions "
                 f"[L/2, L)) and every shorter measured length's stay <= (1 + {tolerance}) x the tail loss at {T0}"),
        "tokens_per_length": total, "held_out_documents": len(texts), "rope": rope,
        "lengths": report_lengths, "effective_extrapolation_length": effective_length(tails, T0, tolerance),
    }


def plot(report: dict[str, Any], path: str, label: str = "") -> str:
    """Write a PNG of ``report`` to ``path``: loss per position bucket, one line per length (left), and tail loss
    by length with the tolerance band and the effective extrapolation length (right). Returns ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    lengths = sorted(int(L) for L in report["lengths"])
    for L in lengths:
        b = report["lengths"][str(L)]["buckets"]
        ax1.plot([(x["start"] + x["end"]) / 2 for x in b], [x["loss"] for x in b], marker="o", label=f"L = {L}")
    T0 = report["trained_length"]
    ax1.axvline(T0, color="gray", linestyle="--", label=f"trained {T0}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("position in window (bucket middle, tokens)")
    ax1.set_ylabel("held-out loss (nats/token)")
    ax1.legend(fontsize=7)
    tails = [report["lengths"][str(L)]["tail_loss"] for L in lengths]
    ref = report["lengths"][str(T0)]["tail_loss"]
    ax2.plot(lengths, tails, marker="o", label="tail loss [L/2, L)")
    ax2.axhline(ref * (1 + report["tolerance"]), color="red", linestyle=":",
                label=f"(1 + {report['tolerance']}) x loss at {T0}")
    eff = report["effective_extrapolation_length"]
    if eff:
        ax2.axvline(eff, color="green", linestyle="--", label=f"effective {eff}")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("context length L (tokens)")
    ax2.legend(fontsize=7)
    fig.suptitle(f"length extrapolation {label} (step {report['checkpoint']['step']})")
    fig.tight_layout()
    fs.makedirs(fs.dirname(fs.absolute(path)))
    fs.write_figure(fig, path, dpi=100)
    plt.close(fig)
    return path


def format_report(report: dict[str, Any]) -> str:
    """A text table of a :func:`measure` report: one line per length (loss, tail loss, tokens, documents at least
    that long), then the effective extrapolation length."""
    lines = [f"step {report['checkpoint']['step']}, trained length {report['trained_length']}, "
             f"RoPE {report['rope']['rope_scaling']} theta {report['rope']['rope_theta']:g}",
             f"{'length':>8} {'loss':>8} {'tail':>8} {'tokens':>8} {'docs>=L':>8}"]
    for L, e in sorted(report["lengths"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"{int(L):>8} {e['loss']:>8.4f} {e['tail_loss']:>8.4f} {e['tokens']:>8} "
                     f"{e['documents_at_least']:>8}")
    lines.append(f"effective extrapolation length: {report['effective_extrapolation_length']} "
                 f"(tolerance {report['tolerance']:.0%} on the tail loss)")
    return "\n".join(lines)
