"""The error classes every jaxpt entry point maps to an exit status.

``ConfigError`` (exit 2) is the one base for "this input cannot run": a bad config key, a missing file, a
malformed data file. Its message names the config key, or the file and line. ``data_pipelines`` derives its
own errors from it, so one ``except ConfigError`` covers every entry point.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config or input that cannot run. The message names the config key (or file and line)."""
