"""Greedy and sampled decoding: the one decoding loop behind ``jaxpt.generate``, the probe tasks, the seqio and
lm-eval adapters and the spot-check sheet, over a *step* that turns the tokens so far into next-token logits.

    from jaxpt.infer import decode
    step = decode.NoCacheStep.from_model(model, batch_size=8)       # rows of model.cfg.max_seq_len tokens
    gens = decode.greedy(step, prompts, 16, eos_id=tok.eos_id, stop_strings=[["\\n"]] * len(prompts),
                         tokenizer=tok)
    gens[0].ids, gens[0].text, gens[0].stop_reason
    gens = decode.sample(step, prompts, 16, temperature=0.8, seed=1, eos_id=tok.eos_id, tokenizer=tok)

Truncation rule
  A row holds at most ``L = step.seq_len`` tokens, the prompt and every new token together, so
  ``max_new_tokens`` must be below ``L`` and a prompt longer than ``L - max_new_tokens`` keeps its *last*
  ``L - max_new_tokens`` tokens (positions restart at 0). The context never slides while decoding, so a KV cache
  of ``L`` slots per row would serve a whole generation: prefill the prompt, then one slot per new token.

Stops
  A row stops after ``max_new_tokens`` tokens, after emitting ``eos_id`` (kept in its ids), or once the decoded
  text of its new ids holds one of *its own* stop strings; its ``text`` is cut before the earliest such string.
  Rows never see each other's stop strings and (causal masking, one segment per row) a row's logits do not depend
  on the other rows, so batched results equal one-at-a-time results.

Steps
  :func:`greedy` and :func:`sample` talk to the model only through :class:`DecodeStep`: ``prefill(prompts)``, then
  ``extend(state, tokens)`` once per new token, each returning every row's next-token logits.
  :class:`NoCacheStep` reruns the model on the whole fixed ``[B, L]`` batch at every call (one compiled program
  for every prompt length and step); :class:`jaxpt.infer.kv_cache.KVCacheStep` (prefill, then one token per row per
  call against a per-layer KV cache) replaces it without changing any caller and is what ``jaxpt.generate`` and
  evaluation's greedy tasks use; this step stays as the reference it is tested against.

The padded vocabulary
  A model's ``vocab_size`` may exceed its tokenizer's (rounded up to a multiple of 128, say): the ids past the
  tokenizer's have logits but decode to nothing (``Tokenizer.decode`` refuses them). Every next token is picked
  from the logits with those ids masked to -inf (:func:`mask_padded_ids`; ``num_ids``, by default the tokenizer's
  ``vocab_size``), so no decoding ever emits one, whatever the model's weights.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpt import mesh as mesh_lib
from jaxpt.model.decoder import eval_routing
from jaxpt.util import progress as progress_lib


class DecodeStep(Protocol):
    """What :func:`greedy` and :func:`sample` need of a model: next-token logits for up to ``batch_size`` rows of
    at most ``seq_len`` tokens each."""

    batch_size: int
    seq_len: int

    def prefill(self, prompts: Sequence[np.ndarray]) -> tuple[Any, np.ndarray]:
        """Start one row per prompt (int32 [n_r], 1 <= n_r <= seq_len; at most ``batch_size`` prompts).

        Returns ``(state, logits)``: an opaque state for :meth:`extend`, and float32 [len(prompts), V] whose
        row r scores the token after prompt r.

        Raises:
          ValueError: no prompts, too many, or one empty or longer than ``seq_len``.
        """
        ...

    def extend(self, state: Any, tokens: np.ndarray) -> tuple[Any, np.ndarray]:
        """Append ``tokens`` (int32 [num_rows], one per row) to every row; returns the new state and the
        float32 [num_rows, V] logits of the token after each row.

        Raises:
          ValueError: a wrong number of tokens, or a row already holding ``seq_len`` tokens.
        """
        ...


@dataclasses.dataclass(frozen=True)
class Generation:
    """One row's greedy continuation.

    Attributes:
      ids: the new token ids, through the token that stopped the row (``eos_id`` included).
      text: the decoded ``ids`` cut before the earliest of the row's stop strings; ``None`` without a tokenizer.
      stop_reason: ``"eos"``, ``"stop_string"`` or ``"length"`` (``max_new_tokens`` reached).
    """

    ids: list[int]
    text: str | None
    stop_reason: str


# ------------------------------------------------------------------------------------------ the decoding loop


def greedy(step: DecodeStep, prompts: Sequence[Sequence[int] | np.ndarray], max_new_tokens: int, *,
           eos_id: int | None = None, stop_strings: Sequence[Sequence[str]] | None = None,
           tokenizer: Any = None, num_ids: int | None = None, progress: str | None = None) -> list[Generation]:
    """Greedy continuations of ``prompts``, ``step.batch_size`` rows per batch, each new token the argmax of
    its row's logits over the ids the tokenizer can decode (ties to the lowest id). See the module docstring for
    the truncation rule, stops and the padded vocabulary.

    Args:
      step: a :class:`DecodeStep` (e.g. :class:`NoCacheStep`).
      prompts: int token ids per row, each with at least one token; lengths may differ.
      max_new_tokens: at most this many new tokens per row, in [0, step.seq_len).
      eos_id: a row stops after emitting this id.
      stop_strings: per row, the strings that stop it (``stop_strings[i]`` for ``prompts[i]``; empty strings
        are ignored). Needs ``tokenizer``.
      tokenizer: anything with ``decode(ids) -> str``; when given, each result's ``text`` is filled.
      num_ids: only ids in [0, num_ids) are emitted (:func:`mask_padded_ids`); default: the tokenizer's
        ``vocab_size`` when it has one, else every id of the logits.
      progress: when given, the prompts done so far are reported under this name (:class:`jaxpt.util.progress.Progress`:
        a bar on a terminal, a line every 30 s elsewhere).

    Returns: one :class:`Generation` per prompt, in order.

    Raises:
      ValueError: ``max_new_tokens`` out of range, an empty prompt, ``stop_strings`` of the wrong length or
        given as a bare string, stop strings without a tokenizer, or ``num_ids < 1``.
    """
    return _decode(step, prompts, max_new_tokens, lambda first: _argmax, eos_id=eos_id, stop_strings=stop_strings,
                   tokenizer=tokenizer, num_ids=num_ids, progress=progress, name="greedy")


def sample(step: DecodeStep, prompts: Sequence[Sequence[int] | np.ndarray], max_new_tokens: int, *,
           temperature: float = 1.0, seed: int = 0, eos_id: int | None = None,
           stop_strings: Sequence[Sequence[str]] | None = None, tokenizer: Any = None, num_ids: int | None = None,
           progress: str | None = None) -> list[Generation]:
    """Sampled continuations of ``prompts``: each new token drawn from ``softmax(logits / temperature)`` over the
    ids the tokenizer can decode (the padded ones masked, :func:`mask_padded_ids`), by the Gumbel-max trick on the
    host in float64. Truncation, stops and the other arguments as :func:`greedy`.

    Row ``i`` (``prompts[i]``) draws from its own generator, ``numpy.random.default_rng([seed, i])``, one draw of
    ``V`` Gumbel variates per new token, so a call's results depend on ``seed`` and the row's index only: not on
    ``step.batch_size`` or the other rows.

    Args:
      temperature: > 0 (for temperature 0 call :func:`greedy`); 1 samples the model's own distribution.
      seed: the generators' seed (an int >= 0).

    Returns: one :class:`Generation` per prompt, in order.

    Raises:
      ValueError: ``temperature`` not a finite number > 0, a negative ``seed``, or as :func:`greedy` does.
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"sample: temperature = {temperature} must be finite and > 0 (greedy decodes at 0)")
    if seed < 0:
        raise ValueError(f"sample: seed = {seed} must be >= 0")
    rngs = [np.random.default_rng([seed, i]) for i in range(len(prompts))]

    def picker(first: int):
        def pick(logits_nxV: np.ndarray) -> np.ndarray:
            scaled_nxV = logits_nxV.astype(np.float64) / temperature  # a masked id stays -inf
            return np.asarray([np.argmax(row + rngs[first + r].gumbel(size=row.shape)) for r, row in
                               enumerate(scaled_nxV)], np.int32)
        return pick

    return _decode(step, prompts, max_new_tokens, picker, eos_id=eos_id, stop_strings=stop_strings,
                   tokenizer=tokenizer, num_ids=num_ids, progress=progress, name="sample")


