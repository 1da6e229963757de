"""What a recipe may set in ``compile.options``: data, never a program.

In CI a pull request controls the recipe (and pyproject.toml), so a recipe may set only options
whose values cannot name something to run or load: booleans, integers, floats, and fixed sets of
choices (``Literal``). Free-form options (strings, paths, lists: the C++ compiler and linker,
``cpp.march``, which torch pastes into the g++ command line, include and library paths, custom
passes) are refused unless the operator names them in ``AOTBUILD_ALLOW_OPTIONS`` (comma-separated
names, or ``*``), an environment variable a pull request cannot set. Every value is checked against
its declared type, unions and containers included, allowed or not (docs/security.md).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from aotbuild import constants

SAFE = (bool, int, float)


def allowed_by_operator(name: str) -> bool:
    names = {n.strip() for n in constants.env_allowed_options().split(",") if n.strip()}
    return "*" in names or name in names


def is_data(declared: Any) -> bool:
    """True when every value of ``declared`` is a bool, an int, a float or one of fixed choices."""
    if declared in SAFE or declared is type(None):
        return True
    origin = get_origin(declared)
    if origin is Literal:
        return all(isinstance(c, (*SAFE, str, type(None))) for c in get_args(declared))
    if origin in (Union, types.UnionType):
        return all(is_data(a) for a in get_args(declared))
    return False


def matches(value: Any, declared: Any) -> bool:
    """Does a YAML value fit a declared type (typing forms included)?"""
    if declared is Any or declared is typing.Any:
        return True
    if declared is type(None) or declared is None:
        return value is None
    origin = get_origin(declared)
    args = get_args(declared)
    if origin is Literal:
        return any(value == c and type(value) is type(c) for c in args)
    if origin in (Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin in (list, tuple, set, frozenset) or declared in (list, tuple):
        if not isinstance(value, list):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args, strict=True))
        return not args or all(matches(v, args[0]) for v in value)
    if origin is dict or declared is dict:
        return isinstance(value, dict) and (not args or all(matches(k, args[0]) and matches(v, args[1])
                                                            for k, v in value.items()))
    if declared is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if declared is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(declared, type):
        return isinstance(value, declared)
    return False  # a callable, a class instance: nothing a YAML value can be


def check(recipe: Any, key: str, value: Any, declared: Any = None) -> None:
    """Refuse an option value a recipe may not set. ``declared`` is the option's type when the
    compiler declares one (Inductor); otherwise the value itself must be a bool, int or float."""
    where = f"compile.options.{key}"
    allowed = allowed_by_operator(key)
    if declared is not None:
        if not matches(value, declared):
            raise recipe.error(where, f"{value!r} does not fit this option's type ({_name(declared)})")
        if not is_data(declared) and not allowed:
            raise recipe.error(where, _refusal(key, _name(declared)))
    elif not (isinstance(value, SAFE) or value is None) and not allowed:
        raise recipe.error(where, _refusal(key, type(value).__name__))


def _refusal(key: str, kind: str) -> str:
    return (f"a free-form option ({kind}): it can name a program, a path or flags the compiler uses, so a recipe "
            f"may not set it unless the operator allows it with {constants.ENV_ALLOW_OPTIONS}={key} (an "
            f"environment variable; docs/security.md)")


def _name(declared: Any) -> str:
    return getattr(declared, "__name__", None) if isinstance(declared, type) else str(declared).replace("typing.", "")
