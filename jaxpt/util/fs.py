"""The one filesystem layer: the paths jaxpt and ``data_pipelines`` read or write, local or object storage
(the few that stay local, and why: README, "Object storage").

Paths are plain strings everywhere (configs, records, logs); this module turns them into
``etils.epath.Path`` (the layer Orbax and Grain use) only where a file is touched. A path with a URI scheme
(``gs://bucket/x``, also ``s3://``) is *remote*; anything else is a local path.

What object storage changes, and how each function handles it:

* There are no directories: ``makedirs`` of a bucket prefix is a no-op there; ``isdir`` is true once an
  object exists under the prefix.
* An object is written whole and cannot be appended to: :func:`append_text` re-writes the object with the
  new text at its end (one small object per log, so O(size) per append is fine); a write replaces an object
  atomically, so :func:`write_text_atomic` needs no temporary file there.
* Libraries that only read local files (ArrayRecord's C++ reader, SentencePiece) get a local copy through
  :func:`local_copy`, cached under ``$JAXPT_CACHE_DIR`` (default ``~/.cache/jaxpt``, private to the user) by the
  object's URI.
* ``os.path.abspath`` would turn ``gs://b/x`` into ``<cwd>/gs:/b/x``: use :func:`absolute`.

Emulators: with ``STORAGE_EMULATOR_HOST=http://host:port`` set (the variable the Google Cloud clients,
gcsfs and TensorBoard's GCS writer honour), importing this module also points TensorStore (Orbax's array
storage) at it (``TENSORSTORE_GCS_HTTP_URL``), selects epath's fsspec/gcsfs backend (``EPATH_USE_TF=false``:
``tf.io.gfile`` has no emulator endpoint) and turns off gcsfs's bucket-layout probe (an API emulators lack).
Each is only a default: a variable already set wins.
"""

from __future__ import annotations

import builtins
import contextlib
import glob as _glob
import gzip
import hashlib
import json
import os
import re
import shutil
import stat as stat_lib
import tempfile
from typing import IO, Iterator

from etils import epath

from jaxpt.util.errors import ConfigError

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")



