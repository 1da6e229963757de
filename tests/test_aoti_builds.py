"""aot-package's compile builds AOTInductor's C++ wrapper beside its kernels (aoti.wrapper_beside_kernels):
the wrapper's object and the kernels' are built at the same time, the link only after both, and a
failure of either is the compile's. torch's builder is replaced by a fake that records what ran when;
every real package compile of the suite (tests/test_aot_constants.py, fast tier) goes through it too."""

from __future__ import annotations

import threading

import pytest
from torch._inductor import cpp_builder

from aotbuild.strategies import aoti


class Builder:
    def __init__(self, target: str):
        self.target = target

    def get_target_file_path(self) -> str:
        return f"/cache/c1/{self.target}"


def build(*targets: str) -> None:
    for target in targets:
        cpp_builder.CppBuilder.build(Builder(target))


def test_the_wrapper_builds_beside_the_kernels_and_the_link_waits_for_both(monkeypatch):
    events: list[tuple[str, str]] = []
    wrapper_started, kernels_built = threading.Event(), threading.Event()

    def fake(builder: Builder) -> None:
        events.append(("start", builder.target))
        if builder.target.endswith(".wrapper.o"):
            wrapper_started.set()
            # built one after the other, the kernels would never start: this wait would give up
            assert kernels_built.wait(10), "the kernels were not built while the wrapper was"
        elif builder.target.endswith(".kernel.o"):
            assert wrapper_started.wait(10)
            kernels_built.set()
        events.append(("end", builder.target))

    monkeypatch.setattr(cpp_builder.CppBuilder, "build", fake)
    with aoti.wrapper_beside_kernels():
        build("m.wrapper.o", "m.kernel.o", "m.weights.o", "m.wrapper.so")
    assert events.index(("end", "m.wrapper.o")) < events.index(("start", "m.weights.o"))
    assert events[-2:] == [("start", "m.wrapper.so"), ("end", "m.wrapper.so")]  # the link: last, alone
    assert cpp_builder.CppBuilder.build is fake  # put back


@pytest.mark.parametrize("failing", ["m.wrapper.o", "m.kernel.o"])
def test_a_failed_build_fails_the_compile_and_the_builder_is_put_back(monkeypatch, failing):
    ran: list[str] = []

    def fake(builder: Builder) -> None:
        if builder.target == failing:
            raise RuntimeError(f"g++ failed on {failing}")
        ran.append(builder.target)

    monkeypatch.setattr(cpp_builder.CppBuilder, "build", fake)
    with pytest.raises(RuntimeError, match=f"g\\+\\+ failed on {failing}"), aoti.wrapper_beside_kernels():
        build("m.wrapper.o", "m.kernel.o", "m.wrapper.so")
    assert "m.wrapper.so" not in ran  # nothing links after a failed object
    assert cpp_builder.CppBuilder.build is fake


def test_a_wrapper_left_building_at_the_end_is_waited_for(monkeypatch):
    done = threading.Event()

    def fake(builder: Builder) -> None:
        done.wait(0.2)
        done.set()

    monkeypatch.setattr(cpp_builder.CppBuilder, "build", fake)
    with aoti.wrapper_beside_kernels():
        build("m.wrapper.o")  # a torch that builds no kernels' object after it
    assert done.is_set()