def _argmax(logits_nxV: np.ndarray) -> np.ndarray:
    return np.argmax(logits_nxV, axis=-1).astype(np.int32)


def _decode(step: DecodeStep, prompts, max_new_tokens: int, picker, *, eos_id, stop_strings, tokenizer, num_ids,
            progress, name: str) -> list[Generation]:
    """The decoding loop of :func:`greedy` and :func:`sample`: ``picker(first)`` gives the token chooser of the
    batch whose first row is prompt ``first``, called on that batch's masked float32 logits [n, V]."""
    if not 0 <= max_new_tokens < step.seq_len:
        raise ValueError(f"{name}: max_new_tokens = {max_new_tokens} must be in [0, seq_len = {step.seq_len})")
    if num_ids is None:
        num_ids = getattr(tokenizer, "vocab_size", None)
    if num_ids is not None and num_ids < 1:
        raise ValueError(f"{name}: num_ids = {num_ids} must be >= 1")
    rows = [truncate_prompt(p, step.seq_len, max_new_tokens, index=i) for i, p in enumerate(prompts)]
    stops = _row_stops(stop_strings, len(rows), tokenizer)
    decode = None if tokenizer is None else tokenizer.decode
    out: list[Generation] = []
    bar = progress_lib.Progress(len(rows), progress, "prompts") if progress else None
    for b0 in range(0, len(rows), step.batch_size):
        b1 = b0 + step.batch_size
        out += _decode_batch(step, rows[b0:b1], max_new_tokens, eos_id, stops[b0:b1], decode, picker(b0), num_ids)
        if bar is not None:
            bar.update(len(rows[b0:b1]))
    if bar is not None:
        bar.close()
    return out


