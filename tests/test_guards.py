"""The fast tier's guard (tests/guards.py) is in place and records what it is there to catch."""

from __future__ import annotations

import importlib

import pytest

from tests import guards


def test_every_entry_point_of_inductor_s_codegen_is_guarded_in_this_process():
    # A renamed method would leave the guard silently off: each one must exist and be wrapped.
    for module_name, (cls_name, methods) in guards.ENTRY_POINTS.items():
        cls = getattr(importlib.import_module(module_name), cls_name)
        for name in methods:
            assert getattr(getattr(cls, name), "_fast_tier_guard", False), f"{module_name}.{cls_name}.{name}"


def test_a_fast_test_reaching_codegen_is_recorded_and_fails(request):
    from torch._inductor.graph import GraphLowering

    assert guards._WATCHING == [True]
    with pytest.raises(AttributeError):
        GraphLowering.codegen(object())  # reaches the entry point; no graph to generate code for
    reached, guards._REACHED[:] = list(guards._REACHED), []  # taken, so this test itself passes
    assert reached == ["GraphLowering.codegen"]
    guards._REACHED.append("GraphLowering.codegen")
    with pytest.raises(pytest.fail.Exception, match="not marked slow but reached Inductor's GraphLowering.codegen"):
        guards._check(request.node)
    assert guards._REACHED == []


@pytest.mark.slow
def test_a_slow_test_is_not_watched():
    assert guards._WATCHING == [False]
