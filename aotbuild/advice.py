"""What to do next: the advice of every miss and gate, made from its situation (issue 55).

Advice followed as written must do what it says. ``load_compiled(recipe, cache=X)`` used to end its
miss with ``next: `aotbuild build tiny_sd_cpu.yaml` builds them here``, which builds into the default
cache, not X, so the next load missed again; and its reason told a Python caller to "pass --cache".
So every such line is made here, from a :class:`Situation` (the recipes as the caller named them, the
cache root that was read, the remote that was asked), and names that cache and that remote. It speaks
the caller's language: flags inside an ``aotbuild`` command (the CLI enters :func:`cli_voice`),
arguments (``cache=``) everywhere else. tests/test_advice.py makes each command of :data:`COMMANDS` in
each situation and runs it there (``plan --json`` standing in for a build), checking the cache and the
remote it reaches.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from aotbuild import constants
from aotbuild.cache.layout import resolve_cache_root

_CLI: ContextVar[bool] = ContextVar("aotbuild_cli_voice", default=False)


@contextmanager
def cli_voice() -> Iterator[None]:
    """Advice made inside this block speaks flags: the ``aotbuild`` commands run in it."""
    token = _CLI.set(True)
    try:
        yield
    finally:
        _CLI.reset(token)


def speaks_cli() -> bool:
    """Whether the advice made now is read at a shell (an ``aotbuild`` command) or in Python."""
    return _CLI.get()


@dataclass(frozen=True)
class Situation:
    """Where a miss or a gate happened: what a command must reach to help there."""

    #: the recipe files or folders as the caller named them; () for recipe data (a dict, a Recipe)
    recipes: tuple[str, ...] = ()
    #: the cache root that was read
    cache: Path | None = None
    #: the remote that was asked ("" for none)
    remote: str = ""
    #: the caller passed its own pipeline (``load_compiled(recipe, pipe=pipe)``): build for that object
    pipe: bool = False

    def named_cache(self) -> Path | None:
        """The cache root a command must name: None where the default rule (no ``--cache``, no
        ``cache=``) finds it anyway, here."""
        if self.cache is None:
            return None
        root = Path(self.cache).expanduser().absolute()
        return None if root == resolve_cache_root(None) else root


def build_command(situation: Situation) -> str:
    """The command that builds the situation's misses into its cache (and, from files with a remote,
    pushes them there): ``aotbuild build FILES [--cache C] [--push URL]``, or for recipe data and a
    pipeline passed in, ``aotbuild.build(recipe[, pipe=pipe][, cache='C'])``."""
    cache = situation.named_cache()
    if situation.recipes and not situation.pipe:
        words = ["aotbuild", "build", *situation.recipes, *(["--cache", str(cache)] if cache else []),
                 *(["--push", situation.remote] if situation.remote else [])]
        return " ".join(shlex.quote(word) for word in words)
    arguments = ["recipe", *(["pipe=pipe"] if situation.pipe else []), *([f"cache={str(cache)!r}"] if cache else [])]
    return f"aotbuild.build({', '.join(arguments)})"


def build_line(situation: Situation) -> str:
    """``next: `COMMAND` builds them ...``: the line that ends a miss's report or a gate's."""
    command = build_command(situation)
    if situation.pipe:
        what = "builds them for this pipeline"
    elif situation.remote and situation.recipes:
        what = f"builds them into this cache and pushes them to {situation.remote}"
    else:
        what = "builds them here"
    return f"next: `{command}` {what}"


def another_root() -> str:
    """What to check when the cache read is empty: most often the entries were built into another
    root. A Python caller passes ``cache=``, a shell user ``--cache``."""
    argument = "--cache" if speaks_cli() else "cache="
    return f"built into another? pass {argument} or set {constants.ENV_CACHE}"


def neither_side(remote: str) -> str:
    """A gate's reason for a job neither the cache nor the remote holds."""
    return f"not in the cache, not on {remote} either"


def retry_failed() -> str:
    """What builds a job that failed before again (a build skips it until asked)."""
    how = "the same command with --retry-failed" if speaks_cli() else "build(..., retry_failed=True)"
    return f"not retried: {how} builds it again"


#: Every advice that is a command, by name -> what makes it from a situation: tests/test_advice.py
#: runs each one in its situation.
COMMANDS: dict[str, Callable[[Situation], str]] = {"build": build_command}

__all__ = ["Situation", "cli_voice", "speaks_cli", "build_command", "build_line", "another_root", "neither_side",
           "retry_failed", "COMMANDS"]
