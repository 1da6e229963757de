"""Loading installed CPU kernels compiles no C++ header (aotbuild/targets/inductor.py,
headers_not_precompiled): Inductor's first kernel load in a process precompiles its prefix header,
8 s on a machine whose temp folder does not have it yet, and a loaded ``.so`` never uses it.

The fresh-machine promise itself is checked wherever the suite serves an entry: tests/serving.py
serves with an empty temp folder and asserts that no ``.gch`` appeared (assert_served), and that
nothing was compiled, which a changed kernel key would have broken."""

from __future__ import annotations

import subprocess
import textwrap
import threading

import pytest
from torch._inductor import codecache

from aotbuild.targets.inductor import headers_not_precompiled
from aotbuild.targets.registry import get_target
from tests.conftest import VECTOR_ISA, run_python

pytestmark = pytest.mark.usefixtures("vector_isa")  # the header as Inductor includes it by default

HEADER = "torch/csrc/inductor/cpp_prefix.h"


def test_inside_the_context_the_header_is_a_plain_include_made_without_a_subprocess(monkeypatch, tmp_path):
    original = codecache._precompile_header
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(tmp_path / "headers"))

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"ran {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    with headers_not_precompiled():
        path = codecache._precompile_header(HEADER, "g++ -O3 ...", min_optimize=False)
        again = codecache._precompile_header(HEADER, "g++ -O3 ...")
        other = codecache._precompile_header(HEADER, "g++ -O1 ...")
    assert codecache._precompile_header is original
    with open(path) as f:
        assert f.read() == f"#include <{HEADER}>\n"
    assert path.startswith(str(tmp_path / "headers" / "plain")) and path.endswith(".h")
    assert again == path and other != path  # one file per command line, as Inductor's own


def test_it_nests_and_the_last_one_out_restores_across_threads():
    original = codecache._precompile_header
    inside, release = threading.Event(), threading.Event()

    def other_thread():
        with headers_not_precompiled():
            inside.set()
            release.wait(10)

    worker = threading.Thread(target=other_thread)
    with headers_not_precompiled():
        patched = codecache._precompile_header
        assert patched is not original
        with headers_not_precompiled():
            assert codecache._precompile_header is patched
        assert codecache._precompile_header is patched
        worker.start()
        assert inside.wait(10)
    assert codecache._precompile_header is patched  # the other thread is still loading
    release.set()
    worker.join(10)
    assert codecache._precompile_header is original


def test_the_inductor_target_loads_inside_it_and_other_targets_change_nothing():
    original = codecache._precompile_header
    with get_target("inductor").loading():
        assert codecache._precompile_header is not original
    with get_target("neuron").loading(), get_target("tpu").loading():
        assert codecache._precompile_header is original


def test_a_jit_cache_route_loads_inside_it_at_its_first_call_only():
    """Dynamo loads a signature's kernels at its first call; later calls (and their recompiles, if
    any) keep the compiler as it is."""
    import contextlib

    from aotbuild.strategies.jit_cache import _loading

    class Target:
        entered = 0

        @contextlib.contextmanager
        def loading(self):
            Target.entered += 1
            yield

    calls = []
    route = _loading(Target(), lambda *a, **k: calls.append((a, k)) or "out")
    assert [route(1), route(2, x=3), route(4)] == ["out"] * 3
    assert Target.entered == 1 and len(calls) == 3

    def failing(*a, **k):
        raise RuntimeError("the first call failed")

    again = _loading(Target(), failing)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            again()
    assert Target.entered == 3  # a first call that failed is still a first call next time


KERNEL = textwrap.dedent("""
    import os, torch
    from pathlib import Path
    from aotbuild.targets.inductor import headers_not_precompiled
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    with headers_not_precompiled():
        kernel = CppPythonBindingsCodeCache.load_pybinding(
            ["int64_t*"], 'extern "C" void kernel(int64_t* out) { out[0] = 42; }')
    out = torch.zeros(1, dtype=torch.int64)
    kernel(out)
    print("RESULT", int(out[0]), sorted(p.name for p in Path(os.environ["TMPDIR"]).rglob("*.gch")))
""")


@pytest.mark.slow
def test_a_kernel_that_must_be_compiled_inside_it_compiles_from_the_plain_header(tmp_path):
    """A kernel missing from the cache is compiled after all (on_miss="compile", or a damaged
    entry): correct, without the precompiled header."""
    (tmp_path / "tmp").mkdir()
    proc = run_python(KERNEL, env={"TMPDIR": str(tmp_path / "tmp"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind"),
                                   **VECTOR_ISA})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT 42 []" in proc.stdout
