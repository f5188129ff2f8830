"""The team's conclusions database (issue #36); its command line is ``python -m jaxpt.tools.conclusions``.

One SQLite file per team holds experiments, runs (by the run registry's ``run_id``, so ``jaxpt.tools.runs`` and this
database name a run alike), data versions (corpus manifest ids, ``run.json``'s ``data_version``), eval cards
(``<name>@v<version>`` and their content hash), compute per run, final metrics, and conclusions: a statement, the ids
it rests on (its evidence) and its status (proposed / confirmed / refuted / superseded)::

    python -m jaxpt.tools.conclusions import-run workdirs/proxy-3 --experiment mix-001 --role proxy
    python -m jaxpt.tools.conclusions list runs --experiment mix-001
    python -m jaxpt.tools.conclusions show c0001          # any id: experiment, run, data version, eval card, conclusion
    python -m jaxpt.tools.conclusions compare RUN_A RUN_B --metric heldout_loss
    python -m jaxpt.tools.conclusions add-conclusion --statement "..." --evidence RUN_A --evidence raw-v1
    python -m jaxpt.tools.conclusions set-status c0001 superseded --superseded-by c0002

Where the file lives: ``--db PATH``, else ``$JAXPT_CONCLUSIONS_DB``, else ``conclusions.sqlite`` in the current
folder. A ``gs://`` path is copied to a local temporary file when opened (:mod:`jaxpt.util.fs`) and uploaded back whole
after every write transaction. **Concurrent writers to one remote file are not safe**: each works on its own copy and
the last upload wins, silently dropping the other's rows; give each writer its own file, or write one at a time. A
local file uses SQLite's own locking (a write transaction takes the write lock at its start, ``BEGIN IMMEDIATE``, and
waits up to :data:`BUSY_TIMEOUT_S` for another writer), so several processes on one host may write it; SQLite's
locking over network file systems (NFS) is not reliable.

Ids are strings, unique across every kind (an experiment cannot share its id with a run), so any id resolves to one
row (:meth:`ConclusionsDB.resolve`). Written through SQLAlchemy Core (``Table``/``MetaData``; one
``engine.begin``-style transaction per call), with SQLite's foreign keys switched on for every connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import getpass
import json
import math
import os
import re
import sys
import tempfile
import weakref
from typing import Any, Iterable, Iterator, Mapping, Sequence

import sqlalchemy as sa

from jaxpt import config as config_lib
from jaxpt.data import corpus as corpus_lib, stream
from jaxpt.eval import card as card_lib
from jaxpt.lab import registry as runs_lib
from jaxpt.run.record import utc_now
from jaxpt.run.resolve import resolve_vocab
from jaxpt.training import batch_ramp, flops as flops_lib
from jaxpt.util import fs, jsonl
from jaxpt.util.errors import ConfigError

#: The schema this code writes. A file recording a newer one is refused (its rows may mean what this code cannot).
SCHEMA_VERSION = 1
#: The environment variable naming the database when ``--db`` is not given.
DB_ENV = "JAXPT_CONCLUSIONS_DB"
DEFAULT_DB = "conclusions.sqlite"
#: Seconds a local write waits for another process's write lock before failing ("database is locked").
BUSY_TIMEOUT_S = 30.0
CONCLUSION_STATUSES = ("proposed", "confirmed", "refuted", "superseded")
EXPERIMENT_STATUSES = ("running", "completed", "failed", "stopped")
#: The kinds an id resolves to, in the order :meth:`ConclusionsDB.resolve` looks.
KINDS = ("experiment", "run", "data_version", "eval_card", "conclusion")
_WORD = re.compile(r"[a-z][a-z0-9_-]*")
#: A run's role: a lower-case word, optionally qualified (``validation:natural``).
_ROLE = re.compile(r"[a-z][a-z0-9_-]*(:[a-z0-9][a-z0-9_.-]*)*")


class ConclusionsError(ValueError):
    """Input the database refuses, or a database file it cannot use; the message names the id, key or file."""


# ------------------------------------------------------------------------------------------------ schema

metadata = sa.MetaData()

schema_version_table = sa.Table("schema_version", metadata, sa.Column("version", sa.Integer, nullable=False))

data_versions_table = sa.Table(
    "data_versions", metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("path", sa.String),
    sa.Column("details", sa.JSON, nullable=False))

eval_cards_table = sa.Table(
    "eval_cards", metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("name", sa.String, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("content_sha256", sa.String, nullable=False),
    sa.UniqueConstraint("name", "version"))

experiments_table = sa.Table(
    "experiments", metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("kind", sa.String, nullable=False),
    sa.Column("created_at", sa.String, nullable=False),
    sa.Column("config", sa.JSON, nullable=False),
    sa.Column("data_version", sa.String, sa.ForeignKey("data_versions.id")),
    sa.Column("target", sa.JSON),
    sa.Column("status", sa.String, nullable=False))

runs_table = sa.Table(
    "runs", metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("experiment_id", sa.String, sa.ForeignKey("experiments.id")),
    sa.Column("role", sa.String, nullable=False),
    sa.Column("workdir", sa.String),
    sa.Column("config_hash", sa.String),
    sa.Column("data_version", sa.String, sa.ForeignKey("data_versions.id"), nullable=False),
    sa.Column("eval_card", sa.String, sa.ForeignKey("eval_cards.id")),
    sa.Column("mixture", sa.JSON),
    sa.Column("flops", sa.Float),
    sa.Column("device_seconds", sa.Float),
    sa.Column("wall_s", sa.Float),
    sa.Column("tokens", sa.Integer),
    sa.Column("created_at", sa.String, nullable=False))

metrics_table = sa.Table(
    "metrics", metadata,
    sa.Column("run_id", sa.String, sa.ForeignKey("runs.id"), primary_key=True),
    sa.Column("name", sa.String, primary_key=True),
    sa.Column("value", sa.Float, nullable=False))

conclusions_table = sa.Table(
    "conclusions", metadata,
    sa.Column("id", sa.String, primary_key=True),
    sa.Column("statement", sa.Text, nullable=False),
    sa.Column("status", sa.String, nullable=False),
    sa.Column("superseded_by", sa.String, sa.ForeignKey("conclusions.id")),
    sa.Column("experiment_id", sa.String, sa.ForeignKey("experiments.id")),
    sa.Column("author", sa.String, nullable=False),
    sa.Column("created_at", sa.String, nullable=False),
    sa.CheckConstraint(f"status IN {CONCLUSION_STATUSES}", name="conclusion_status"))

evidence_table = sa.Table(
    "evidence", metadata,
    sa.Column("conclusion_id", sa.String, sa.ForeignKey("conclusions.id"), primary_key=True),
    # any kind of id (run, data version, eval card, experiment, conclusion): no foreign key; checked on insert
    sa.Column("ref_id", sa.String, primary_key=True),
    sa.Column("kind", sa.String, nullable=False),  # what the id resolved to when the conclusion was added
    sa.Column("position", sa.Integer, nullable=False))  # the order the author gave

#: ``{kind: table}`` of the id-bearing tables, in :data:`KINDS` order.
TABLES = {"experiment": experiments_table, "run": runs_table, "data_version": data_versions_table,
          "eval_card": eval_cards_table, "conclusion": conclusions_table}


def default_path() -> str:
    """``$JAXPT_CONCLUSIONS_DB``, else ``conclusions.sqlite`` in the current folder."""
    return os.environ.get(DB_ENV) or DEFAULT_DB


def _json_value(value: Any, what: str) -> Any:
    """``value`` as it reads back from a JSON column (tuples become lists, non-finite floats their strings as
    :func:`jaxpt.util.jsonl.finite` writes them: a corpus manifest records an unset quality threshold as -inf), for
    comparing a re-add with the row.

    Raises:
      ConclusionsError: not JSON-serializable (names ``what``).
    """
    try:
        return json.loads(jsonl.dumps(value))
    except (TypeError, ValueError) as e:
        raise ConclusionsError(f"{what}: not JSON-serializable ({e})") from None


def _word(value: str, what: str) -> str:
    if not isinstance(value, str) or not _WORD.fullmatch(value):
        raise ConclusionsError(f"{what} = {value!r}: expected a lower-case word (letters, digits, '_' or '-')")
    return value


def _role(value: str, what: str) -> str:
    if not isinstance(value, str) or not _ROLE.fullmatch(value):
        raise ConclusionsError(f"{what} = {value!r}: expected a lower-case word (letters, digits, '_' or '-'), "
                               "optionally qualified after ':' (validation:natural)")
    return value


def _id(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip() or value != value.strip():
        raise ConclusionsError(f"{what} = {value!r}: expected a non-empty string id without surrounding spaces")
    return value


def _number(value: Any, what: str, integer: bool = False) -> float | int | None:
    """``value`` as a finite float (int with ``integer``), or None. Raises ConclusionsError naming ``what``."""
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (integer and float(value) != int(value)):
        raise ConclusionsError(f"{what} = {value!r}: expected a finite {'integer' if integer else 'number'}")
    return int(value) if integer else float(value)


# ------------------------------------------------------------------------------------------------ the database


class ConclusionsDB:
    """The conclusions database in the SQLite file ``path`` (local, or ``gs://``: module docstring), its schema created
    when absent.

    Raises:
      ConclusionsError: the file is not a SQLite database, or records a schema newer than :data:`SCHEMA_VERSION`
        (names the file).
    """

    def __init__(self, path: str | None = None):
        self.path = path or default_path()
        self.remote = fs.is_remote(self.path)
        self.local = self._local_file()
        self.engine = sa.create_engine(f"sqlite:///{self.local}", connect_args={"timeout": BUSY_TIMEOUT_S})
        sa.event.listen(self.engine, "connect", _on_connect)
        sa.event.listen(self.engine, "begin", _on_begin)
        try:
            self._open_schema()
        except BaseException:
            self.close()
            raise

    def _local_file(self) -> str:
        """The file SQLite opens: ``path`` itself, or a downloaded copy of the remote file in a private temporary
        folder removed by :meth:`close` (or at exit)."""
        if not self.remote:
            parent = fs.dirname(fs.absolute(self.path))
            if not fs.isdir(parent):
                raise ConclusionsError(f"{self.path}: its folder {parent} does not exist")
            return fs.absolute(self.path)
        tmp = tempfile.mkdtemp(prefix="jaxpt-conclusions-")
        self._cleanup = weakref.finalize(self, fs.rmtree, tmp)
        local = os.path.join(tmp, fs.basename(self.path) or DEFAULT_DB)
        if fs.exists(self.path):
            fs.replace_local(local, fs.read_bytes(self.path))
        return local

    def _upload(self) -> None:
        if self.remote:
            fs.write_bytes_atomic(self.path, fs.read_bytes(self.local))

    def close(self) -> None:
        """Release the file (and a remote file's local copy). Every write was already committed (and uploaded)."""
        self.engine.dispose()
        if self.remote:
            self._cleanup()

    def __enter__(self) -> "ConclusionsDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def _read(self) -> Iterator[sa.Connection]:
        with self._errors(), self.engine.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def _write(self) -> Iterator[sa.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``: the write lock from its start, so a check and the insert it
        guards see the same rows); a remote file is uploaded after it commits."""
        with self._errors(), self.engine.connect() as conn:
            conn.execution_options(jaxpt_write=True)
            with conn.begin():
                yield conn
        self._upload()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """SQLite's own errors (not a database, locked, a constraint) as ConclusionsError naming the file."""
        try:
            yield
        except sa.exc.DBAPIError as e:
            raise ConclusionsError(f"{self.path}: {e.orig}") from e

    def _open_schema(self) -> None:
        with self._read() as conn:
            names = set(sa.inspect(conn).get_table_names())
            version = None
            if "schema_version" in names:
                version = conn.scalar(sa.select(sa.func.max(schema_version_table.c.version)))
        if version is not None and version > SCHEMA_VERSION:
            raise ConclusionsError(f"{self.path}: schema version {version} is newer than this jaxpt's "
                                   f"{SCHEMA_VERSION}; use a newer jaxpt to read it")
        if version is None:
            if names:
                raise ConclusionsError(f"{self.path}: a SQLite database without a conclusions schema "
                                       f"(tables {sorted(names)}); refusing to add one to it")
            with self._write() as conn:  # re-checked under the write lock: another process may have created it
                if not sa.inspect(conn).has_table("schema_version"):
                    metadata.create_all(conn)
                    conn.execute(schema_version_table.insert().values(version=SCHEMA_VERSION))

    # -------------------------------------------------------------------------------------------- ids

    def has(self, ref_id: str) -> bool:
        """Whether ``ref_id`` is recorded, as any kind."""
        with self._read() as conn:
            return self._kind_of(conn, ref_id) is not None

    def _kind_of(self, conn: sa.Connection, ref_id: str) -> str | None:
        for kind, table in TABLES.items():
            if conn.scalar(sa.select(table.c.id).where(table.c.id == ref_id)) is not None:
                return kind
        return None

    def _existing(self, conn: sa.Connection, kind: str, ref_id: str) -> dict[str, Any] | None:
        """The row of ``ref_id`` as a ``kind``, or None when absent. Raises ConclusionsError when the id is
        another kind's."""
        found = self._kind_of(conn, ref_id)
        if found is None:
            return None
        if found != kind:
            raise ConclusionsError(f"id {ref_id!r} is already {_a(found)}, not {_a(kind)}: ids are unique across "
                                   "kinds")
        table = TABLES[kind]
        return dict(conn.execute(sa.select(table).where(table.c.id == ref_id)).mappings().one())

    def _require(self, conn: sa.Connection, kind: str, ref_id: str | None, what: str) -> None:
        """Raise ConclusionsError naming ``what`` and ``ref_id`` unless it is an existing ``kind`` (None passes)."""
        if ref_id is None:
            return
        found = self._kind_of(conn, ref_id)
        if found != kind:
            other = f" ({ref_id!r} is {_a(found)})" if found else ""
            raise ConclusionsError(f"{what} {ref_id!r}: no such {_name(kind)} in {self.path}{other}")

    def _insert_once(self, conn: sa.Connection, kind: str, row: dict[str, Any], ignore: Sequence[str] = ()) -> bool:
        """Insert ``row`` unless a row with its id exists; an existing row must equal it (``ignore``'s columns aside).
        True when inserted.

        Raises:
          ConclusionsError: the id exists with other content (names the id and the differing columns), or is
            another kind's id.
        """
        old = self._existing(conn, kind, row["id"])
        if old is None:
            conn.execute(TABLES[kind].insert().values(**row))
            return True
        differ = sorted(k for k in row if k not in ignore and old.get(k) != row[k])
        if differ:
            detail = "; ".join(f"{k}: stored {old.get(k)!r}, given {row[k]!r}" for k in differ)
            raise ConclusionsError(f"{_name(kind)} {row['id']!r} already exists with other content "
                                   f"({detail})")
        return False

    # -------------------------------------------------------------------------------------------- writing

    def add_data_version(self, data_version: str, path: str | None = None,
                         details: Mapping[str, Any] | None = None, *, if_absent: bool = False) -> str:
        """Record a data version: ``data_version`` (a corpus manifest's ``data_version``, or whatever identifier
        ``run.json`` records: :func:`jaxpt.data.stream.data_version`), where it lives, and ``details`` (JSON: the
        manifest, counts). Idempotent: the same content again is a no-op. With ``if_absent``, an id already recorded
        is kept as stored whatever ``path`` and ``details`` say (the id names the data; a path only locates one
        copy). One recorded by id alone (by :meth:`add_experiment` or :meth:`add_run`) takes the first path and
        details given. Returns the id.

        Raises:
          ConclusionsError: the id exists with another path or details (unless ``if_absent``), is another kind's id,
            or details are not JSON.
        """
        row = {"id": _id(data_version, "data version"), "path": path,
               "details": _json_value(dict(details or {}), f"data version {data_version!r} details")}
        with self._write() as conn:
            old = self._existing(conn, "data_version", data_version)
            if old is not None and old["path"] is None and not old["details"] and (path or row["details"]):
                conn.execute(data_versions_table.update().where(data_versions_table.c.id == data_version)
                             .values(path=path, details=row["details"]))
            elif old is None or not if_absent:
                self._insert_once(conn, "data_version", row)
        return data_version

    def _data_version_by_id(self, conn: sa.Connection, data_version: str | None, what: str) -> None:
        """Record ``data_version`` by id alone when it is not recorded yet (None: nothing)."""
        if data_version is not None and self._existing(conn, "data_version", _id(data_version, what)) is None:
            conn.execute(data_versions_table.insert().values(id=data_version, path=None, details={}))

    def add_eval_card(self, name: str, version: int, content_sha256: str) -> str:
        """Record an eval card (:mod:`jaxpt.eval.card`) by name, version and content hash; returns its id
        ``"<name>@v<version>"``. Idempotent for the same hash.

        Raises:
          ConclusionsError: that name and version exist with another hash (a card changed without a new version).
        """
        version = _number(version, f"eval card {name!r} version", integer=True)
        if not isinstance(content_sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", content_sha256):
            raise ConclusionsError(f"eval card {name!r}: content_sha256 = {content_sha256!r} is not a sha256 "
                                   "hex digest")
        row = {"id": f"{_id(name, 'eval card name')}@v{version}", "name": name, "version": version,
               "content_sha256": content_sha256}
        with self._write() as conn:
            self._insert_once(conn, "eval_card", row)
        return row["id"]

    def add_experiment(self, experiment_id: str, kind: str, config: Mapping[str, Any] | None = None,
                       data_version: str | None = None, target: Any = None, status: str = "running") -> str:
        """Record an experiment: its ``kind`` (``'mixture'``, ...), ``config`` and ``target`` (JSON: what it varies and
        what it optimizes), the data version it samples from (recorded by id alone when it is not yet: see
        :meth:`add_data_version` and :func:`add_corpus_version` for its path and manifest) and ``status`` (one of
        :data:`EXPERIMENT_STATUSES`). ``created_at`` is now (UTC). Idempotent: adding the same kind, config, data
        version and target again (an experiment resumed after a crash) is a no-op that keeps the stored status and
        time. Returns the id.

        Raises:
          ConclusionsError: the id exists with other content, or a value is malformed.
        """
        row = {"id": _id(experiment_id, "experiment"), "kind": _word(kind, f"experiment {experiment_id!r} kind"),
               "config": _json_value(dict(config or {}), f"experiment {experiment_id!r} config"),
               "data_version": data_version, "target": _json_value(target, f"experiment {experiment_id!r} target"),
               "status": self._status(status, EXPERIMENT_STATUSES, f"experiment {experiment_id!r}"),
               "created_at": utc_now()}
        with self._write() as conn:
            self._data_version_by_id(conn, data_version, f"experiment {experiment_id!r}: data version")
            self._insert_once(conn, "experiment", row, ignore=("status", "created_at"))
        return experiment_id

    @staticmethod
    def _status(status: str, allowed: Sequence[str], what: str) -> str:
        if status not in allowed:
            raise ConclusionsError(f"{what}: status {status!r} is not one of {', '.join(allowed)}")
        return status

    def set_experiment_status(self, experiment_id: str, status: str) -> None:
        """Set an experiment's status (one of :data:`EXPERIMENT_STATUSES`).

        Raises:
          ConclusionsError: unknown experiment or status.
        """
        self._status(status, EXPERIMENT_STATUSES, f"experiment {experiment_id!r}")
        with self._write() as conn:
            self._require(conn, "experiment", experiment_id, "experiment")
            conn.execute(experiments_table.update().where(experiments_table.c.id == experiment_id)
                         .values(status=status))

    def add_run(self, run_id: str, *, data_version: str, role: str = "manual", experiment_id: str | None = None,
                workdir: str | None = None, config_hash: str | None = None, eval_card: str | None = None,
                mixture: Any = None, flops: float | None = None, device_seconds: float | None = None,
                wall_s: float | None = None, tokens: int | None = None, created_at: str | None = None) -> str:
        """Record a run under its registry id (``run.json``'s ``run_id``; :func:`import_run` reads them all from a
        workdir). ``role``: a lower-case word, optionally qualified after ``:``; by convention ``'proxy'``,
        ``'validation'`` (``'validation:natural'``) or ``'manual'``. ``experiment_id`` and ``eval_card`` must be
        recorded already; ``data_version`` is recorded by id alone when it is not (:meth:`add_data_version`).
        Units: ``flops`` in FLOPs (training, :func:`jaxpt.training.flops.flops_per_token` x ``tokens``),
        ``device_seconds`` in device-seconds, ``wall_s`` in seconds, ``tokens`` trained. ``mixture``: JSON (the run's
        mixture schedule as ``run.json`` records it: ``[{"start_step", "weights": {group: share}}]``).
        ``created_at``: UTC ISO time (default now). Idempotent: the same content again (``created_at`` aside) is a
        no-op.

        Raises:
          ConclusionsError: the id exists with other content (names the differing fields), a linked id is unknown,
            or a value is malformed.
        """
        row = {"id": _id(run_id, "run"), "experiment_id": experiment_id, "role": _role(role, f"run {run_id!r} role"),
               "workdir": workdir, "config_hash": config_hash, "data_version": data_version, "eval_card": eval_card,
               "mixture": _json_value(mixture, f"run {run_id!r} mixture"),
               "flops": _number(flops, f"run {run_id!r} flops"),
               "device_seconds": _number(device_seconds, f"run {run_id!r} device_seconds"),
               "wall_s": _number(wall_s, f"run {run_id!r} wall_s"),
               "tokens": _number(tokens, f"run {run_id!r} tokens", integer=True), "created_at": created_at or utc_now()}
        with self._write() as conn:
            self._data_version_by_id(conn, data_version, f"run {run_id!r} data version")
            self._require(conn, "experiment", experiment_id, f"run {run_id!r}: experiment")
            self._require(conn, "eval_card", eval_card, f"run {run_id!r}: eval card")
            self._insert_once(conn, "run", row, ignore=("created_at",))
        return run_id

    def link_eval_card(self, run_id: str, eval_card: str) -> None:
        """Link a recorded run to the eval card it was scored on, when it was imported before it was scored (a mixture
        experiment's proxy scored on a card target at a refit). Idempotent: the same card again is a no-op.

        Raises:
          ConclusionsError: an unknown run or eval card, or a run already linked to another card (naming both: a
            run's card metrics are one card's).
        """
        with self._write() as conn:
            self._require(conn, "run", run_id, "run")
            self._require(conn, "eval_card", eval_card, f"run {run_id!r}: eval card")
            old = conn.scalar(sa.select(runs_table.c.eval_card).where(runs_table.c.id == run_id))
            if old == eval_card:
                return
            if old is not None:
                raise ConclusionsError(f"run {run_id!r} is linked to eval card {old!r}, not {eval_card!r}: a run's "
                                       "card metrics are one card's")
            conn.execute(runs_table.update().where(runs_table.c.id == run_id).values(eval_card=eval_card))

    def add_metrics(self, run_id: str, values: Mapping[str, float]) -> None:
        """Record a run's metrics ``{name: value}`` (finite numbers; units as the name says: ``heldout_loss`` in
        nats/token, ``train_time_s`` in seconds). Idempotent per metric: the same value again is a no-op.

        Raises:
          ConclusionsError: unknown run, a non-finite or non-numeric value, or a metric already stored with another
            value (names the run, metric and both values).
        """
        rows = {_id(k, f"run {run_id!r} metric name"): _number(v, f"run {run_id!r} metric {k!r}")
                for k, v in values.items()}
        with self._write() as conn:
            self._require(conn, "run", run_id, "run")
            stored = self._metrics(conn, [run_id]).get(run_id, {})
            for name, value in rows.items():
                if name not in stored:
                    conn.execute(metrics_table.insert().values(run_id=run_id, name=name, value=value))
                elif stored[name] != value:
                    raise ConclusionsError(f"run {run_id!r} metric {name!r}: stored {stored[name]!r}, given {value!r}")

    def add_conclusion(self, statement: str, evidence: Iterable[str], status: str = "proposed",
                       experiment_id: str | None = None, author: str | None = None) -> str:
        """Record a conclusion and the ids it rests on; returns its new id (``c0001``, ``c0002``, ...).

        ``evidence``: one or more ids of any kind (runs, data versions, eval cards, experiments, other conclusions),
        each of which must resolve. ``status``: ``proposed``, ``confirmed`` or ``refuted`` (``superseded`` is set by
        :meth:`set_status`, which names the successor). ``author``: default the login name.

        Raises:
          ConclusionsError: an empty statement, no evidence, an evidence id that resolves to nothing (named), an
            unknown experiment, or a status outside those three.
        """
        if not isinstance(statement, str) or not statement.strip():
            raise ConclusionsError("a conclusion needs a statement (non-empty text)")
        self._status(status, CONCLUSION_STATUSES[:3], "a new conclusion (superseded is set with set_status)")
        refs = list(dict.fromkeys(evidence))
        if not refs:
            raise ConclusionsError("a conclusion needs at least one evidence id (a run, data version, eval card, ...)")
        with self._write() as conn:
            self._require(conn, "experiment", experiment_id, "conclusion: experiment")
            kinds = {ref: self._kind_of(conn, ref) for ref in refs}
            missing = [ref for ref, kind in kinds.items() if kind is None]
            if missing:
                raise ConclusionsError(f"evidence {', '.join(map(repr, missing))}: no such id in {self.path}")
            cid = self._next_conclusion_id(conn)
            conn.execute(conclusions_table.insert().values(
                id=cid, statement=statement.strip(), status=status, superseded_by=None, experiment_id=experiment_id,
                author=author or _login(), created_at=utc_now()))
            conn.execute(evidence_table.insert(),
                         [{"conclusion_id": cid, "ref_id": r, "kind": k, "position": i}
                          for i, (r, k) in enumerate(kinds.items())])
        return cid

    def _next_conclusion_id(self, conn: sa.Connection) -> str:
        numbers = [int(i[1:]) for i in conn.scalars(sa.select(conclusions_table.c.id)) if re.fullmatch(r"c\d+", i)]
        cid = f"c{max(numbers, default=0) + 1:04d}"
        if self._kind_of(conn, cid) is not None:
            raise ConclusionsError(f"the next conclusion id {cid!r} is already another kind's id")
        return cid

    def set_status(self, conclusion_id: str, status: str, superseded_by: str | None = None) -> None:
        """Set a conclusion's status. ``superseded`` needs ``superseded_by``, an existing other conclusion; any other
        status takes none (and clears a previous successor).

        Raises:
          ConclusionsError: unknown conclusion or status; superseded without (or with an unknown, or its own)
            successor; a successor given with another status.
        """
        self._status(status, CONCLUSION_STATUSES, f"conclusion {conclusion_id!r}")
        if (status == "superseded") != (superseded_by is not None):
            raise ConclusionsError(f"conclusion {conclusion_id!r}: " + (
                "superseded needs superseded_by (the conclusion that replaces it)" if superseded_by is None
                else f"superseded_by is only for status superseded, not {status!r}"))
        if superseded_by == conclusion_id:
            raise ConclusionsError(f"conclusion {conclusion_id!r} cannot supersede itself")
        with self._write() as conn:
            self._require(conn, "conclusion", conclusion_id, "conclusion")
            self._require(conn, "conclusion", superseded_by, f"conclusion {conclusion_id!r}: superseded_by")
            conn.execute(conclusions_table.update().where(conclusions_table.c.id == conclusion_id)
                         .values(status=status, superseded_by=superseded_by))

    # -------------------------------------------------------------------------------------------- reading

    @staticmethod
    def _metrics(conn: sa.Connection, run_ids: Sequence[str]) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        q = sa.select(metrics_table).where(metrics_table.c.run_id.in_(run_ids)).order_by(metrics_table.c.name)
        for r in conn.execute(q):
            out.setdefault(r.run_id, {})[r.name] = r.value
        return out

    @staticmethod
    def _evidence(conn: sa.Connection, conclusion_ids: Sequence[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {c: [] for c in conclusion_ids}
        t = evidence_table
        q = sa.select(t).where(t.c.conclusion_id.in_(conclusion_ids)).order_by(t.c.position)
        for r in conn.execute(q):
            out[r.conclusion_id].append(r.ref_id)
        return out

    def resolve(self, ref_id: str) -> tuple[str, dict[str, Any]]:
        """``(kind, row)`` of any id: kind one of :data:`KINDS`; a run's row carries ``metrics`` (``{name: value}``),
        a conclusion's ``evidence`` (its ids).

        Raises:
          ConclusionsError: no such id (names it and the file).
        """
        with self._read() as conn:
            kind = self._kind_of(conn, ref_id)
            if kind is None:
                raise ConclusionsError(f"{ref_id!r}: no such id in {self.path}")
            row = self._existing(conn, kind, ref_id)
            if kind == "run":
                row["metrics"] = self._metrics(conn, [ref_id]).get(ref_id, {})
            elif kind == "conclusion":
                row["evidence"] = self._evidence(conn, [ref_id])[ref_id]
        return kind, row

    def experiment(self, experiment_id: str) -> dict[str, Any]:
        """An experiment's row with ``runs`` (its run ids) and ``conclusions`` (its conclusion ids).

        Raises:
          ConclusionsError: no such experiment.
        """
        with self._read() as conn:
            self._require(conn, "experiment", experiment_id, "experiment")
            row = self._existing(conn, "experiment", experiment_id)
            row["runs"] = list(conn.scalars(sa.select(runs_table.c.id)
                                            .where(runs_table.c.experiment_id == experiment_id)
                                            .order_by(runs_table.c.created_at, runs_table.c.id)))
            row["conclusions"] = list(conn.scalars(sa.select(conclusions_table.c.id).where(
                conclusions_table.c.experiment_id == experiment_id).order_by(conclusions_table.c.id)))
        return row

    def experiments(self, status: str | None = None) -> list[dict[str, Any]]:
        """Every experiment's row (by creation time), only those with ``status`` when given."""
        q = sa.select(experiments_table).order_by(experiments_table.c.created_at, experiments_table.c.id)
        if status is not None:
            q = q.where(experiments_table.c.status == self._status(status, EXPERIMENT_STATUSES, "--status"))
        with self._read() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def runs(self, experiment_id: str | None = None, role: str | None = None) -> list[dict[str, Any]]:
        """Every run's row with its ``metrics`` (``{name: value}``), by creation time; only an experiment's and/or a
        role's when given (a role without ``:`` also matches its qualified forms: ``validation`` matches
        ``validation:natural``).

        Raises:
          ConclusionsError: an unknown experiment.
        """
        q = sa.select(runs_table).order_by(runs_table.c.created_at, runs_table.c.id)
        if experiment_id is not None:
            q = q.where(runs_table.c.experiment_id == experiment_id)
        if role is not None:
            match = runs_table.c.role == role
            q = q.where(match if ":" in role else match | runs_table.c.role.startswith(role + ":", autoescape=True))
        with self._read() as conn:
            self._require(conn, "experiment", experiment_id, "experiment")
            rows = [dict(r) for r in conn.execute(q).mappings()]
            ms = self._metrics(conn, [r["id"] for r in rows])
        return [{**r, "metrics": ms.get(r["id"], {})} for r in rows]

    def conclusions(self, status: str | None = None, experiment_id: str | None = None) -> list[dict[str, Any]]:
        """Every conclusion's row with its ``evidence`` ids, by id; only those with ``status`` / of an experiment when
        given.

        Raises:
          ConclusionsError: an unknown status or experiment.
        """
        q = sa.select(conclusions_table).order_by(conclusions_table.c.id)
        if status is not None:
            q = q.where(conclusions_table.c.status == self._status(status, CONCLUSION_STATUSES, "--status"))
        if experiment_id is not None:
            q = q.where(conclusions_table.c.experiment_id == experiment_id)
        with self._read() as conn:
            self._require(conn, "experiment", experiment_id, "experiment")
            rows = [dict(r) for r in conn.execute(q).mappings()]
            ev = self._evidence(conn, [r["id"] for r in rows])
        return [{**r, "evidence": ev[r["id"]]} for r in rows]

    def data_versions(self) -> list[dict[str, Any]]:
        """Every data version's row with ``runs``, the number of runs trained on it."""
        n = sa.select(sa.func.count()).where(runs_table.c.data_version == data_versions_table.c.id).scalar_subquery()
        with self._read() as conn:
            return [dict(r) for r in conn.execute(sa.select(data_versions_table, n.label("runs"))
                                                  .order_by(data_versions_table.c.id)).mappings()]

    def eval_cards(self) -> list[dict[str, Any]]:
        """Every eval card's row, by name and version."""
        with self._read() as conn:
            q = sa.select(eval_cards_table).order_by(eval_cards_table.c.name, eval_cards_table.c.version)
            return [dict(r) for r in conn.execute(q).mappings()]

    def citing(self, ref_id: str) -> list[dict[str, Any]]:
        """The conclusions whose evidence includes ``ref_id`` (id, status, statement), by id."""
        c, e = conclusions_table, evidence_table
        q = (sa.select(c.c.id, c.c.status, c.c.statement).join(e, e.c.conclusion_id == c.c.id)
             .where(e.c.ref_id == ref_id).order_by(c.c.id))
        with self._read() as conn:
            return [dict(r) for r in conn.execute(q).mappings()]

    def compare(self, run_ids: Sequence[str], metrics: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """One row per run, in the order given: its compute (``flops``, ``device_seconds``, ``wall_s``, ``tokens``),
        ``role``, ``experiment_id``, ``data_version``, ``eval_card`` and ``metrics`` (``{name: value}``: the named
        ones, a run without one lacking it; every metric when ``metrics`` is None).

        Raises:
          ConclusionsError: an unknown run id, or a named metric that none of the runs has (each named).
        """
        with self._read() as conn:
            for r in run_ids:
                self._require(conn, "run", r, "run")
            q = sa.select(runs_table).where(runs_table.c.id.in_(run_ids))
            rows = {r["id"]: dict(r) for r in conn.execute(q).mappings()}
            ms = self._metrics(conn, list(run_ids))
        if metrics is not None:
            unknown = [m for m in metrics if not any(m in v for v in ms.values())]
            if unknown:
                raise ConclusionsError(f"metric {', '.join(map(repr, unknown))}: none of runs {list(run_ids)} has it")
        keep = ("id", "role", "experiment_id", "data_version", "eval_card", "flops", "device_seconds", "wall_s",
                "tokens")
        return [{**{k: rows[r][k] for k in keep},
                 "metrics": {k: v for k, v in ms.get(r, {}).items() if metrics is None or k in metrics}}
                for r in run_ids]


def _on_connect(dbapi_connection, connection_record) -> None:
    """Every new SQLite connection: the driver's own BEGIN off (``_on_begin`` emits it: SQLAlchemy's recipe for
    transactions that include the first SELECT, sqlite dialect docs), then foreign keys on (off by default in SQLite;
    the PRAGMA only works outside a transaction)."""
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _on_begin(conn: sa.Connection) -> None:
    """BEGIN for a read, BEGIN IMMEDIATE (the write lock now) for a write: a writer's checks and inserts are atomic."""
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("jaxpt_write") else "BEGIN")


def _name(kind: str) -> str:
    """A kind as words: ``data_version`` -> ``data version``."""
    return kind.replace("_", " ")


def _a(kind: str) -> str:
    """A kind with its article: ``an experiment``, ``a run``."""
    return ("an " if kind[0] in "aeiou" else "a ") + _name(kind)


def _login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (a container without a passwd entry)
        return "unknown"


# ------------------------------------------------------------------------------------------------ from the registry


@dataclasses.dataclass(frozen=True)
class RunCompute:
    """What a run cost, from its ``run.json`` and operative ``config.gin`` (:func:`run_compute`).

    Attributes:
      flops_per_token: training FLOPs per token, :func:`jaxpt.training.flops.flops_per_token` of the run's model at
        its ``seq_len``. tokens: tokens this run trained on. flops: ``flops_per_token * tokens`` (FLOPs).
      device_seconds: ``final.train_time_s * devices.count`` (device-seconds). wall_s: seconds of wall time.
    """

    flops_per_token: float
    tokens: int
    flops: float
    device_seconds: float | None
    wall_s: float | None


def run_compute(rec: Mapping[str, Any], cfg) -> RunCompute:
    """The compute of the run whose ``run.json`` is ``rec`` and whose config (vocabulary resolved) is ``cfg``.

    - tokens: the trainer's own count (:meth:`jaxpt.run.monitor.Throughput.tokens_seen`): rows of steps
      ``start+1 .. final.step`` (the batch-size ramp's when there is one: :mod:`jaxpt.training.batch_ramp`) times
      ``seq_len``, where ``start`` is the last stage's ``start_step`` (0 for a base run: a stage's own tokens only).
    - device_seconds: ``final.train_time_s`` (the run's training time, carried across resumes: its compiles,
      checkpoint saves and in-loop and final evaluations included, process start-up not) times ``devices.count``
      (every device of the run).
    - wall_s: the sum of every session's ``goodput.wall_s`` (start-up, compiles, steps, checkpoints, evaluation,
      steps redone after a resume), else ``ended_at - started_at``; None when neither is recorded.
    """
    final, stages = rec.get("final") or {}, rec.get("stages") or [{}]
    start = int(stages[-1].get("start_step", 0))
    ramp = batch_ramp.from_config(cfg)
    tokens = (ramp.rows_through(int(final["step"])) - ramp.rows_through(start)) * cfg.seq_len
    fpt = flops_lib.flops_per_token(cfg.model, cfg.seq_len)
    train_s, count = final.get("train_time_s"), (rec.get("devices") or {}).get("count")
    device_s = float(train_s) * int(count) if train_s is not None and count else None
    walls = [s["goodput"]["wall_s"] for s in rec.get("sessions", []) if "wall_s" in (s.get("goodput") or {})]
    wall = float(sum(walls)) if walls else None
    if wall is None and rec.get("started_at") and rec.get("ended_at"):
        wall = (dt.datetime.fromisoformat(rec["ended_at"])
                - dt.datetime.fromisoformat(rec["started_at"])).total_seconds()
    return RunCompute(fpt, tokens, fpt * tokens, device_s, wall)


def final_metrics(rec: Mapping[str, Any]) -> dict[str, float]:
    """Every numeric entry of ``run.json``'s ``final`` (``step``, ``heldout_loss``, ``train_time_s``, ...; booleans
    and text left out). A non-finite value (a diverged run's NaN loss) cannot be stored: it is left out with a
    warning on stderr naming it."""
    out = {}
    for k, v in (rec.get("final") or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if math.isfinite(v):
                out[k] = float(v)
            else:
                print(f"warning: run {rec.get('run_id')}: final.{k} = {v} is not finite; not stored", file=sys.stderr)
    return out


def add_corpus_version(db: ConclusionsDB, corpus_dir: str) -> str:
    """Record the corpus version at ``corpus_dir`` (:mod:`jaxpt.data.corpus`) under the id a run on it records
    (:func:`jaxpt.data.stream.data_version`: its manifest's ``data_version``), with its manifest as details; an id
    already recorded is kept. Returns the id.

    Raises:
      FileNotFoundError, ConfigError: not a corpus version directory (as :func:`jaxpt.data.corpus.read_corpus_version`).
    """
    version = corpus_lib.read_corpus_version(corpus_dir)
    ident = stream.data_version(config_lib.TrainConfig(data=config_lib.DataConfig(source="corpus",
                                                                                  corpus_dir=corpus_dir)))
    return db.add_data_version(ident, fs.absolute(corpus_dir), version.manifest, if_absent=True)


def record_data_version(db: ConclusionsDB, cfg, data_version: str | None = None) -> str:
    """Record the data version of a run of ``cfg`` (a :class:`jaxpt.config.TrainConfig`; kept when already
    recorded): ``data_version`` (default :func:`jaxpt.data.stream.data_version`, what ``run.json`` records) with the
    corpus directory and its manifest, or the training documents' path. Returns the id.

    Raises:
      ConclusionsError: details the database cannot hold (named), so a program can call this before it trains.
    """
    d = cfg.data
    data_version = data_version or stream.data_version(cfg)
    if d.source == "corpus":
        try:
            details = {"source": "corpus", "manifest": corpus_lib.read_corpus_version(d.corpus_dir).manifest}
        except (OSError, ValueError) as e:  # moved or deleted since the run: the id still names the data
            details = {"source": "corpus", "note": f"corpus not readable at import: {e}"}
        return db.add_data_version(data_version, d.corpus_dir, details, if_absent=True)
    return db.add_data_version(data_version, d.train_path, {"source": d.source}, if_absent=True)


def _eval_card_id(db: ConclusionsDB, eval_card: str | None) -> str | None:
    """``eval_card`` as a recorded eval card id: an id already in the database, or a card file
    (:func:`jaxpt.eval.card.load_card`, its hash checked) recorded by name, version and hash."""
    if eval_card is None:
        return None
    with contextlib.suppress(ConclusionsError):
        if db.resolve(eval_card)[0] == "eval_card":
            return eval_card
    card = card_lib.load_card(eval_card, check_files=False)
    return db.add_eval_card(card.name, card.version, card.content_sha256)


def import_run(db: ConclusionsDB, workdir: str, experiment_id: str | None = None, role: str = "manual",
               eval_card: str | None = None) -> dict[str, Any]:
    """Add the finished run in ``workdir`` (its ``run.json``, read by :func:`jaxpt.lab.registry.load_run`, and its
    operative ``config.gin``) to ``db`` under the registry's ``run_id``, with its data version, compute
    (:func:`run_compute`), mixture (the last session's recorded schedule), final metrics (:func:`final_metrics`) and,
    when given, ``eval_card`` (a recorded eval card id or a card file). Idempotent: importing the same run again is a
    no-op, and one interrupted part-way (each step is its own transaction) is finished by importing it again.
    Returns the run's row as :meth:`ConclusionsDB.resolve` gives it (``id``, ..., ``metrics``).

    Raises:
      FileNotFoundError: no run.json there. ConfigError: its config.gin cannot be read (or its tokenizer, when the
        vocabulary follows it). CardError: an unreadable card file.
      ConclusionsError: the run has not completed (no final metrics), it is recorded with other content, or the
        experiment is unknown.
    """
    rec = runs_lib.load_run(workdir)
    if rec.get("status") != "completed" or not (rec.get("final") or {}).get("step"):
        raise ConclusionsError(f"run {rec.get('run_id')} in {rec['workdir']}: status {rec.get('status')!r}, no final "
                               "metrics; import it when it has completed")
    if experiment_id is not None:
        db.experiment(experiment_id)  # raises for an unknown one before anything is written
    _role(role, f"run {rec.get('run_id')} role")
    try:
        cfg = resolve_vocab(config_lib.parse([fs.join(rec["workdir"], "config.gin")]))
    except ConfigError as e:
        raise ConfigError(f"{e} (reading {fs.join(rec['workdir'], 'config.gin')}: its relative paths are relative to "
                          "the folder the run was started in; import it from there)") from None
    compute = run_compute(rec, cfg)
    data_version = record_data_version(db, cfg, rec["data_version"])
    mixtures = [s["mixture"] for s in rec.get("sessions", []) if s.get("mixture") is not None]
    db.add_run(rec["run_id"], data_version=data_version, role=role, experiment_id=experiment_id,
               workdir=rec["workdir"], config_hash=rec.get("config_hash"), eval_card=_eval_card_id(db, eval_card),
               mixture=mixtures[-1] if mixtures else None, flops=compute.flops,
               device_seconds=compute.device_seconds, wall_s=compute.wall_s, tokens=compute.tokens,
               created_at=rec.get("started_at"))
    db.add_metrics(rec["run_id"], final_metrics(rec))
    return db.resolve(rec["run_id"])[1]


# ---------------------------------------------------------------------------------------- what the program prints

LISTS = ("experiments", "runs", "conclusions", "data-versions", "eval-cards")


def _cell(v: Any) -> Any:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v


def cmd_list(db: ConclusionsDB, what: str, experiment: str | None = None, status: str | None = None,
             role: str | None = None) -> str:
    """The table ``list WHAT`` prints. Raises ConclusionsError for a filter that does not apply to ``what``."""
    given = {"--experiment": experiment, "--status": status, "--role": role}
    applies = {"experiments": {"--status"}, "runs": {"--experiment", "--role"},
               "conclusions": {"--experiment", "--status"}}.get(what, set())
    wrong = [f for f, v in given.items() if v is not None and f not in applies]
    if wrong:
        raise ConclusionsError(f"list {what}: {', '.join(wrong)} does not apply (filters: "
                               f"{', '.join(sorted(applies)) or 'none'})")
    if what == "experiments":
        counts: dict[str, int] = {}
        for r in db.runs():
            counts[r["experiment_id"]] = counts.get(r["experiment_id"], 0) + 1
        rows = [[e["id"], e["kind"], e["status"], e["data_version"], counts.get(e["id"], 0), e["created_at"]]
                for e in db.experiments(status)]
        return runs_lib.table(rows, ["id", "kind", "status", "data_version", "runs", "created_at"])
    if what == "runs":
        rows = [[r["id"], r["experiment_id"], r["role"], r["data_version"], r["tokens"], r["flops"],
                 r["device_seconds"], r["wall_s"], r["metrics"].get("heldout_loss"), r["created_at"]]
                for r in db.runs(experiment, role)]
        return runs_lib.table(rows, ["id", "experiment", "role", "data_version", "tokens", "flops",
                                     "device_seconds", "wall_s", "heldout_loss", "created_at"])
    if what == "conclusions":
        rows = [[c["id"], c["status"], c["superseded_by"], c["experiment_id"], c["author"], c["created_at"],
                 ",".join(c["evidence"]), c["statement"]] for c in db.conclusions(status, experiment)]
        return runs_lib.table(rows, ["id", "status", "superseded_by", "experiment", "author", "created_at",
                                     "evidence", "statement"])
    if what == "data-versions":
        return runs_lib.table([[d["id"], d["path"], d["runs"]] for d in db.data_versions()], ["id", "path", "runs"])
    return runs_lib.table([[c["id"], c["name"], c["version"], c["content_sha256"]] for c in db.eval_cards()],
                          ["id", "name", "version", "content_sha256"])


def cmd_show(db: ConclusionsDB, ref_id: str) -> str:
    """What ``show ID`` prints: the id's kind and row, then a run's metrics, a conclusion's evidence (each id with its
    kind), the runs of an experiment, data version or eval card, and the conclusions that cite the id."""
    kind, row = db.resolve(ref_id)
    extra = {k: row.pop(k) for k in ("metrics", "evidence") if k in row}
    out = [f"{_name(kind)} {ref_id}"] + [f"  {k}: {_cell(v)}" for k, v in row.items() if k != "id"]
    if "metrics" in extra:
        out += ["", "metrics:", runs_lib.table([[k, v] for k, v in extra["metrics"].items()], ["name", "value"])]
    if "evidence" in extra:
        out += ["", "evidence:", runs_lib.table([[r, _name(db.resolve(r)[0])] for r in extra["evidence"]],
                                                ["id", "kind"])]
    link = {"experiment": "experiment_id", "data_version": "data_version", "eval_card": "eval_card"}.get(kind)
    if link:
        linked = [r for r in db.runs() if r[link] == ref_id]
        out += ["", "runs:", runs_lib.table([[r["id"], r["role"], r["experiment_id"], r["metrics"].get("heldout_loss")]
                                             for r in linked], ["id", "role", "experiment", "heldout_loss"])]
    cited = db.conclusions(experiment_id=ref_id) if kind == "experiment" else []
    cited += [c for c in db.citing(ref_id) if c["id"] not in {x["id"] for x in cited}]
    if cited:
        out += ["", "conclusions:", runs_lib.table([[c["id"], c["status"], c["statement"]] for c in cited],
                                                   ["id", "status", "statement"])]
    return "\n".join(out)


def cmd_compare(db: ConclusionsDB, run_ids: Sequence[str], metric_names: Sequence[str] | None = None) -> str:
    """What ``compare`` prints: one column per run, one row per field and metric (``-`` where a run lacks one)."""
    rows = db.compare(run_ids, metric_names)
    fields = ["role", "experiment_id", "data_version", "eval_card", "tokens", "flops", "device_seconds", "wall_s"]
    names = list(metric_names) if metric_names else sorted({m for r in rows for m in r["metrics"]})
    table = [[f, *(r[f] for r in rows)] for f in fields]
    table += [[f"metric.{m}", *(r["metrics"].get(m) for r in rows)] for m in names]
    return runs_lib.table(table, ["field", *run_ids])
