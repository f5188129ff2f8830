"""The corpus build's writes, through Apache Beam's own filesystems (``apache_beam.io.filesystems.FileSystems``).

Every file the build writes (shards, held-out split, decision log, review samples, ``_stats``, ``mixture.json``,
``manifest.json``) goes through :func:`write_bytes`, so on Dataflow a worker writes to ``gs://`` with Beam's
GCS client (``google-cloud-storage``, in ``apache-beam[gcp]``) and needs no other filesystem library; a local
output directory goes through Beam's local filesystem. Reads of the finished version (finalize, tests, the
trainer) still use :mod:`jaxpt.util.fs`.

How each kind of path is written:

* Object storage: one ``FileSystems.create`` of the final name. An object upload becomes visible only once
  complete (atomic), so no temporary name is needed; and Beam's GCS ``rename``/``delete`` use the JSON *batch*
  API (``/batch/storage/v1``), which the fake-gcs-server emulator of the tests does not implement.
* Local: the bytes go to ``<path>.<random>.tmp`` and ``FileSystems.rename`` moves them into place (a reader never sees
  half a file; ``os.rename`` replaces an existing file on POSIX).

Bytes are written as given (``CompressionTypes.UNCOMPRESSED``): Beam would otherwise gzip a ``.gz`` name a
second time.
"""

from __future__ import annotations

import os
import uuid
import shutil
import tempfile

from jaxpt.util import fs

_CHUNK = 1 << 20


def _filesystems():
    from apache_beam.io.filesystems import FileSystems  # the data extra; imported where used
    return FileSystems


def _create(path: str):
    from apache_beam.io.filesystem import CompressionTypes
    return _filesystems().create(path, mime_type="application/octet-stream",
                                 compression_type=CompressionTypes.UNCOMPRESSED)


def check_credentials(out_dir: str) -> None:
    """Before a build writes ``gs://`` through Beam: Beam's GCS client finds the application-default credentials
    only with ``google-auth-httplib2`` (part of ``apache-beam[gcp]``, which Dataflow installs); without it Beam
    connects anonymously, and a real bucket refuses every write after the whole pipeline ran. An emulator
    (``STORAGE_EMULATOR_HOST``) takes anonymous writes, so the check passes there.

    Raises:
      ConfigError: ``out_dir`` is ``gs://``, no emulator is set, and Beam cannot use credentials.
    """
    if not os.fspath(out_dir).startswith("gs://") or os.environ.get("STORAGE_EMULATOR_HOST"):
        return
    from apache_beam.internal.gcp import auth
    if not getattr(auth, "_GOOGLE_AUTH_AVAILABLE", True):
        from jaxpt.util.errors import ConfigError
        raise ConfigError(f"--output {out_dir}: Beam's GCS client cannot use credentials here (google-auth-httplib2 "
                          "is missing) and would write anonymously; install apache-beam[gcp] (pip install 'jaxpt[gcp]')")


def _write(path: str, fill) -> None:
    """``fill(f)`` writes the content into ``f``, a Beam writer of ``path`` (object storage: the final name;
    local: a temporary file of a random, unpredictable name beside it, then renamed into place, so two writers of
    one path never share a temporary file and none follows a link planted at a predictable name; parents
    created)."""
    if fs.is_remote(path):
        with _create(path) as f:
            fill(f)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with _create(tmp) as f:
        fill(f)
    _filesystems().rename([tmp], [path])


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` (local or ``gs://``) through Beam's filesystems; parents are created locally.

    Raises:
      OSError / apache_beam.io.filesystem.BeamIOError: the filesystem refused the write.
    """
    _write(path, lambda f: f.write(data))


def write_text(path: str, text: str) -> None:
    """:func:`write_bytes` of ``text`` encoded as UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def upload_file(local: str, path: str) -> None:
    """Copy the local file ``local`` to ``path`` (local or ``gs://``) through Beam's filesystems, in 1 MiB
    chunks (the whole file is never in memory); same atomicity as :func:`write_bytes`."""
    with open(local, "rb") as fi:
        _write(path, lambda fo: shutil.copyfileobj(fi, fo, _CHUNK))


def local_scratch_dir() -> tempfile.TemporaryDirectory:
    """A temporary local directory for a file a library can only write locally (ArrayRecord's C++ writer)
    before :func:`upload_file` sends it to its place."""
    return tempfile.TemporaryDirectory(prefix="jaxpt-shard-")


def match(pattern: str) -> list[str]:
    """Paths matching the glob ``pattern`` (``FileSystems.match``: the filesystem's own listing), sorted;
    none is ``[]``."""
    result = _filesystems().match([pattern])[0]
    return sorted(m.path for m in result.metadata_list)
