"""What the Python API still accepts for one release, with a warning (CHANGELOG, "API changes (issue 33)").

The public functions take their optional arguments by keyword only (``aotbuild.build(recipe,
cache=root)``). Until the next release a call that passes them by position, in their old order,
still works and warns once per call site (:class:`FutureWarning`, which Python shows by default),
naming the keyword to write instead. Delete this module, and its decorator on each function, then.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def positional_shim(*names: str) -> Callable[[F], F]:
    """Accept ``names`` (keyword-only parameters of the decorated function, in the order they were
    positional before) by position for one release, with a FutureWarning naming each keyword."""
    def wrap(fn: F) -> F:
        params = inspect.signature(fn).parameters.values()
        positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        keyword_only = {p.name for p in params if p.kind == p.KEYWORD_ONLY}
        assert set(names) <= keyword_only, f"{fn.__name__}: {set(names) - keyword_only} are not keyword-only"

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) <= positional:
                return fn(*args, **kwargs)
            extra = args[positional:]
            if len(extra) > len(names):
                raise TypeError(f"{fn.__name__}() takes {positional} positional argument(s) but {len(args)} "
                                f"were given")
            moved = dict(zip(names, extra, strict=False))
            for name in moved:
                if name in kwargs:
                    raise TypeError(f"{fn.__name__}() got multiple values for argument {name!r}")
            warnings.warn(f"aotbuild.{fn.__name__}(): pass {', '.join(f'{n}=' for n in moved)} by keyword; "
                          f"by position it stops working in the next release", FutureWarning, stacklevel=2)
            return fn(*args[:positional], **moved, **kwargs)

        return call  # type: ignore[return-value]

    return wrap