def mask_padded_ids(logits_xV, num_ids: int | None):
    """``logits_xV`` (float, shape [..., V]) as float32 with the logit of every id ``>= num_ids`` set to -inf.

    A model's ``ModelConfig.vocab_size`` may be larger than its tokenizer's ``vocab_size`` (rounded up to a multiple
    of 128 for speed, or a converted model's padded embedding): its ids ``num_ids .. V - 1`` have logits but no
    piece, and no text decodes from them. Masked, such an id is never the argmax, never sampled (``exp(-inf) = 0``)
    and takes no mass from a softmax over the row, which becomes a proper distribution over the tokenizer's ids:
    every pick of a next token (:func:`greedy`, :func:`sample`) and every score (:func:`jaxpt.eval.scorer.token_scores`)
    goes through this. Training's loss still normalises over all ``V`` logits (a padded id is never a target, so
    training pushes its logit down; a trained model gives it little mass, an untrained one ``(V - num_ids) / V``).

    Args:
      logits_xV: a numpy array (the result is numpy, computed on the host) or a jax array (the result is jax;
        traceable under ``jit``).
      num_ids: the tokenizer's size; ``None`` or ``>= V``: nothing is masked.

    Returns: float32, the shape of ``logits_xV``.

    Raises:
      ValueError: ``num_ids < 1`` (a row of -inf only has no argmax, and its softmax is NaN).
    """
    if num_ids is not None and num_ids < 1:
        raise ValueError(f"mask_padded_ids: num_ids = {num_ids} must be >= 1")
    xp = np if isinstance(logits_xV, np.ndarray) else jnp
    logits_xV = logits_xV.astype(xp.float32)
    V = logits_xV.shape[-1]
    if num_ids is None or num_ids >= V:
        return logits_xV
    return xp.where(xp.arange(V) < num_ids, logits_xV, xp.float32(-np.inf))


