"""aotbuild/forwards.py: every wrapper aotbuild puts in a module's ``forward`` goes on and comes off
through one registry, which puts back exactly what was below it (issue 33 item 2)."""

from __future__ import annotations

import torch

from aotbuild import forwards
from aotbuild.dispatch import dispatchers, install_dispatcher, uninstall_dispatchers


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2


def _tagging(tag: str, seen: list[str]):
    def make(inner):
        def run(*args, **kwargs):
            seen.append(tag)
            return inner(*args, **kwargs)

        return run

    return make


def test_layers_stack_and_come_off_leaving_the_module_as_it_was():
    m = Doubler()
    before = dict(vars(m))
    seen: list[str] = []
    forwards.wrap(m, forwards.RECORD, _tagging("record", seen))
    forwards.wrap(m, forwards.PROOF, _tagging("proof", seen))
    assert m(torch.ones(1)).item() == 2 and seen == ["proof", "record"]
    assert len(forwards.layers(m)) == 2 and len(forwards.layers(m, forwards.PROOF)) == 1
    assert not forwards.unwrap(m, forwards.RECORD)  # not the outermost: it stays, and so does what is over it
    assert forwards.unwrap(m, forwards.PROOF) and forwards.unwrap(m, forwards.RECORD)
    assert vars(m) == before and "forward" not in vars(m)  # the class's forward again; no registry attribute
    assert not forwards.unwrap(m, forwards.RECORD)


def test_another_librarys_wrapper_below_a_dispatcher_survives_its_removal():
    """accelerate's offload hook is an instance ``forward`` (its ``_old_forward`` the module's own):
    removing the dispatcher a load put around it used to delete the attribute, and the hook with it."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    calls: list[str] = []

    class Counting(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append("hook")
            return args, kwargs

    m = Doubler()
    add_hook_to_module(m, Counting())
    hooked = vars(m)["forward"]
    d = install_dispatcher(m, "unet", {}, None, "eager")
    assert dispatchers(m) == [d] and m(torch.ones(1)).item() == 2 and calls == ["hook"]  # through the hook
    assert uninstall_dispatchers(m) == 1
    assert vars(m)["forward"] is hooked and dispatchers(m) == []
    m(torch.ones(1))
    assert calls == ["hook", "hook"]  # the offload hook still runs


def test_a_dispatcher_something_else_wrapped_over_stays_with_it():
    m = Doubler()
    d = install_dispatcher(m, "unet", {}, None, "eager")
    foreign = vars(m)["forward"]
    m.forward = lambda *a, **k: foreign(*a, **k)  # a library wraps the dispatcher after the load
    over = vars(m)["forward"]
    assert uninstall_dispatchers(m) == 0  # taking it off would drop the wrapper above it
    assert vars(m)["forward"] is over and dispatchers(m) == [d]


def test_unwrapped_and_class_forward_run_a_block_without_the_layers_and_put_them_back():
    m = Doubler()
    foreign = lambda x: m.__class__.forward(m, x) + 1  # noqa: E731 - another library's wrapper
    m.forward = foreign
    seen: list[str] = []
    top = forwards.wrap(m, forwards.DISPATCH, _tagging("dispatch", seen))
    with forwards.unwrapped(m):
        assert vars(m)["forward"] is foreign  # below aotbuild's layers: the other library's stays
    with forwards.class_forward(m):
        assert "forward" not in vars(m) and m(torch.ones(1)).item() == 2
    assert vars(m)["forward"] is top and m(torch.ones(1)).item() == 3 and seen == ["dispatch"]
