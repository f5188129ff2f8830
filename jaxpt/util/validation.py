"""Field checks that config dataclasses run on themselves, in ``__post_init__``.

Every config dataclass (``ModelConfig``, ``OptimizerConfig``, ``DataConfig``, ``TrainConfig``,
``CheckpointConfig``, ``StabilityConfig``, ``HeldoutEvalConfig``) calls :func:`check_types` and then states
its ranges with :func:`require` (or :func:`positive` / :func:`non_negative`), so a bad value fails where the
config is built (gin, a constructor call, ``dataclasses.replace``) with a :class:`ConfigError` that names
``ClassName.field = value`` and what is allowed. Checks across configs, or against the devices, live in
:func:`jaxpt.config.validate`. This module imports nothing from jaxpt but the error class, so the model
package can use it and still know nothing of gin or of the train loop.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal

from jaxpt.util.errors import ConfigError


def field_error(obj: Any, name: str, allowed: str) -> ConfigError:
    """``ConfigError('ClassName.name = <value>: <allowed>')`` for field ``name`` of dataclass ``obj``."""
    return ConfigError(f"{type(obj).__name__}.{name} = {getattr(obj, name)!r}: {allowed}")


def require(obj: Any, name: str, ok: bool, allowed: str) -> None:
    """Raise :func:`field_error` for ``obj.name`` unless ``ok``; ``allowed`` says what values are allowed.

    Raises:
      ConfigError: ``not ok``.
    """
    if not ok:
        raise field_error(obj, name, allowed)


def positive(obj: Any, *names: str) -> None:
    """Each named numeric field of ``obj`` is > 0. Raises ConfigError naming the first that is not."""
    for name in names:
        require(obj, name, getattr(obj, name) > 0, "must be positive")


def non_negative(obj: Any, *names: str) -> None:
    """Each named numeric field of ``obj`` is >= 0. Raises ConfigError naming the first that is not."""
    for name in names:
        require(obj, name, getattr(obj, name) >= 0, "must be >= 0")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_problem(value: Any, hint: Any) -> str | None:
    """Why ``value`` does not fit ``hint`` (None when it does, or when the hint is not one checked here)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return None if isinstance(value, str) and value in args else f"choose one of {args}"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, (tuple, list)):
            return f"expected a tuple, got {type(value).__name__}"
        for item in value:
            problem = _type_problem(item, args[0])
            if problem:
                return f"entry {item!r}: {problem}"
        return None
    expected = {bool: (bool,), int: (int,), float: (int, float), str: (str,), tuple: (tuple, list)}.get(hint)
    if expected is None and isinstance(hint, type) and dataclasses.is_dataclass(hint):
        expected = (hint,)
    if expected is None:
        return None
    ok = isinstance(value, expected) and (hint is bool or not isinstance(value, bool))
    return None if ok else f"expected {hint.__name__}, got {type(value).__name__}"


def check_types(obj: Any) -> None:
    """Check every field of dataclass ``obj`` against its annotation.

    Checked annotations: ``bool``, ``int`` (a bool is not an int here), ``float`` (an int is accepted),
    ``str``, ``tuple`` (a list is accepted and stored as a tuple, so configs stay hashable), ``tuple[X, ...]``
    (each entry checked against ``X``), ``Literal[...]`` of strings, and dataclass types (``isinstance``).
    Other annotations are not checked.

    Raises:
      ConfigError: ``ClassName.field = value: expected int, got str`` or ``...: choose one of (...)``.
    """
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        problem = _type_problem(value, hint)
        if problem:
            raise field_error(obj, f.name, problem)
        if isinstance(value, list) and (hint is tuple or typing.get_origin(hint) is tuple):
            object.__setattr__(obj, f.name, tuple(value))  # frozen dataclasses: set once, at construction
