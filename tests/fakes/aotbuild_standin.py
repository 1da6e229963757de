"""Stand-in compilers for targets that cannot run here (tests only).

Each is a real ``torch.compile`` backend, registered under the real backend's name, that behaves
like a persistent-cache compiler: it hashes the FX graph and its input shapes, and either *loads*
the artifact from the folder the real compiler uses (named by the same environment variable) or
*compiles* it (writes it there). It counts both, so tests can assert "a warm load compiled
nothing". The compiled graph then runs on the CPU. Importing the fake vendor module also creates
a ``torch.<device>`` namespace with the helper functions the device table calls, and records what
it was asked (e.g. the seed that reached the accelerator generator).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import types
from pathlib import Path

import torch

#: Faults a test can ask of a stand-in, to prove the proof catches them (AOTBUILD_STANDIN_FAULT):
#: "first-instance": only the first artifact a process loads is served, later ones compile again (a
#: regional entry that serves its first block only); "drift": compiled graphs return eager + 0.01.
FAULT = "AOTBUILD_STANDIN_FAULT"


def make_backend(name: str, env_var: str, suffix: str, stats: dict):
    def backend(gm: torch.fx.GraphModule, example_inputs):
        fault = os.environ.get(FAULT, "")
        folder = Path(os.environ.get(env_var) or Path(tempfile.gettempdir()) / f"standin-{name}")
        shapes = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs]
        digest = hashlib.sha256((gm.code + repr(shapes)).encode()).hexdigest()
        path = folder / f"MODULE_{digest[:20]}" / f"model.{suffix}"
        served = not (fault == "first-instance" and stats["loads"] >= 1)
        if path.is_file() and path.read_text() == digest and served:
            stats["loads"] += 1
        else:
            stats["compiles"] += 1
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(digest)
            os.replace(tmp, path)
            (path.parent / "compile_flags.json").write_text('{"target": "standin"}')
            if not served:  # a real compiler would write a new artifact, not the same bytes again
                (path.parent / f"recompiled-{stats['compiles']}").write_text(digest)
        if fault == "drift":
            def drifted(*args):
                out = gm.forward(*args)
                return [o + 0.01 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out] \
                    if isinstance(out, (list, tuple)) else out
            return drifted
        return gm.forward

    torch._dynamo.register_backend(compiler_fn=backend, name=name)
    return backend


def make_namespace(device: str, calls: list) -> types.SimpleNamespace:
    state = {"seed": None, "peak": 1234}

    def record(op):
        def fn(*args):
            calls.append((op, args))
            if op in ("manual_seed", "manual_seed_all"):
                state["seed"] = args[0]
            return {"device_count": 2, "max_memory_allocated": state["peak"]}.get(op)

        return fn

    ns = types.SimpleNamespace(
        is_available=lambda: True,
        initial_seed=lambda: state["seed"],
        **{op: record(op) for op in ("synchronize", "empty_cache", "manual_seed", "manual_seed_all",
                                     "device_count", "max_memory_allocated", "reset_peak_memory_stats")},
    )
    setattr(torch, device, ns)
    return ns