def truncate_prompt(prompt: Sequence[int] | np.ndarray, seq_len: int, max_new_tokens: int, *,
                    index: int = 0) -> np.ndarray:
    """The part of ``prompt`` a row of ``seq_len`` tokens holds: its last ``seq_len - max_new_tokens`` tokens.

    Returns: int32 [min(n, seq_len - max_new_tokens)].

    Raises:
      ValueError: the prompt is empty (``index`` names it in the message).
    """
    ids = np.asarray(prompt, np.int32).reshape(-1)
    if len(ids) == 0:
        raise ValueError(f"greedy: prompt {index} is empty; it must hold at least one token")
    return ids[-(seq_len - max_new_tokens):]


def _row_stops(stop_strings, n: int, tokenizer) -> list[tuple[str, ...]]:
    if stop_strings is None:
        return [()] * n
    if isinstance(stop_strings, str) or len(stop_strings) != n:
        raise ValueError(f"greedy: stop_strings must hold one sequence of strings per prompt ({n}), "
                         f"got {stop_strings!r}")
    out = []
    for i, ss in enumerate(stop_strings):
        if isinstance(ss, str):
            raise ValueError(f"greedy: stop_strings[{i}] = {ss!r} is a string; give a sequence of strings")
        out.append(tuple(s for s in ss if s))
    if tokenizer is None and any(out):
        raise ValueError("greedy: stop strings need a tokenizer to decode the new ids")
    return out


class _Row:
    """One row's new ids and why it stopped (``None`` while it runs)."""

    def __init__(self, stops: tuple[str, ...]):
        self.ids: list[int] = []
        self.stops = stops
        self.reason: str | None = None

    def push(self, token: int, eos_id: int | None, decode, max_new_tokens: int) -> None:
        if self.reason is not None:
            return
        self.ids.append(token)
        if token == eos_id:
            self.reason = "eos"
        elif self.stops and first_stop(decode(self.ids), self.stops) is not None:
            self.reason = "stop_string"
        elif len(self.ids) >= max_new_tokens:
            self.reason = "length"

    def result(self, decode) -> Generation:
        text = None
        if decode is not None:
            text = decode(self.ids)
            cut = first_stop(text, self.stops)
            text = text if cut is None else text[:cut]
        return Generation(list(self.ids), text, self.reason or "length")


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index in ``text`` where the earliest occurrence of any of ``stops`` begins; ``None`` if none occurs."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


def _decode_batch(step: DecodeStep, prompts: list[np.ndarray], max_new_tokens: int, eos_id: int | None,
                  stops: list[tuple[str, ...]], decode, pick, num_ids: int | None) -> list[Generation]:
    """One batch of rows decoded to their stops; ``pick(logits float32 [n, V]) -> int32 [n]`` chooses each row's
    token from its logits with the ids ``>= num_ids`` masked (:func:`mask_padded_ids`)."""
    rows = [_Row(s) for s in stops]
    if max_new_tokens == 0:
        return [r.result(decode) for r in rows]
    state, logits = step.prefill(prompts)
    for k in range(max_new_tokens):
        tokens = pick(mask_padded_ids(np.asarray(logits), num_ids))
        for row, t in zip(rows, tokens):
            row.push(int(t), eos_id, decode, max_new_tokens)
        if k == max_new_tokens - 1 or all(r.reason is not None for r in rows):
            break
        # Stopped rows keep decoding (their tokens are dropped): rows are independent, and the batch keeps one shape.
        state, logits = step.extend(state, tokens)
    return [r.result(decode) for r in rows]


# ------------------------------------------------------------------------------------------ the cache-free step


def next_token_logits(params, tokens_BxL, segment_ids_BxL, positions_BxL, *, graphdef):
    """Logits (float32 [B, V]) of the token after each row's last real token.

    Rows are left-aligned: real tokens have segment id 1, padding 0, so a row's last real token is at column
    ``sum(segment_ids != 0) - 1`` (column 0 for an all-padding row, whose logits mean nothing). The model routes
    as evaluation does (:func:`jaxpt.model.decoder.eval_routing`: a mixture of experts each token by itself).
    """
    model = nnx.merge(graphdef, params)
    logits_BxLxV = model(tokens_BxL, segment_ids_BxL, positions_BxL, routing=eval_routing(model.cfg))
    last_B = jnp.maximum(jnp.sum(segment_ids_BxL != 0, axis=1) - 1, 0)
    rows_B = jnp.arange(tokens_BxL.shape[0])
    return logits_BxLxV[rows_B, last_B].astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """State of :class:`NoCacheStep`: the host batch (int32 [B, L]) and each live row's length (int [n])."""

    tokens: np.ndarray
    lengths: np.ndarray

