"""A name -> implementation table whose modules are imported on first use (targets, strategies)."""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from aotbuild.errors import UsageError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, factories: dict[str, tuple[str, str]]):
        self.kind = kind
        #: name -> (module, class): the module is imported when the name is first asked for
        self.factories = factories
        self._instances: dict[str, T] = {}

    def names(self) -> tuple[str, ...]:
        return tuple(self.factories)

    def get(self, name: str) -> T:
        if name not in self._instances:
            try:
                module_name, class_name = self.factories[name]
            except KeyError:
                raise UsageError(f"unknown {self.kind} {name!r}; known: {', '.join(self.factories)}") from None
            self._instances[name] = getattr(importlib.import_module(module_name), class_name)()
        return self._instances[name]