def _emulator_settings() -> None:
    """With ``STORAGE_EMULATOR_HOST`` set (now, not only at import: a notebook or test may set it later), point
    TensorStore at the emulator, make epath use its fsspec/gcsfs backend and turn off gcsfs's bucket-layout probe.
    epath decides "TensorFlow or fsspec" once per process and caches it (``gpath._is_tf_installed``); when that
    cached decision predates the setting, it is cleared so the next path is made with fsspec."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if not host:
        return
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host)
    os.environ.setdefault("EPATH_USE_TF", "false")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    from etils.epath import gpath
    cached = getattr(gpath, "_is_tf_installed", None)
    if os.environ["EPATH_USE_TF"].lower() in ("false", "0") and cached is not None and cached():
        cached.cache_clear()


_emulator_settings()


def _open_text(p: str):
    return open(p, "r")


def register_gin_reader() -> None:
    """Let gin read config files from object storage: ``--config gs://b/x.gin`` and, inside any gin file,
    ``include 'gs://b/base.gin'`` (gin tries its registered file readers in turn; this one takes the paths with a
    URI scheme). A relative ``include`` is resolved as gin always does (against the working directory and gin's
    search paths), not against the including file's bucket. Idempotent (gin keeps one entry per reader)."""
    import gin
    gin.config.register_file_reader(_open_text, is_remote)


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` names object storage (has a URI scheme such as ``gs://``)."""
    return bool(_SCHEME.match(os.fspath(path)))


def path(p: str | os.PathLike) -> epath.Path:
    """``p`` as an ``epath.Path`` (local or remote)."""
    if is_remote(p):
        _emulator_settings()
    return epath.Path(p)


def join(base: str | os.PathLike, *parts: str) -> str:
    """``base/part/...`` as a string; keeps ``gs://`` intact (``os.path.join`` would too on POSIX, but this
    says what is meant and never normalizes the scheme's double slash away)."""
    out = os.fspath(base)
    for p in parts:
        out = p if is_remote(p) or os.path.isabs(p) else (out.rstrip("/") + "/" + p if out else p)
    return out


def absolute(p: str | os.PathLike) -> str:
    """``os.path.abspath`` for local paths; a remote path is returned unchanged."""
    return os.fspath(p) if is_remote(p) else os.path.abspath(p)


def realpath(p: str | os.PathLike) -> str:
    """``os.path.realpath`` (symlinks resolved) for local paths; a remote path is returned unchanged."""
    return os.fspath(p) if is_remote(p) else os.path.realpath(p)


def basename(p: str | os.PathLike) -> str:
    """The last component of ``p`` (trailing slashes ignored)."""
    return os.fspath(p).rstrip("/").rsplit("/", 1)[-1]


def dirname(p: str | os.PathLike) -> str:
    """``p`` without its last component; keeps the scheme (``gs://b/x`` -> ``gs://b``)."""
    s = os.fspath(p).rstrip("/")
    if is_remote(s):
        head = s.rsplit("/", 1)[0]
        return head if "://" in head and not head.endswith(":/") else s
    return os.path.dirname(s)


def exists(p: str | os.PathLike) -> bool:
    return path(p).exists()


def isfile(p: str | os.PathLike) -> bool:
    """A file (an object, remotely) exists at ``p``."""
    q = path(p)
    return q.is_file() if is_remote(p) else os.path.isfile(p)


def isdir(p: str | os.PathLike) -> bool:
    """A directory exists at ``p`` (remotely: some object exists under the prefix ``p/``)."""
    return path(p).is_dir() if is_remote(p) else os.path.isdir(p)


def makedirs(p: str | os.PathLike) -> None:
    """Create directory ``p`` and its parents if missing (a no-op on object storage, which has none)."""
    if is_remote(p):
        return
    os.makedirs(p, exist_ok=True)


def listdir(p: str | os.PathLike) -> list[str]:
    """Names (not paths) of the entries of directory ``p``, sorted.

    Raises:
      FileNotFoundError: ``p`` is not a directory.
    """
    if not is_remote(p):
        return sorted(os.listdir(p))
    if not isdir(p):
        raise FileNotFoundError(f"{p}: no such directory")
    return sorted(c.name for c in path(p).iterdir())


def glob_pattern(pattern: str) -> list[str]:
    """Paths (sorted) matching a whole glob ``pattern``, e.g. ``gs://b/raw/web/*.jsonl.gz`` or ``/data/*/x.gz``:
    :func:`glob.glob` for a local pattern; for a remote one, the part before the first wildcard component is the
    directory searched with :func:`glob`."""
    if not is_remote(pattern):
        return sorted(_glob.glob(pattern))
    parts = pattern.rstrip("/").split("/")
    first = next((i for i, part in enumerate(parts) if any(c in part for c in "*?[")), None)
    if first is None:
        return [pattern] if isfile(pattern) else []
    return glob("/".join(parts[:first]), "/".join(parts[first:]))


def glob(p: str | os.PathLike, pattern: str) -> list[str]:
    """Paths (strings, sorted) of the entries of directory ``p`` matching the glob ``pattern``."""
    if not is_remote(p) and not os.path.isdir(p):
        return []
    return sorted(os.fspath(c) for c in path(p).glob(pattern))


def open(p: str | os.PathLike, mode: str = "r", **kwargs) -> IO:  # noqa: A001 - the layer's open
    """Open ``p`` (``r``/``w``/``a``, text or ``b``). Remote ``a`` is not supported by object storage: use
    :func:`append_text`."""
    if not is_remote(p):
        return builtins.open(p, mode, **kwargs)
    if "a" in mode:
        raise ValueError(f"{p}: object storage cannot append; use jaxpt.util.fs.append_text")
    if kwargs.get("encoding") not in (None, "utf-8", "utf8"):
        raise ValueError(f"{p}: only utf-8 text on object storage")
    return path(p).open(mode)


def open_maybe_gzip(p: str | os.PathLike, mode: str = "rb") -> IO:
    """Binary ``open``, gunzipping when ``p`` ends in ``.gz`` (reads) or compressing (writes)."""
    f = open(p, mode.replace("t", "").rstrip("b") + "b")
    return gzip.GzipFile(fileobj=f, mode=mode.rstrip("b") + "b") if os.fspath(p).endswith(".gz") else f


def read_text(p: str | os.PathLike) -> str:
    return path(p).read_text()


def read_json(p: str | os.PathLike, what: str = "a JSON file") -> object:
    """The JSON value in the file at ``p`` (local or remote).

    Raises:
      ConfigError: the file is not valid JSON, naming ``p``, ``what`` it should be and where the parse failed; ``p``
        is a directory (a file was expected: naming ``p`` and ``what``).
      FileNotFoundError, OSError: the file cannot be read.
    """
    try:
        return json.loads(read_text(p))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid JSON ({what}): {e}") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: a directory where a file was expected ({what})") from None


def read_bytes(p: str | os.PathLike) -> bytes:
    return path(p).read_bytes()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: The mode a plain ``open(path, "w")`` gives a new file under this process's umask (read once, at import).
_FILE_MODE = 0o666 & ~_umask()


def replace_local(p: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to the local file ``p`` so that a reader never sees half of it and concurrent writers never
    collide: a temporary file with a unique random name in ``p``'s folder (``tempfile.mkstemp``, created exclusively,
    so it never follows a link planted at a predictable name), given the usual file mode, then ``os.replace`` onto
    ``p`` (atomic on POSIX: the last writer wins whole).

    Raises:
      OSError: the folder cannot be written (the temporary file is removed).
    """
    p = os.fspath(p)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(p)), prefix=f".{os.path.basename(p)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def regular_file_problem(p: str | os.PathLike, max_bytes: int) -> str | None:
    """Why ``p`` is not a file to read whole (``None`` when it is): not a regular file (a device such as
    ``/dev/zero``, a FIFO, a directory), or larger than ``max_bytes``. For paths taken from data or metadata."""
    if is_remote(p):
        size = path(p).stat().length
    else:
        st = os.stat(p)
        if not stat_lib.S_ISREG(st.st_mode):
            return "not a regular file"
        size = st.st_size
    return f"{size:,} bytes, over {max_bytes:,}" if size > max_bytes else None


def check_private_dir(p: str | os.PathLike, what: str, *, create: bool = False) -> None:
    """Refuse a local directory that another user could have put files in: owned by someone else, or writable by
    its group or by everyone (a compilation cache is code the process runs; a run directory holds what it resumes).
    With ``create``, a missing directory is made, readable and writable by its owner alone (mode 0700). Object storage
    (``gs://``) has no owner to check here: its bucket's permissions decide.

    Raises:
      ConfigError: naming ``what``, the path, its owner and mode, and what to do.
    """
    if is_remote(p):
        return
    p = os.fspath(p)
    if not os.path.exists(p):
        if create:
            os.makedirs(p, mode=0o700, exist_ok=True)
            os.chmod(p, 0o700)
        return
    st = os.stat(p)
    problems = []
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        problems.append(f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})")
    if st.st_mode & 0o022:
        problems.append(f"writable by {'its group' if st.st_mode & 0o020 else ''}"
                        f"{' and ' if st.st_mode & 0o020 and st.st_mode & 0o002 else ''}"
                        f"{'everyone' if st.st_mode & 0o002 else ''}")
    if problems:
        raise ConfigError(f"{what} = {p!r} is {' and '.join(problems)} (owner uid {st.st_uid}, mode "
                          f"{oct(st.st_mode & 0o777)}): another user could have put files there for this run to load; "
                          "use a directory of your own that only you can write (chmod go-w)")


def write_bytes_atomic(p: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``p`` so a reader never sees half of it: :func:`replace_local` locally; one object upload
    remotely (which replaces an object atomically)."""
    if is_remote(p):
        path(p).write_bytes(data)
        return
    replace_local(p, data)


def write_text_atomic(p: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``p`` so a reader never sees half of it (:func:`write_bytes_atomic`)."""
    write_bytes_atomic(p, text.encode("utf-8"))


def write_bytes(p: str | os.PathLike, data: bytes) -> None:
    path(p).write_bytes(data)


def write_figure(fig, p: str | os.PathLike, **savefig_kwargs) -> None:
    """Save the matplotlib figure ``fig`` to ``p`` (local or remote), the format from ``p``'s extension
    (``.png``, ``.svg``, ``.pdf``): rendered in memory, then one write (matplotlib's ``savefig`` opens local
    paths only)."""
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format=os.path.splitext(os.fspath(p))[1].lstrip(".") or "png", **savefig_kwargs)
    if is_remote(p):
        write_bytes(p, buf.getvalue())
        return
    replace_local(p, buf.getvalue())


def append_text(p: str | os.PathLike, text: str) -> None:
    """Append ``text`` (UTF-8) to the file ``p``, creating it if missing.

    Remotely the object is read and written back whole (objects are immutable), so each call costs the
    object's size: meant for logs of at most some MiB (``metrics.jsonl``, batch logs).
    """
    if not is_remote(p):
        with builtins.open(p, "a") as f:
            f.write(text)
        return
    q = path(p)
    old = q.read_text() if q.exists() else ""
    q.write_text(old + text)


class Appender:
    """A line-buffered append-only text writer for ``p``: a file opened for append locally; remotely, the
    object re-written on every :meth:`write` (see :func:`append_text`) with everything written so far."""

    def __init__(self, p: str | os.PathLike):
        self.path = os.fspath(p)
        self._local = None if is_remote(p) else builtins.open(self.path, "a", buffering=1)
        if self._local is None:
            q = path(p)
            self._text = q.read_text() if q.exists() else ""

    def write(self, text: str) -> None:
        if self._local is not None:
            self._local.write(text)
            return
        self._text += text
        path(self.path).write_text(self._text)

    def flush(self) -> None:
        if self._local is not None:
            self._local.flush()

    def close(self) -> None:
        if self._local is not None:
            self._local.close()


def remove(p: str | os.PathLike) -> None:
    """Delete the file ``p`` (missing is fine)."""
    q = path(p)
    if q.exists():
        q.unlink()


def rmtree(p: str | os.PathLike) -> None:
    """Delete the directory ``p`` and everything under it (missing is fine)."""
    if is_remote(p):
        q = path(p)
        if q.exists():
            q.rmtree()
    else:
        shutil.rmtree(p, ignore_errors=True)


def copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy the file ``src`` to ``dst`` (either may be remote), overwriting ``dst``."""
    if not is_remote(src) and not is_remote(dst):
        shutil.copyfile(src, dst)
        return
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo, 1 << 20)


def copytree(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy the directory ``src`` to ``dst`` recursively (either may be remote)."""
    for root, _, files in walk(src):
        rel = os.fspath(root)[len(os.fspath(src)):].lstrip("/")
        target = join(dst, rel) if rel else os.fspath(dst)
        makedirs(target)
        for name in files:
            copy(join(root, name), join(target, name))


def walk(p: str | os.PathLike) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk`` for either kind of path: (directory, subdirectory names, file names), top-down."""
    if not is_remote(p):
        yield from os.walk(p)
        return
    scheme = os.fspath(p).split("://", 1)[0] + "://"
    for root, dirs, files in path(p).walk():
        root = os.fspath(root)
        # the fsspec backend yields bucket paths without their scheme ("bkt/x"); tf.io.gfile keeps it
        yield (root if is_remote(root) else scheme + root.lstrip("/")), list(dirs), list(files)


def cache_dir() -> str:
    """Where :func:`local_copy` and :func:`local_tree` keep downloaded objects: ``$JAXPT_CACHE_DIR``, else the user's
    own cache folder (``$XDG_CACHE_HOME/jaxpt``, default ``~/.cache/jaxpt``), created readable by its owner alone and
    refused when another user owns it or can write it (:func:`check_private_dir`): a download cache shared under a
    predictable temporary name let another user plant the files a conversion then read as the bucket's.

    Raises:
      ConfigError: the folder is not private to this user.
    """
    d = os.environ.get("JAXPT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "jaxpt")
    check_private_dir(d, "the download cache (JAXPT_CACHE_DIR)", create=True)
    return d


def contained(root: str, rel: str) -> str:
    """``rel`` (a name from a listing, an archive or a data file) as a relative path that stays inside ``root``.

    Raises:
      ConfigError: ``rel`` is absolute, empty, or climbs out of ``root`` (``..``).
    """
    norm = os.path.normpath(rel.replace("\\", "/")) if rel else ""
    if not rel or os.path.isabs(rel) or norm == ".." or norm.startswith("../") or norm.startswith("/"):
        raise ConfigError(f"{root}: the name {rel!r} would land outside the folder; refused")
    return norm


def _copy_verified(src: str, target: str, size: int) -> None:
    """Download ``src`` to ``target`` through a temporary file beside it, checking the byte count against the
    listing's ``size``.

    Raises:
      OSError: the download holds another number of bytes than the listing said (nothing is left behind).
    """
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "wb") as fo, open(src, "rb") as fi:
            shutil.copyfileobj(fi, fo, 1 << 20)
        got = os.path.getsize(tmp)
        if size is not None and got != size:
            raise OSError(f"{src}: downloaded {got} bytes, the listing says {size}")
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def local_copy(p: str | os.PathLike) -> str:
    """A local path with the contents of file ``p``: ``p`` itself when local; else a cached download.

    For readers that only open local files (ArrayRecord, SentencePiece). The cache key is the URI plus the
    object's size and modification time, so a re-written object is fetched again; the download goes to a
    temporary name first and its size is checked, so concurrent processes never read half a file; a cached copy is
    used only while its size still matches.
    """
    if not is_remote(p):
        return os.fspath(p)
    st = path(p).stat()
    key = hashlib.sha256(f"{os.fspath(p)}|{st.length}|{st.mtime}".encode()).hexdigest()[:24]
    out = os.path.join(cache_dir(), key, basename(p))
    if not (os.path.isfile(out) and os.path.getsize(out) == st.length):
        _copy_verified(os.fspath(p), out, st.length)
    return out


def tree_listing(root: str) -> list[tuple[str, int, float]]:
    """``(name relative to root, size in bytes, mtime)`` of every object under the remote directory ``root``."""
    files = []
    for d, _, names in walk(root):
        for name in names:
            full = join(d, name)
            st = path(full).stat()
            files.append((full[len(root):].lstrip("/"), st.length, st.mtime))
    return files


def local_tree(p: str | os.PathLike) -> str:
    """A local directory with the contents of directory ``p``: ``p`` itself when local; else a cached download
    of every file under it (as :func:`local_copy`, keyed by the URI and every file's size and mtime). Every name must
    stay inside the folder (:func:`contained`; checked before anything is written) and every download must have its
    listed size; a ``.complete`` marker listing the files and sizes is written last, and a cached tree is used only
    while every file still has its listed size (else it is fetched again).

    Raises:
      ConfigError: an object name would land outside the folder.
      OSError: a download's size differs from the listing's.
    """
    if not is_remote(p):
        return os.fspath(p)
    root = os.fspath(p).rstrip("/")
    files = [(contained(root, rel), size, mtime) for rel, size, mtime in tree_listing(root)]
    key = hashlib.sha256(repr((root, sorted(files))).encode()).hexdigest()[:24]
    out = os.path.join(cache_dir(), key, basename(root))
    marker = os.path.join(cache_dir(), key, ".complete")
    listed = json.dumps(sorted([rel, size] for rel, size, _ in files))
    intact = os.path.isfile(marker) and builtins.open(marker).read() == listed and all(
        os.path.isfile(os.path.join(out, rel)) and os.path.getsize(os.path.join(out, rel)) == size
        for rel, size, _ in files)
    if not intact:
        for rel, size, _ in files:
            _copy_verified(join(root, rel), os.path.join(out, rel), size)
        replace_local(marker, listed.encode())
    return out
