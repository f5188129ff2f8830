"""The error classes every jaxpt entry point maps to an exit status.

``ConfigError`` (exit 2) is the one base for "this input cannot run": a bad config key, a missing file, a
malformed data file. Its message names the config key, or the file and line. ``data_pipelines`` uses the same
class (``data_pipelines.config.ConfigError`` is this one), so one ``except ConfigError`` covers every entry point.

``CheckpointError`` (exit 3): checkpoints exist but cannot be used by this run (corrupt, of another model or
tokenizer, or saving a setting this version does not know that changes numerics).

``FileFormatError`` is the ``ConfigError`` of a data file that breaks its format's contract; each format derives
its own (``jaxpt.data.documents.DocumentFormatError``, ``jaxpt.run.monitor.MetricsFormatError``).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config or input that cannot run. The message names the config key (or file and line)."""


class CheckpointError(RuntimeError):
    """Checkpoints exist but cannot be used (corrupt, or from an incompatible model). Never ignored."""


class FileFormatError(ConfigError):
    """A file that breaks its format's contract, at one line.

    The message is ``"<path>:<line>: <reason>: <detail>"`` (``"<path>: <reason> after line <line>: <detail>"`` for
    ``truncated_file``, where ``line`` is the last complete line). ``reason`` is one of the names in
    :data:`jaxpt.util.jsonl.LINE_REASONS` or a format's own (``missing_text``, ...), the same names the corpus build
    counts its drops by.

    Attributes:
      path: the file (str); line: 1-based line number (int); reason: short name (str); detail: the rest (str).
    """

    def __init__(self, message: str, *, path: str = "", line: int = 0, reason: str = "", detail: str = ""):
        # A single positional message keeps the class rebuildable by frameworks that re-raise
        # ``type(e)(new_message)`` (Beam does, to add the step name).
        super().__init__(message)
        self.path, self.line, self.reason, self.detail = path, line, reason, detail

    @classmethod
    def at(cls, path, line: int, reason: str, detail: str) -> "FileFormatError":
        """The error for ``reason`` at ``line`` of ``path``, with the message above."""
        path = str(path)
        if reason == "truncated_file":
            message = f"{path}: {reason} after line {line}: {detail}"
        else:
            message = f"{path}:{line}: {reason}: {detail}"
        return cls(message, path=path, line=line, reason=reason, detail=detail)


def report_cli_error(message: str, as_json: bool) -> int:
    """Print an entry point's input error and return its exit status, 2.

    The message always goes to stderr as ``error: <message>``; with ``--json`` stdout also gets one JSON object
    ``{"error": <message>}``, so a script that parses stdout sees why there is no report instead of nothing.
    """
    import json
    import sys
    print(f"error: {message}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": message}))
    return 2
