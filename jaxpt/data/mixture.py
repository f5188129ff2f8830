"""Token-true data mixtures: weights as a training config, staged by step, resumable with per-group positions.

A *mixture* gives each *group* of documents a share of the training **tokens** (not of the documents: long
documents would otherwise be over-represented). A group is a domain (``'code'``) or a domain's source
(``'reference/dict-foldoc'``, the finer tier a corpus keeps per document; e.g. the build's quality reference
sources). A domain named both alone and with ``/source`` entries means its other sources. The groups are the
union over all stages (a stage gives the others weight 0), so a source split out in one stage is split out in
every stage: list it in each stage that should read it.

Config face (:class:`jaxpt.config.DataConfig`):

- ``mixture_weights = (('web', 0.1), ('code', 0.3), ...)``: one mixture for the whole run;
- ``mixture_schedule = ((1, (('web', 0.1), ...)), (721, (('reference/dict-foldoc', 0.5), ...)))``: stages by
  first global step (1-based; the first stage starts at step 1, starts strictly increase), e.g. a high-quality
  mixture for the decay phase of a WSD schedule ("increase the proportion of high-quality data and apply
  learning-rate annealing near the end"; MiniCPM, Hu et al. 2024, mixes high-quality data into its WSD decay
  phase, and Llama 3, Dubey et al. 2024, anneals on upsampled high-quality data).

Weights are normalized per stage; 0 leaves a group out of that stage. Negative, NaN or infinite weights, a
stage whose weights are all 0, and a group the data does not have raise :class:`ConfigError` naming the key.

Sampling (:class:`TokenMixIterator`): a deterministic weighted interleave by tokens. Each group keeps one open
document; a row is filled piece by piece, each piece from the group ``g`` with the smallest ``t_g / w_g``
(``t_g``: tokens, EOS included, that ``g`` has placed in the current stage; ties by name order), a piece being
the rest of ``g``'s open document or what fits in the row. Since no piece is longer than ``seq_len`` (``L``),
after ``T`` tokens of a stage with ``G`` groups every group is within a few rows of its share however long its
documents are: ``w_g (T - G L) <= t_g <= w_g T + L`` (the picked group is the one furthest below its share, so
no ratio ``t_g / w_g`` passes the smallest by more than ``L / w_g``). It is the smooth weighted round-robin of
network schedulers, counted in tokens; there is no coin flip, so the shares do not drift.

Positions and shards: group ``g`` is one endless stream of its documents, reshuffled each epoch (``seed`` and
the group name), and logical data shard ``k`` of ``S`` reads positions ``k, k + S, k + 2S, ...`` of it
(:mod:`jaxpt.data.shards`). Every shard interleaves by the same weights, so the *global* shares equal the
weights whatever ``S`` is, and a group with fewer documents than shards still feeds every shard. The iterator
state holds each group's next position (per-group read positions), so a resumed run whose mixture changed (a
stage boundary) continues every group where it stopped: no document repeats before its group's epoch ends and
none is skipped. The state (JSON) is::

    {"batches": steps emitted, "positions": {group: next position}, "stage": index, "stage_weights": {...},
     "stage_tokens": {group: tokens this stage}, "open": {group: [position, offset]}}

``open`` holds each group's document in progress: it is read again at restore and continues at ``offset``
whatever the mixture is now (that of a group the new mixture does not name waits in the state for a stage that
does). A restored state whose stage weights differ from the config's starts a new stage (its token counts
from 0).
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxpt.data.boundary import Boundary
from jaxpt.util.errors import ConfigError

#: Host-side batch key: the mixture group of each token, int32 [rows, seq_len] (index into the sorted group
#: names; -1 for padding). Never sent to the devices.
GROUP_KEY = "mixture_group"


def parse_weights(entries: Any, key: str) -> dict[str, float]:
    """``(('group', weight), ...)`` (or a mapping) -> ``{group: weight / sum}``, checked.

    Args:
      entries: pairs of a group name (``'domain'`` or ``'domain/source'``) and a weight (int or float).
      key: the config key to name in errors, e.g. ``'DataConfig.mixture_weights'``.
    Returns:
      Normalized weights, sorted by group name; groups of weight 0 are kept (with 0).
    Raises:
      ConfigError: a malformed entry, a repeated group, a negative, NaN or infinite weight, or all weights 0
        (each naming ``key`` and the group).
    """
    items = list(entries.items()) if isinstance(entries, Mapping) else list(entries)
    out: dict[str, float] = {}
    for e in items:
        if not (isinstance(e, (tuple, list)) and len(e) == 2 and isinstance(e[0], str) and e[0]
                and isinstance(e[1], (int, float)) and not isinstance(e[1], bool)):
            raise ConfigError(f"{key}: entry {e!r} is not ('group', weight); write (('web', 0.1), ('code', 0.9))")
        name, w = e[0], float(e[1])
        if name in out:
            raise ConfigError(f"{key}: group {name!r} is given twice")
        if not math.isfinite(w) or w < 0:
            raise ConfigError(f"{key}: weight of {name!r} = {e[1]!r}: must be a finite number >= 0")
        out[name] = w
    total = sum(out.values())
    if total <= 0:
        raise ConfigError(f"{key} = {tuple(items)!r}: all weights are 0 (nothing to train on)")
    return {g: out[g] / total for g in sorted(out)}


def parse_schedule(entries: Any, key: str = "DataConfig.mixture_schedule") -> list[tuple[int, dict[str, float]]]:
    """``((start_step, weights), ...)`` -> ``[(start_step, normalized weights), ...]`` (:func:`parse_weights`).

    Raises:
      ConfigError: naming ``key``: an entry that is not ``(int step, weights)``, a first stage not at step 1,
        start steps that do not strictly increase, or bad weights.
    """
    out = []
    for e in entries:
        if not (isinstance(e, (tuple, list)) and len(e) == 2 and isinstance(e[0], int)
                and not isinstance(e[0], bool)):
            raise ConfigError(f"{key}: entry {e!r} is not (start_step, (('group', weight), ...))")
        start = e[0]
        if not out and start != 1:
            raise ConfigError(f"{key}: the first stage starts at step {start}; it must start at step 1")
        if out and start <= out[-1][0]:
            raise ConfigError(f"{key}: stage start {start} does not follow {out[-1][0]} (starts must increase)")
        out.append((start, parse_weights(e[1], f"{key}[stage at step {start}]")))
    return out


def schedule_from_config(data_cfg) -> list[tuple[int, dict[str, float]]] | None:
    """The run's mixture schedule from :class:`jaxpt.config.DataConfig` (``mixture_schedule``, else
    ``mixture_weights`` as one stage from step 1); None when neither is set."""
    if data_cfg.mixture_schedule:
        return parse_schedule(data_cfg.mixture_schedule)
    if data_cfg.mixture_weights:
        return [(1, parse_weights(data_cfg.mixture_weights, "DataConfig.mixture_weights"))]
    return None


def config_key(data_cfg) -> str:
    """The DataConfig key the mixture came from (for error messages)."""
    return "DataConfig.mixture_schedule" if data_cfg.mixture_schedule else "DataConfig.mixture_weights"


def stage_at(schedule: Sequence[tuple[int, Mapping[str, float]]], step: int) -> int:
    """Index of the stage that feeds global step ``step`` (1-based): the last one starting at or before it."""
    idx = 0
    for i, (start, _) in enumerate(schedule):
        if start <= step:
            idx = i
    return idx


def group_names(schedule: Sequence[tuple[int, Mapping[str, float]]]) -> list[str]:
    """Every group any stage names, sorted (the index of :data:`GROUP_KEY`)."""
    return sorted({g for _, w in schedule for g in w})


def assign_groups(domains: Sequence[str], sources: Sequence[str], groups: Sequence[str],
                  key: str) -> dict[str, list[int]]:
    """Document indices of each group: ``'domain/source'`` takes that source's documents of the domain;
    ``'domain'`` takes the domain's documents no ``'domain/source'`` group took.

    Args:
      domains, sources: per document (equal length).
      groups: group names (:func:`group_names`).
      key: config key for errors.
    Raises:
      ConfigError: a group with no documents (unknown domain or source), naming ``key``, the group and the
        domains (or the domain's sources) that exist.
    """
    members: dict[str, list[int]] = {g: [] for g in groups}
    for i, (d, s) in enumerate(zip(domains, sources)):
        if f"{d}/{s}" in members:
            members[f"{d}/{s}"].append(i)
        elif d in members:
            members[d].append(i)
    known_domains = sorted(set(domains))
    for g, idx in members.items():
        if idx:
            continue
        d = g.split("/", 1)[0]
        if d not in known_domains:
            raise ConfigError(f"{key}: group {g!r}: no domain {d!r} in the training data (domains: {known_domains})")
        if "/" in g:
            have = sorted({s for dd, s in zip(domains, sources) if dd == d})
            raise ConfigError(f"{key}: group {g!r}: domain {d!r} has no source {g.split('/', 1)[1]!r} "
                              f"(sources: {have})")
        raise ConfigError(f"{key}: group {g!r}: every document of the domain is in a '{d}/<source>' group")
    return members


class GroupStream:
    """Shard ``shard`` of ``num_shards`` of a group's endless document stream: ``stream[p]`` is the group-local
    index of the document at global position ``q = shard + p * num_shards``, i.e. item ``q % n`` of epoch
    ``q // n``'s permutation of the ``n`` documents (a new permutation each epoch, from ``seed``, the group name
    and the epoch, numpy's PCG64; the identity when ``shuffle`` is False). All shards together read every
    document once per epoch."""

    def __init__(self, num_docs: int, name: str, seed: int, shuffle: bool, shard: int, num_shards: int):
        if num_docs < 1:
            raise ValueError(f"group {name!r} has no documents")
        self.n, self.shard, self.num_shards, self.shuffle = num_docs, shard, num_shards, shuffle
        self._key = (seed % 2 ** 32, zlib.crc32(name.encode()))
        self._epoch, self._perm = -1, None

    def __getitem__(self, p: int) -> int:
        q = self.shard + p * self.num_shards
        epoch, i = divmod(q, self.n)
        if not self.shuffle:
            return i
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng((*self._key, epoch)).permutation(self.n)
        return int(self._perm[i])


#: ``(group, position) -> (tokens int[n], doc_index)``: the document at a group's stream position.
Reader = Callable[[str, int], tuple[np.ndarray, int]]


class TokenMixIterator:
    """Endless iterator of packed local batches mixed by tokens (module docstring), with exact JSON state.

    Args:
      read: :data:`Reader` for every group of ``schedule``.
      schedule: ``[(start_step, {group: weight}), ...]`` (:func:`parse_schedule`).
      rows: rows per batch (``global_batch_size / num_shards``).
      seq_len: tokens per row.
      pad_id, eos_id, bos_id: as :mod:`jaxpt.data.packing` (``eos_id`` / ``bos_id`` None: none put around a
        document; ``pad_id`` is unused, the stream is endless and never pads).
      first_step: the global step of the first batch (1; a fresh stream of a later stage: its first step).
      step_of_batch: loader batch index (0-based) -> the global step it feeds, for a batch-size ramp where a
        step takes several batches (:mod:`jaxpt.training.batch_ramp`); None: ``first_step + index``.

    Each ``next`` returns int32 arrays [rows, seq_len]: ``tokens``, ``segment_ids``, ``positions``,
    ``doc_index`` (the layout of :mod:`jaxpt.data.packing`) and :data:`GROUP_KEY`.

    Packing: each group keeps one open document. A row is filled piece by piece; each piece comes from the group
    the interleave picks next and is the rest of its open document or what fits in the row, whichever is
    shorter (a new segment at position 0, as a document continued into the next row is in
    :mod:`jaxpt.data.packing`). Counting tokens as they are placed bounds each group's error by one row
    (``seq_len`` tokens) per shard, however long its documents: a whole long document is never placed while the
    other groups wait.
    """

    def __init__(self, read: Reader, schedule, *, rows: int, seq_len: int, pad_id: int = 0,
                 eos_id: int | None = None, first_step: int = 1,
                 step_of_batch: Callable[[int], int] | None = None, bos_id: int | None = None):
        if rows < 1 or seq_len < 1:
            raise ValueError(f"rows and seq_len must be positive, got {rows}, {seq_len}")
        self._read, self.schedule, self.rows, self.seq_len = read, list(schedule), rows, seq_len
        self.pad_id, self.eos_id = pad_id, eos_id
        self.boundary = Boundary(bos_id=bos_id, eos_id=eos_id)
        self.groups = group_names(self.schedule)
        self._index = {g: i for i, g in enumerate(self.groups)}
        self._step_of = step_of_batch or (lambda b: first_step + b)
        self.batches = 0
        self.positions: dict[str, int] = {g: 0 for g in self.groups}
        self.stage = stage_at(self.schedule, self._step_of(0))
        self.stage_tokens = {g: 0 for g in self.groups}
        # group -> [position, offset, tokens (BOS/EOS around them), doc_index] of its open document
        self._open: dict[str, list] = {}
        self._carried: dict[str, list] = {}  # open documents of groups this mixture does not name (kept in state)

    def __iter__(self):
        return self

    def _weights(self) -> Mapping[str, float]:
        return self.schedule[self.stage][1]

    def _pick(self) -> str:
        w = self._weights()
        live = [g for g in self.groups if w.get(g, 0) > 0]
        return min(live, key=lambda g: (self.stage_tokens[g] / w[g], self._index[g]))

    def _load(self, g: str, pos: int, offset: int = 0) -> list:
        tokens, doc_index = self._read(g, pos)
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"group {g!r} position {pos}: tokens must be a 1-D integer array, got shape "
                             f"{tokens.shape} dtype {tokens.dtype}")
        return [pos, offset, self.boundary.wrap(tokens), int(doc_index)]

    def _open_doc(self, g: str) -> list:
        doc = self._open.get(g)
        for _ in range(1000):  # skip empty documents (no tokens, no BOS or EOS: nothing to place)
            if doc is not None and doc[1] < doc[2].size:
                self._open[g] = doc
                return doc
            pos = self.positions[g]
            doc = self._load(g, pos)
            self.positions[g] = pos + 1
        raise ValueError(f"mixture group {g!r}: 1000 empty documents in a row")

    def _row(self) -> dict[str, np.ndarray]:
        L = self.seq_len
        row = {"tokens": np.full(L, self.pad_id, np.int32), "segment_ids": np.zeros(L, np.int32),
               "positions": np.zeros(L, np.int32), "doc_index": np.full(L, -1, np.int32),
               GROUP_KEY: np.full(L, -1, np.int32)}
        filled = segment = 0
        while filled < L:
            g = self._pick()
            doc = self._open_doc(g)
            n = min(doc[2].size - doc[1], L - filled)
            span, segment = slice(filled, filled + n), segment + 1
            row["tokens"][span] = doc[2][doc[1]:doc[1] + n]
            row["segment_ids"][span] = segment
            row["positions"][span] = np.arange(n, dtype=np.int32)
            row["doc_index"][span] = doc[3]
            row[GROUP_KEY][span] = self._index[g]
            doc[1] += n
            filled += n
            self.stage_tokens[g] += n
            if doc[1] == doc[2].size:
                del self._open[g]
        return row

    def __next__(self) -> dict[str, np.ndarray]:
        stage = stage_at(self.schedule, self._step_of(self.batches))
        if stage != self.stage:
            self.stage, self.stage_tokens = stage, {g: 0 for g in self.groups}
        rows = [self._row() for _ in range(self.rows)]
        self.batches += 1
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def get_state(self) -> dict[str, Any]:
        open_docs = {g: d[:2] for g, d in self._carried.items()}
        open_docs.update({g: d[:2] for g, d in self._open.items()})
        return {"batches": self.batches, "positions": dict(self.positions), "stage": self.stage,
                "stage_weights": dict(self._weights()), "stage_tokens": dict(self.stage_tokens),
                "open": dict(sorted(open_docs.items()))}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore ``state`` (:meth:`get_state`, possibly of another mixture: module docstring).

        Raises:
          ValueError: ``state`` is not a mixture state (e.g. a checkpoint written before token mixtures).
        """
        if not isinstance(state, Mapping) or "positions" not in state or "open" not in state:
            got = sorted(state) if isinstance(state, Mapping) else state
            raise ValueError(f"not a token-mixture data state (got {got!r}); the checkpoint was written by a "
                             "reader without per-group positions")
        self.batches = int(state["batches"])
        # Groups this mixture does not name keep their positions and open documents for a later stage.
        self.positions = {**{g: 0 for g in self.groups}, **{g: int(p) for g, p in state["positions"].items()}}
        self.stage = stage_at(self.schedule, self._step_of(self.batches))
        same = int(state["stage"]) == self.stage and _same_weights(state["stage_weights"], self._weights())
        saved = {g: int(t) for g, t in state["stage_tokens"].items()} if same else {}
        self.stage_tokens = {g: saved.get(g, 0) for g in self.groups}
        self._open, self._carried = {}, {}
        for g, (pos, offset) in state["open"].items():
            if g in self._index:
                self._open[g] = self._load(g, int(pos), int(offset))
            else:
                self._carried[g] = [int(pos), int(offset)]

    def restart_step_count(self) -> None:
        """The next batch feeds this iterator's first step (a state carried from a parent run counts the parent's
        batches): the per-group positions and open documents stay, the schedule's stage follows the new count."""
        stage = stage_at(self.schedule, self._step_of(0))
        if stage != self.stage:
            self.stage_tokens = {g: 0 for g in self.groups}
        self.batches, self.stage = 0, stage


def mixture_iterator(domains: Sequence[str], sources: Sequence[str], fetch: Callable[[int], tuple[np.ndarray, int]],
                     schedule, *, key: str, seed: int, shuffle: bool, shard: int, num_shards: int, rows: int,
                     seq_len: int, pad_id: int = 0, eos_id: int | None = None,
                     first_step: int = 1, step_of_batch: Callable[[int], int] | None = None,
                     bos_id: int | None = None) -> TokenMixIterator:
    """:class:`TokenMixIterator` of logical shard ``shard`` of ``num_shards`` over documents ``0..N-1``.

    Args:
      domains, sources: each document's domain and source ([N] strings).
      fetch: document index -> ``(tokens int[n], doc_index)``.
      schedule: :func:`parse_schedule` output; key: its config key (errors name it).
      seed, shuffle: group streams (:class:`GroupStream`).
      shard, num_shards, rows, seq_len, pad_id, eos_id, first_step, step_of_batch, bos_id: as
        :class:`TokenMixIterator`.
    Raises:
      ConfigError: a group with no documents (:func:`assign_groups`).
    """
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} not in [0, {num_shards})")
    members = assign_groups(domains, sources, group_names(schedule), key)
    streams = {g: GroupStream(len(m), g, seed, shuffle, shard, num_shards) for g, m in members.items()}

    def read(g: str, pos: int):
        return fetch(members[g][streams[g][pos]])

    return TokenMixIterator(read, schedule, rows=rows, seq_len=seq_len, pad_id=pad_id, eos_id=eos_id,
                            first_step=first_step, step_of_batch=step_of_batch, bos_id=bos_id)


def _same_weights(a: Mapping[str, float], b: Mapping[str, float]) -> bool:
    keys = {g for g in a if a[g] > 0} | {g for g in b if b[g] > 0}
    return all(abs(a.get(g, 0.0) - b.get(g, 0.0)) <= 1e-12 for g in keys)


def realized_shares(counts: Mapping[str, int]) -> dict[str, float]:
    """``{group: tokens / total}`` of token counts (all 0 when there are none)."""
    total = sum(counts.values())
    return {g: (c / total if total else 0.0) for g, c in sorted(counts.items())}
