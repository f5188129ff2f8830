"""Score token sequences with a model: per-token log-likelihoods and rolling windows. (Greedy generation is
:mod:`jaxpt.infer.decode`; :meth:`Scorer.decode_step` gives it a step over the same params and mesh.)

All scoring in :mod:`jaxpt.eval` goes through one compiled function, :func:`token_scores`, on fixed-shape
``[B, L]`` batches sharded over the run's mesh, so an evaluation compiles once and reuses the program.

A *window* is one segment of a row: at most ``L`` tokens ``w[0..n-1]`` and the index ``first`` of the first
token that is scored. Token ``w[k]`` (``first <= k < n``, ``first >= 1``) is scored by the log-probability the
model gives it at position ``k - 1``. Windows are laid into rows either packed (several whole windows per row,
each its own segment with positions restarting at 0) or one per row; attention never crosses segments, so a
window's scores do not depend on its neighbours, the row it lands in, or the batch size. The host sums the
scored log-probabilities per window in float64, always in the window's token order.

Long sequences are split into overlapping windows (:func:`rolling_windows`): each token after the first is
scored exactly once, with at least ``L - stride`` tokens of context once the sequence is longer than ``L``
(the "sliding window" evaluation of Press et al. 2021, sec. 4, and lm-evaluation-harness's rolling
log-likelihood).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpt import mesh as mesh_lib
from jaxpt.infer.decode import NoCacheStep, mask_padded_ids
from jaxpt.infer.kv_cache import KVCacheStep, step_class
from jaxpt.model.decoder import eval_routing, routed
from jaxpt.util import progress as progress_lib


@dataclasses.dataclass(frozen=True)
class Window:
    """One scored segment: ``tokens`` int32 [n] (1 <= n <= L) and ``first`` (1 <= first <= n): tokens
    ``tokens[first:]`` are scored, each given everything before it in the window."""

    tokens: np.ndarray
    first: int

    def __post_init__(self):
        n = len(self.tokens)
        if n < 1 or not 1 <= self.first <= n:
            raise ValueError(f"Window needs 1 <= first <= len(tokens), got first={self.first}, len={n}")

    @property
    def num_scored(self) -> int:
        return len(self.tokens) - self.first


def rolling_windows(tokens: Sequence[int] | np.ndarray, seq_len: int, stride: int, start: int = 1) -> list[Window]:
    """Windows that score ``tokens[start:]`` exactly once each, with as much left context as fits.

    The first window is ``tokens[0:e]`` with ``e = min(n, max(seq_len, start + stride))``; every later window
    ends ``stride`` tokens further and starts ``seq_len`` tokens before its end, so each of its scored tokens
    has at least ``seq_len - stride`` tokens of context. A sequence of at most ``seq_len`` tokens is one window.

    Args:
      tokens: int ids, shape [n].
      seq_len: the longest window (the row length L).
      stride: new tokens scored per later window, in [1, seq_len - 1].
      start: first scored index (>= 1: the first token has no context and is never scored).

    Returns: windows in order; empty when ``start >= n``.

    Raises:
      ValueError: a bad ``stride``, ``seq_len`` or ``start``.
    """
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    n = len(tokens)
    if seq_len < 2 or not 1 <= stride <= seq_len - 1:
        raise ValueError(f"rolling_windows: need seq_len >= 2 and 1 <= stride <= seq_len - 1, "
                         f"got seq_len={seq_len}, stride={stride}")
    if start < 1:
        raise ValueError(f"rolling_windows: start = {start}; the first token has no context and is never scored")
    out = []
    k0 = start
    k1 = min(n, max(seq_len, k0 + stride))
    while k0 < n:
        s = max(0, k1 - seq_len)
        out.append(Window(tokens[s:k1], k0 - s))
        k0, k1 = k1, min(n, k1 + stride)
    return out


def token_scores(params, tokens_BxL, segment_ids_BxL, positions_BxL, *, graphdef, routing: str = "causal",
                 num_ids: int | None = None):
    """Log-probability of each next token, and the greedy (argmax) token, at every position.

    Returns ``(logp_BxL float32, argmax_BxL int32)``: ``logp[b, t] = log p(tokens[b, t+1] | row up to t)``
    (the last column is the log-probability of token 0, meaningless; the host reads only scored positions)
    and ``argmax[b, t]`` the most likely next token. Log-softmax in float32. ``routing``: how a mixture of
    experts routes (:meth:`jaxpt.model.Decoder.__call__`); only ``causal`` keeps ``logp[b, t]`` from depending on
    tokens after ``t + 1``. ``num_ids``: the tokenizer's size; the logits of ids ``>= num_ids`` (a padded
    vocabulary's, :func:`jaxpt.infer.decode.mask_padded_ids`) are -inf first, so ``p`` is renormalised over the ids
    the tokenizer has and ``argmax`` is what decoding would pick; None: over all ``V`` ids.
    """
    model = nnx.merge(graphdef, params)
    logits_BxLxV = model(tokens_BxL, segment_ids_BxL, positions_BxL, routing=routing)
    logits_BxLxV = mask_padded_ids(logits_BxLxV, num_ids)  # float32
    next_BxL = jnp.concatenate([tokens_BxL[:, 1:], jnp.zeros_like(tokens_BxL[:, :1])], axis=1)
    logp_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
    logp_BxL = jnp.take_along_axis(logp_BxLxV, next_BxL[..., None], axis=-1)[..., 0]
    return logp_BxL, jnp.argmax(logits_BxLxV, axis=-1).astype(jnp.int32)


@dataclasses.dataclass
class WindowScores:
    """Per-window results of :meth:`Scorer.score`: float64 ``logp`` (sum over scored tokens), bool ``greedy``
    (every scored token is the argmax), int ``count`` (scored tokens), each of shape [num_windows]; and, when
    asked, ``token_logp``: one float32 array [num_scored] per window."""

    logp: np.ndarray
    greedy: np.ndarray
    count: np.ndarray
    token_logp: list[np.ndarray] | None = None


class Scorer:
    """Runs :func:`token_scores` on ``[batch_size, seq_len]`` batches over a mesh (compiled once).

    Args:
      graphdef: the model's graph definition (``nnx.split``).
      params: the model's ``nnx.Param`` state; leaves not already sharded over ``mesh`` are replicated onto it.
      mesh, rules: where the batch is sharded (``batch`` over its mesh axes) and the activation rules.
      seq_len: row length L (at most the model's ``max_seq_len``).
      batch_size: rows per call; rounded up to a multiple of the data-parallel size (extra rows are padding).
      pad_id: token id of padding slots.
      num_ids: the tokenizer's size (:func:`token_scores`): scores are log-probabilities over the ids
        ``[0, num_ids)`` only, renormalised without a padded vocabulary's ids (a model whose ``vocab_size`` is rounded
        up past its tokenizer's), which no text ever holds and decoding never emits; ``greedy`` then means what
        decoding would produce. None: over all the model's ids (the same when the sizes match).
      place_params: put ``params`` on the mesh now (False: they are abstract; set ``scorer.params`` later).
      routing: how a mixture of experts routes the scored rows (:meth:`jaxpt.model.Decoder.__call__`); None: as
        evaluation does (:func:`jaxpt.model.decoder.eval_routing`: ``causal``, each token by itself, so no score
        sees a later token). ``train`` (capacity and balancing over whole rows) lets later tokens move earlier
        scores: for measuring that only.

    Attributes:
      routing: the routing the scores come from; ``routed``: whether the model's MLP routes at all (a mixture of
        experts), i.e. whether its figures must say which routing produced them.

    Raises:
      ValueError: ``seq_len < 2``; at the first call, a routing the model's MLP does not run.
    """

    def __init__(self, graphdef, params, mesh: Mesh, rules, *, seq_len: int, batch_size: int, pad_id: int = 0,
                 num_ids: int | None = None, place_params: bool = True, routing: str | None = None):
        if seq_len < 2:
            raise ValueError(f"Scorer: seq_len = {seq_len} must be >= 2")
        cfg = nnx.merge(graphdef, params).cfg
        self.routing, self.routed = routing or eval_routing(cfg), routed(cfg)
        dp = mesh_lib.data_parallel_size(mesh_lib.mesh_shape(mesh), rules)
        self.batch_size = -(-max(batch_size, 1) // dp) * dp
        self.seq_len, self.pad_id, self.mesh, self.rules = seq_len, pad_id, mesh, rules
        self.graphdef, self.cfg = graphdef, cfg
        replicated = NamedSharding(mesh, PartitionSpec())
        batch_s = mesh_lib.batch_sharding(mesh, rules)
        self._batch_sharding = batch_s
        # Params keep their sharding when they already live on this mesh; others are replicated onto it.
        param_s = jax.tree.map(lambda x: x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding)
                               and x.sharding.mesh == mesh else replicated, params)
        # ``place_params=False``: ``params`` may be abstract (ShapeDtypeStructs with shardings); the caller sets
        # ``self.params`` before each call (the trainer passes its live params, which it donates every step).
        self.params = jax.device_put(params, param_s) if place_params else None

        def traced(params, tokens, segment_ids, positions):
            with mesh_lib.activation_sharding(mesh, rules):
                return token_scores(params, tokens, segment_ids, positions, graphdef=graphdef, routing=self.routing,
                                    num_ids=num_ids)

        self._fn = jax.jit(traced, in_shardings=(param_s, batch_s, batch_s, batch_s),
                           out_shardings=(replicated, replicated))
        self.calls = 0

    @classmethod
    def from_model(cls, model, mesh: Mesh, rules, *, seq_len: int, batch_size: int, pad_id: int = 0,
                   num_ids: int | None = None, routing: str | None = None) -> "Scorer":
        """A scorer over an ``nnx`` model (e.g. ``jaxpt.restore(...).model``, whose params live on ``mesh``)."""
        if seq_len > model.cfg.max_seq_len:
            raise ValueError(f"Scorer: seq_len = {seq_len} exceeds the model's max_seq_len = {model.cfg.max_seq_len}")
        graphdef, params = nnx.split(model, nnx.Param)
        return cls(graphdef, params, mesh, rules, seq_len=seq_len, batch_size=batch_size, pad_id=pad_id,
                   num_ids=num_ids, routing=routing)

    # ------------------------------------------------------------------------------------------ device calls

    def _run(self, tokens, segment_ids, positions) -> tuple[np.ndarray, np.ndarray]:
        """One compiled call on host arrays [B, L]; returns host (logp, argmax)."""
        # Every process holds the whole (identical) host batch; each device takes its slice, so this also runs
        # multi-host, where a global sharding spans devices this process cannot address.
        put = lambda a: jax.make_array_from_callback(a.shape, self._batch_sharding, lambda i: a[i])  # noqa: E731
        self.calls += 1
        logp, argmax = self._fn(self.params, put(tokens), put(segment_ids), put(positions))
        return np.asarray(jax.device_get(logp)), np.asarray(jax.device_get(argmax))

    def _empty_batch(self):
        B, L = self.batch_size, self.seq_len
        return (np.full((B, L), self.pad_id, np.int32), np.zeros((B, L), np.int32), np.zeros((B, L), np.int32))

    # ------------------------------------------------------------------------------------------ scoring

    def layout(self, windows: Sequence[Window], pack: bool = True) -> list[list[tuple[int, int]]]:
        """Rows of ``(window index, offset in row)``: next-fit in order when ``pack``, else one window a row.

        Raises:
          ValueError: a window longer than ``seq_len``.
        """
        rows: list[list[tuple[int, int]]] = []
        used = self.seq_len
        for i, w in enumerate(windows):
            n = len(w.tokens)
            if n > self.seq_len:
                raise ValueError(f"window {i} has {n} tokens, more than seq_len = {self.seq_len}")
            if not pack or used + n > self.seq_len:
                rows.append([])
                used = 0
            rows[-1].append((i, used))
            used += n
        return rows

    def score(self, windows: Sequence[Window], *, pack: bool = True, keep_tokens: bool = False,
              progress: str | None = None) -> WindowScores:
        """Sum of scored log-probabilities per window (float64), whether each was greedy, and counts.

        The result does not depend on ``pack`` or the batch size beyond float32 rounding of the model itself.
        ``progress``: a description to report batches done under (:class:`jaxpt.util.progress.Progress`: a bar on a
        terminal, periodic lines with count and ETA otherwise); None reports nothing.
        """
        W = len(windows)
        logp = np.zeros(W, np.float64)
        greedy = np.ones(W, bool)
        count = np.array([w.num_scored for w in windows], np.int64)
        token_logp: list[np.ndarray | None] | None = [None] * W if keep_tokens else None
        rows = self.layout(windows, pack)
        starts = range(0, len(rows), self.batch_size)
        for b0 in starts if progress is None else progress_lib.track(starts, progress, "batches"):
            tokens, seg, pos = self._empty_batch()
            for r, row in enumerate(rows[b0:b0 + self.batch_size]):
                for s, (i, off) in enumerate(row, 1):
                    n = len(windows[i].tokens)
                    tokens[r, off:off + n] = windows[i].tokens
                    seg[r, off:off + n] = s
                    pos[r, off:off + n] = np.arange(n)
            out_logp, out_argmax = self._run(tokens, seg, pos)
            for r, row in enumerate(rows[b0:b0 + self.batch_size]):
                for i, off in row:
                    w = windows[i]
                    cols = np.arange(off + w.first - 1, off + len(w.tokens) - 1)
                    lp = out_logp[r, cols]
                    logp[i] = float(np.sum(lp.astype(np.float64)))  # numpy pairwise sum: fixed order per window
                    greedy[i] = bool(np.all(out_argmax[r, cols] == w.tokens[w.first:]))
                    if token_logp is not None:
                        token_logp[i] = lp.copy()
        return WindowScores(logp, greedy, count, token_logp)

    def loglikelihood(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *, stride: int | None = None,
                      pack: bool = True) -> list[tuple[float, bool]]:
        """``log p(continuation | context)`` (nats) and whether greedy decoding would produce the continuation.

        Args:
          requests: ``(context ids, continuation ids)`` pairs; the context must hold at least one token (callers
            prefix EOS for an empty context) and the continuation at least one.
          stride: for pairs longer than ``seq_len``: the context is cut from the left to fit; a continuation
            longer than ``seq_len - 1`` is scored in rolling windows (default stride ``seq_len // 2``).

        Raises:
          ValueError: an empty context or continuation.
        """
        stride = stride or self.seq_len // 2
        windows, owner = [], []
        for j, (ctx, cont) in enumerate(requests):
            if len(ctx) < 1 or len(cont) < 1:
                raise ValueError(f"loglikelihood request {j}: context and continuation need >= 1 token each "
                                 f"(got {len(ctx)}, {len(cont)})")
            seq = np.concatenate([np.asarray(ctx, np.int32), np.asarray(cont, np.int32)])
            ws = _tail_windows(seq, len(ctx), self.seq_len, stride)
            windows += ws
            owner += [j] * len(ws)
        res = self.score(windows, pack=pack)
        out_lp = np.zeros(len(requests))
        out_greedy = np.ones(len(requests), bool)
        for w, j in enumerate(owner):
            out_lp[j] += res.logp[w]
            out_greedy[j] &= res.greedy[w]
        return [(float(a), bool(b)) for a, b in zip(out_lp, out_greedy)]

    def decode_step(self, batch_size: int | None = None, *, kv_cache: bool = True) -> KVCacheStep | NoCacheStep:
        """A :class:`jaxpt.infer.kv_cache.KVCacheStep` (``kv_cache=False``, or a model that cannot be decoded token
        by token: the cache-free :class:`jaxpt.infer.decode.NoCacheStep`, :func:`jaxpt.infer.kv_cache.step_class`)
        over this scorer's params, mesh, rules, ``seq_len`` and pad id (``batch_size`` rows per call, default this
        scorer's), for :func:`jaxpt.infer.decode.greedy`. Both route as evaluation does, whatever this scorer's
        ``routing``."""
        return step_class(self.cfg, kv_cache)(self.graphdef, self.params, self.mesh, self.rules, seq_len=self.seq_len,
                                              batch_size=batch_size or self.batch_size, pad_id=self.pad_id)


def _tail_windows(seq: np.ndarray, start: int, seq_len: int, stride: int) -> list[Window]:
    """Windows scoring ``seq[start:]``: one window ``seq[max(0, n - seq_len):]`` when the scored part fits
    (the context cut from the left), else :func:`rolling_windows` from the longest context that fits."""
    n = len(seq)
    if n - start <= seq_len - 1:
        s = max(0, n - seq_len)
        return [Window(seq[s:], start - s)]
    s = max(0, start - (seq_len - stride))  # drop context that no window could see
    return rolling_windows(seq[s:], seq_len, stride, start=start - s)


def scorer_for_restored(restored: Any, *, seq_len: int | None = None, batch_size: int = 8,
                        routing: str | None = None) -> Scorer:
    """A :class:`Scorer` over a :func:`jaxpt.restore` result (its mesh, rules, its tokenizer's pad id and size, and by
    default its ``seq_len``); ``routing`` as :class:`Scorer` takes it."""
    cfg = restored.config
    return Scorer.from_model(restored.model, restored.mesh, cfg.logical_axis_rules,
                             seq_len=seq_len or cfg.seq_len, batch_size=batch_size, pad_id=restored.tokenizer.pad_id,
                             num_ids=restored.tokenizer.vocab_size, routing=routing)

