"""The persistent compilation cache: a restarted trainer loads its compiled programs instead of recompiling them.

``TrainConfig.compilation_cache_dir`` picks the directory (:func:`resolve_cache_dir`); ``'auto'`` (the default) is
JAX's own setting when one is made (``JAX_COMPILATION_CACHE_DIR``, ``jax.config``), else ``<workdir>/jax_cache``.
The workdir is the default because a restart after a failure always comes back to it, and because it is the one
directory every host of a multi-host run shares: JAX writes cache entries from process 0 only (no write contention
on GCS or NFS) and every process reads them, keyed by the program, the devices' topology and the compile options,
so a changed program or mesh never loads a stale executable. (A per-user ``~/.cache`` directory would be local to
each host, and only host 0 would ever fill its own.)

:func:`persistent_cache` turns the cache on for a block (the trainer's whole run) and restores the process's
previous setting after it, so two runs in one process (tests, notebooks) never share a cache directory unasked.

Security: a cache directory is trusted code (JAX's own warning). A local cache directory, and the workdir that holds
the default one, must belong to the user running and be writable by nobody else
(:func:`jaxpt.util.fs.check_private_dir`, checked before anything is written: a program planted in a directory another
user made would otherwise run as this user's); the trainer creates a missing one readable by its owner alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from jaxpt.util import fs

log = logging.getLogger("jaxpt.run.compile_cache")

#: The subdirectory of the workdir that ``'auto'`` picks when JAX has no cache directory set.
WORKDIR_SUBDIR = "jax_cache"
#: Settings of ``TrainConfig.compilation_cache_dir`` that turn the cache off.
OFF = ("", "off", "none")

_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"


def resolve_cache_dir(setting: str, workdir: str) -> str | None:
    """The cache directory for ``TrainConfig.compilation_cache_dir = setting``, or None for "off".

    ``'auto'``: JAX's ``jax_compilation_cache_dir`` when set (e.g. by ``JAX_COMPILATION_CACHE_DIR``), else
    ``<workdir>/jax_cache``. ``''``, ``'off'``, ``'none'``: None. Anything else is a path (``~`` expanded; a URL
    such as ``gs://bucket/cache`` is passed to JAX as is).
    """
    if setting.strip().lower() in OFF:
        return None
    if setting == "auto":
        return jax.config.jax_compilation_cache_dir or os.path.join(workdir, WORKDIR_SUBDIR)
    return setting if "://" in setting else os.path.expanduser(setting)


def setting_name(setting: str) -> str:
    """Where the cache directory of ``TrainConfig.compilation_cache_dir = setting`` comes from, as errors name it."""
    if setting == "auto" and jax.config.jax_compilation_cache_dir:
        return "jax_compilation_cache_dir (JAX_COMPILATION_CACHE_DIR)"
    return "TrainConfig.compilation_cache_dir"


@dataclasses.dataclass
class CacheStats:
    """Counts of the compilations that consulted the persistent cache while :func:`persistent_cache` was open.

    Attributes:
      directory: the cache directory.
      requests: compilations that looked the cache up.
      hits: of those, programs loaded from the cache (not compiled).
    """

    directory: str
    requests: int = 0
    hits: int = 0

    @property
    def misses(self) -> int:
        """Programs compiled (and written to the cache when they took at least
        ``jax_persistent_cache_min_compile_time_secs``, 1 s by default, and this is process 0)."""
        return self.requests - self.hits

    def summary(self) -> str:
        return (f"compilation cache {self.directory}: {self.hits} of {self.requests} programs loaded from the cache, "
                f"{self.misses} compiled")


@contextlib.contextmanager
def persistent_cache(directory: str | None) -> Iterator[CacheStats | None]:
    """Within this block, JAX reads and writes compiled programs in ``directory``, or in no cache at all when None
    (whatever ``JAX_COMPILATION_CACHE_DIR`` says); yields the block's :class:`CacheStats` (None when off) and logs
    its summary at the end.

    Must be entered before the programs it should cover are compiled: a program already compiled in this process
    is reused from memory and never looks the cache up. On exit the previous ``jax_compilation_cache_dir`` is set
    again and JAX's cache object reset, so a later block (or none) starts clean.
    """
    previous = jax.config.jax_compilation_cache_dir
    if directory is None:  # off, even where JAX_COMPILATION_CACHE_DIR would turn it on
        jax.config.update("jax_compilation_cache_dir", None)
        jax_cache.reset_cache()
        try:
            yield None
        finally:
            jax.config.update("jax_compilation_cache_dir", previous)
            jax_cache.reset_cache()
        return
    fs.check_private_dir(directory, "the compilation cache directory", create=True)
    stats = CacheStats(directory)

    def count(event: str, **_) -> None:
        if event == _REQUESTS:
            stats.requests += 1
        elif event == _HITS:
            stats.hits += 1

    jax.config.update("jax_compilation_cache_dir", directory)
    jax_cache.reset_cache()  # a cache object made earlier in this process would keep the old directory
    jax.monitoring.register_event_listener(count)
    try:
        yield stats
    finally:
        jax.monitoring.unregister_event_listener(count)
        jax.config.update("jax_compilation_cache_dir", previous)
        jax_cache.reset_cache()
        log.info("%s", stats.summary())
