"""One flag grammar for every program (``python -m jaxpt.train``, ``jaxpt.tools.*``, ``data_pipelines.*``, ...).

The rule: long options are kebab-case (``--dry-run``, ``--num-slices``; lower-case words joined by ``-``), one
name per meaning (``--output`` wherever a program names where it writes; two outputs are named by what they are),
and a flag that is renamed keeps its old spelling for one release as a *hidden deprecated alias*: it parses to the
same value, prints one line to stderr, and never shows in ``--help``::

    from jaxpt.util import cli
    cli.add_flag(parser, "--dry-run", "--dry_run", action="store_true", help="...")

    $ python -m jaxpt.train --dry_run ...
    note: --dry_run is deprecated; use --dry-run

gin bindings (``--gin 'TrainConfig.seed = 1'``) and gin files (``--config FILE``) are flags like any other; there
are no gin-style ``--a.b`` flags.
"""

from __future__ import annotations

import argparse
import re
import sys
import weakref

#: A long option in the grammar: ``--`` and lower-case words of letters and digits joined by single ``-``.
KEBAB = re.compile(r"--[a-z0-9]+(-[a-z0-9]+)*")


def is_kebab(option: str) -> bool:
    """Whether ``option`` (e.g. ``--dry-run``) is a long option in the grammar; ``--dry_run`` and ``--dryRun``
    are not."""
    return KEBAB.fullmatch(option) is not None


def deprecation_note(old: str, new: str) -> str:
    """The one line a deprecated spelling prints: ``note: OLD is deprecated; use NEW``."""
    return f"note: {old} is deprecated; use {new}"


def add_flag(parser, flag: str, *deprecated: str, **kwargs) -> argparse.Action:
    """Add long option ``flag`` to ``parser`` (an ArgumentParser or argument group) and each ``deprecated``
    spelling as a hidden alias of it.

    ``kwargs`` are :meth:`argparse.ArgumentParser.add_argument`'s (``action``, ``type``, ``default``, ``help``,
    ...). An alias shares the flag's ``dest``, ``nargs``, ``type``, ``choices`` and ``const``, so it parses to the
    same value; it is left out of ``--help`` and prints :func:`deprecation_note` to stderr (once per parse). A
    ``required`` flag with aliases is required as a group: either spelling satisfies it.

    Returns:
      The flag's action.

    Raises:
      ValueError: ``flag`` is not kebab-case, or a deprecated spelling is not an option (``-x``/``--x``).
    """
    if not is_kebab(flag):
        raise ValueError(f"{flag!r} is not a kebab-case long option (e.g. --dry-run)")
    bad = [d for d in deprecated if not d.startswith("-")]
    if bad:
        raise ValueError(f"deprecated spellings must be options: {bad}")
    container = parser
    if deprecated and kwargs.get("required"):
        container = parser.add_mutually_exclusive_group(required=True)  # mutually exclusive members are optional
        kwargs = {k: v for k, v in kwargs.items() if k != "required"}
    action = container.add_argument(flag, **kwargs)
    for old in deprecated:
        container.add_argument(old, dest=action.dest, action=_DeprecatedSpelling, target=action)
    return action


def deprecated_spellings(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``{old: new}`` for every hidden deprecated alias :func:`add_flag` put on ``parser`` (not its subparsers)."""
    return {old: a.target.option_strings[0] for a in parser._actions if isinstance(a, _DeprecatedSpelling)
            for old in a.option_strings}


class _DeprecatedSpelling(argparse.Action):
    """An old spelling of ``target``: parses as ``target`` does (same dest, arity, type, choices, const), hidden
    from ``--help``; using it prints :func:`deprecation_note` once per parsed namespace."""

    def __init__(self, option_strings, dest, target: argparse.Action, **_ignored):
        super().__init__(option_strings, dest, nargs=target.nargs, const=target.const, default=argparse.SUPPRESS,
                         type=target.type, choices=target.choices, metavar=target.metavar, help=argparse.SUPPRESS)
        self.target = target
        self._warned: list[weakref.ref] = []  # namespaces already told (argparse.Namespace is unhashable)

    def __call__(self, parser, namespace, values, option_string=None):
        if not any(ref() is namespace for ref in self._warned):
            self._warned = [ref for ref in self._warned if ref() is not None] + [weakref.ref(namespace)]
            print(deprecation_note(option_string, self.target.option_strings[0]), file=sys.stderr)
        self.target(parser, namespace, values, option_string)