class StepConstructors:
    """``from_model`` and ``for_restored`` for decode steps whose ``__init__`` takes ``(graphdef, params, mesh,
    rules, *, seq_len, batch_size, pad_id)`` (:class:`NoCacheStep`, :class:`jaxpt.infer.kv_cache.KVCacheStep`)."""

    @classmethod
    def from_model(cls, model, mesh: Mesh | None = None, rules=mesh_lib.DEFAULT_RULES, *, seq_len: int | None = None,
                   batch_size: int = 1, pad_id: int = 0):
        """A step over an ``nnx`` model; ``seq_len`` defaults to its ``max_seq_len``.

        Raises:
          ValueError: ``seq_len`` above the model's ``max_seq_len`` or below 2.
        """
        return step_from_model(cls, model, mesh, rules, seq_len=seq_len, batch_size=batch_size, pad_id=pad_id)

    @classmethod
    def for_restored(cls, restored: Any, *, seq_len: int | None = None, batch_size: int = 1):
        """A step over a :func:`jaxpt.restore` result: its mesh, rules, pad id and, by default, its ``seq_len``."""
        return step_for_restored(cls, restored, seq_len=seq_len, batch_size=batch_size)


class NoCacheStep(StepConstructors):
    """A :class:`DecodeStep` without a KV cache: every call reruns the model on the whole ``[B, L]`` batch, the
    rows left-aligned and right-padded (segment id 0 after the real tokens; causal masking hides the padding).

    Args:
      graphdef, params: the model split by ``nnx.split``.
      mesh, rules: where the batch is sharded (``batch`` over its mesh axes) and the activation rules. Params not
        already on ``mesh`` are replicated onto it. ``mesh=None``: plain ``jax.jit`` wherever the params live
        (one process only).
      seq_len: row length L (at most the model's ``max_seq_len``), >= 2.
      batch_size: rows per call; rounded up to a multiple of the data-parallel size (extra rows are padding).
      pad_id: token id of padding slots.

    Raises:
      ValueError: ``seq_len < 2``.
    """

    def __init__(self, graphdef, params, mesh: Mesh | None = None, rules=mesh_lib.DEFAULT_RULES, *, seq_len: int,
                 batch_size: int = 1, pad_id: int = 0):
        if seq_len < 2:
            raise ValueError(f"NoCacheStep: seq_len = {seq_len} must be >= 2")
        self.seq_len, self.pad_id, self.mesh = seq_len, pad_id, mesh
        batch_size = max(batch_size, 1)
        if mesh is None:
            self.batch_size, self.params = batch_size, params
            self._fn = jax.jit(lambda p, t, s, q: next_token_logits(p, t, s, q, graphdef=graphdef))
            self._put = jnp.asarray
            return
        self.batch_size, self.params, param_s, batch_s = place_on_mesh(params, mesh, rules, batch_size)
        replicated = NamedSharding(mesh, PartitionSpec())

        def traced(params, tokens, segment_ids, positions):
            with mesh_lib.activation_sharding(mesh, rules):
                return next_token_logits(params, tokens, segment_ids, positions, graphdef=graphdef)

        self._fn = jax.jit(traced, in_shardings=(param_s, batch_s, batch_s, batch_s), out_shardings=replicated)
        # Every process holds the whole (identical) host batch and each device takes its slice, so this also runs
        # multi-host, where the batch sharding spans devices this process cannot address.
        self._put = lambda a: jax.make_array_from_callback(a.shape, batch_s, lambda i: a[i])

    def prefill(self, prompts: Sequence[np.ndarray]) -> tuple[_Rows, np.ndarray]:
        """See :meth:`DecodeStep.prefill`."""
        if not 1 <= len(prompts) <= self.batch_size:
            raise ValueError(f"prefill: {len(prompts)} prompts for a batch of {self.batch_size} rows")
        tokens = np.full((self.batch_size, self.seq_len), self.pad_id, np.int32)
        lengths = np.zeros(len(prompts), np.int64)
        for r, p in enumerate(prompts):
            p = np.asarray(p, np.int32).reshape(-1)
            if not 1 <= len(p) <= self.seq_len:
                raise ValueError(f"prefill: prompt {r} has {len(p)} tokens; need 1..{self.seq_len}")
            tokens[r, :len(p)] = p
            lengths[r] = len(p)
        state = _Rows(tokens, lengths)
        return state, self._logits(state)

    def extend(self, state: _Rows, tokens: np.ndarray) -> tuple[_Rows, np.ndarray]:
        """See :meth:`DecodeStep.extend`."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        n = len(state.lengths)
        if len(tokens) != n:
            raise ValueError(f"extend: {len(tokens)} tokens for {n} rows")
        if np.any(state.lengths >= self.seq_len):
            raise ValueError(f"extend: a row already holds seq_len = {self.seq_len} tokens")
        batch = state.tokens.copy()
        batch[np.arange(n), state.lengths] = tokens
        new = _Rows(batch, state.lengths + 1)
        return new, self._logits(new)

    def _logits(self, state: _Rows) -> np.ndarray:
        """One compiled call on the host batch; returns float32 [live rows, V] on the host."""
        n = len(state.lengths)
        columns = np.arange(self.seq_len)
        segment_ids = np.zeros((self.batch_size, self.seq_len), np.int32)
        segment_ids[:n] = columns[None] < state.lengths[:, None]
        positions = (columns[None] * segment_ids).astype(np.int32)
        logits = self._fn(self.params, self._put(state.tokens), self._put(segment_ids), self._put(positions))
        return np.asarray(jax.device_get(logits))[:n]


def place_on_mesh(params, mesh: Mesh, rules, batch_size: int):
    """Where a decode step's params and rows live on ``mesh``: ``(batch_size, params, param_shardings,
    batch_sharding)``. ``batch_size`` is rounded up to a multiple of the data-parallel size; params already on
    ``mesh`` keep their shardings (training's), others are replicated onto it."""
    dp = mesh_lib.data_parallel_size(mesh_lib.mesh_shape(mesh), rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    param_s = jax.tree.map(lambda x: x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding)
                           and x.sharding.mesh == mesh else replicated, params)
    return -(-batch_size // dp) * dp, jax.device_put(params, param_s), param_s, mesh_lib.batch_sharding(mesh, rules)


def step_from_model(cls, model, mesh: Mesh | None = None, rules=mesh_lib.DEFAULT_RULES, *,
                    seq_len: int | None = None, batch_size: int = 1, pad_id: int = 0):
    """A ``cls`` decode step (:class:`NoCacheStep`, :class:`jaxpt.infer.kv_cache.KVCacheStep`) over an ``nnx`` model;
    ``seq_len`` defaults to its ``max_seq_len``.

    Raises:
      ValueError: ``seq_len`` above the model's ``max_seq_len`` or below 2.
    """
    seq_len = seq_len or model.cfg.max_seq_len
    if seq_len > model.cfg.max_seq_len:
        raise ValueError(f"{cls.__name__}: seq_len = {seq_len} exceeds the model's max_seq_len = "
                         f"{model.cfg.max_seq_len}")
    graphdef, params = nnx.split(model)
    return cls(graphdef, params, mesh, rules, seq_len=seq_len, batch_size=batch_size, pad_id=pad_id)


def step_for_restored(cls, restored: Any, *, seq_len: int | None = None, batch_size: int = 1):
    """A ``cls`` decode step over a :func:`jaxpt.restore` result: its mesh, rules, pad id and, by default, its
    ``seq_len``."""
    cfg = restored.config
    return step_from_model(cls, restored.model, restored.mesh, cfg.logical_axis_rules,
                           seq_len=seq_len or cfg.seq_len, batch_size=batch_size, pad_id=restored.tokenizer.pad_id)
