"""The fast tier's guard (registered by tests/conftest.py): a test not marked ``slow`` that reaches
Inductor's code generation, or has Inductor run its C++ compiler, fails, naming what it reached.

Inductor is patched where its work starts (``GraphLowering.codegen`` and ``codegen_with_cpp_wrapper``:
every graph it generates code for, Python wrapper or C++ one, AOTInductor included; and
``CppBuilder.build``: every g++ run, kernels and ISA probes alike) when those modules are first
imported, so a process that never imports Inductor pays nothing, and an import after the session
started is caught too. What was reached is recorded, not raised, so a test that catches errors (a
build that records a failed job) cannot hide it; the test fails after its call, or after its
teardown for what the teardown reached (a fixture's setup counts for the test that asked for it).

It covers the test's own process. Subprocesses are not covered: tests start them in too many ways
(``run_python`` with its own ``PYTHONPATH``, the ``aotbuild`` entry point, build workers the
product starts itself) for one hook to reach them all reliably; a fast test that compiles in a
subprocess shows up in ``--durations`` instead.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any

import pytest

#: Where Inductor's code generation and compiles start: module -> (class, methods).
ENTRY_POINTS = {
    "torch._inductor.graph": ("GraphLowering", ("codegen", "codegen_with_cpp_wrapper")),
    "torch._inductor.cpp_builder": ("CppBuilder", ("build",)),
}

_REACHED: list[str] = []  # what the running fast test reached
_WATCHING = [False]  # a fast test is running (setup to teardown)


def _recording(real: Any, where: str) -> Any:
    @functools.wraps(real)
    def reached(*args: Any, **kwargs: Any) -> Any:
        if _WATCHING[0]:
            _REACHED.append(where)
        return real(*args, **kwargs)

    reached._fast_tier_guard = True  # type: ignore[attr-defined]
    return reached


def _guard(module: Any) -> None:
    cls_name, methods = ENTRY_POINTS[module.__name__]
    cls = getattr(module, cls_name, None)
    for name in methods:
        real = getattr(cls, name, None)
        if real is not None and not getattr(real, "_fast_tier_guard", False):
            setattr(cls, name, _recording(real, f"{cls_name}.{name}"))


def _guarding_after(real_exec: Any) -> Any:
    def exec_module(module: Any) -> None:
        real_exec(module)
        _guard(module)

    return exec_module


_FILE_LOADERS = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Guards an entry point's module right after its first import (nothing imported here)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in ENTRY_POINTS:
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if finder is not self and hasattr(
                finder, "find_spec") else None
            if spec is None:
                continue
            if isinstance(spec.loader, _FILE_LOADERS):  # one loader object per module
                spec.loader.exec_module = _guarding_after(spec.loader.exec_module)  # type: ignore[method-assign]
            return spec
        return None


def _guard_imported() -> None:
    for name in ENTRY_POINTS:
        if name in sys.modules:
            _guard(sys.modules[name])


def pytest_configure(config: pytest.Config) -> None:
    _guard_imported()
    sys.meta_path.insert(0, _GuardOnImport())


def _check(item: pytest.Item) -> None:
    if _REACHED:
        reached = sorted(set(_REACHED))
        _REACHED.clear()
        pytest.fail(f"{item.nodeid} is not marked slow but reached Inductor's {', '.join(reached)} "
                    "(tests/guards.py): mark it @pytest.mark.slow, or fake the compile (the fake_compiles "
                    "fixture)", pytrace=False)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    _guard_imported()  # in case an import went around the finder
    _REACHED.clear()
    _WATCHING[0] = item.get_closest_marker("slow") is None
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    result = yield
    _check(item)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    try:
        result = yield
        _check(item)
        return result
    finally:
        _WATCHING[0] = False
