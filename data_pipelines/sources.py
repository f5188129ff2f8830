"""The source registry's entries (`Source`), before any step runs."""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import Any

from jaxpt.util import fs
from jaxpt.util.errors import ConfigError


FORMATS = ("jsonl", "parquet", "warc", "tfds")


@dataclasses.dataclass(frozen=True)
class Source:
    """One entry of the source registry.

    Attributes:
      name: unique short name; recorded on every document.
      domain: mixture domain (``web``, ``code``, ...).
      path: file path or glob (relative paths resolve against `BuildConfig.source_root`); for
        ``tfds`` the dataset name (``c4/en:3.1.0``).
      format: one of ``jsonl`` (.jsonl, .jsonl.gz, .jsonl.zst), ``parquet``, ``warc``, ``tfds``.
      license: license identifier (required).
      acquired: acquisition date, ISO ``YYYY-MM-DD`` (required).
      languages: allowed ISO 639-1 codes after language ID; None admits any (language ID skipped).
      text_field / id_field: record fields holding the text and the id (id defaults to
        ``<name>/<file>:<line>``).
      extract_html: run main-text extraction on the text field (always on for WARC).
      split / data_dir: TFDS split and data directory (``tfds`` only).
    """

    name: str
    domain: str
    path: str
    format: str
    license: str
    acquired: str
    languages: tuple[str, ...] | None = None
    text_field: str = "text"
    id_field: str | None = "id"
    extract_html: bool = False
    split: str = "train"
    data_dir: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], index: int) -> "Source":
        key = f"BuildConfig.sources[{index}]"
        if not isinstance(d, dict):
            raise ConfigError(f"{key}: expected a dict, got {type(d).__name__}")
        for req in ("name", "domain", "path", "format"):
            if not d.get(req):
                raise ConfigError(f"{key}: missing required field '{req}'")
        name = d["name"]
        for req in ("license", "acquired"):
            if not d.get(req):
                raise ConfigError(
                    f"{key} (source '{name}'): missing '{req}'; every source needs a license and an "
                    "acquisition date before it is admitted"
                )
        try:
            datetime.date.fromisoformat(str(d["acquired"]))
        except ValueError as e:
            raise ConfigError(f"{key} (source '{name}'): 'acquired' must be YYYY-MM-DD: {e}") from None
        if d["format"] not in FORMATS:
            raise ConfigError(f"{key} (source '{name}'): format '{d['format']}' not in {FORMATS}")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"{key} (source '{name}'): unknown fields {sorted(unknown)}")
        d = dict(d)
        if d.get("languages") is not None:
            d["languages"] = tuple(d["languages"])
        d["acquired"] = str(d["acquired"])
        return cls(**d)

    def files(self, root: str) -> list[str]:
        """Sorted input files of this source (not for ``tfds``). Raises ConfigError if none match."""
        pattern = self.path if os.path.isabs(self.path) or fs.is_remote(self.path) else fs.join(root, self.path)
        found = fs.glob_pattern(pattern)  # local or object storage (gs://)
        if not found:
            raise ConfigError(f"source '{self.name}': path '{pattern}' matches no file")
        return found
