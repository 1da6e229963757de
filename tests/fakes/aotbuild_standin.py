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


def make_backend(name: str, env_var: str, suffix: str, stats: dict):
    def backend(gm: torch.fx.GraphModule, example_inputs):
        folder = Path(os.environ.get(env_var) or Path(tempfile.gettempdir()) / f"standin-{name}")
        shapes = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs]
        digest = hashlib.sha256((gm.code + repr(shapes)).encode()).hexdigest()
        path = folder / f"MODULE_{digest[:20]}" / f"model.{suffix}"
        if path.is_file() and path.read_text() == digest:
            stats["loads"] += 1
        else:
            stats["compiles"] += 1
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(digest)
            os.replace(tmp, path)
            (path.parent / "compile_flags.json").write_text('{"target": "standin"}')
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
