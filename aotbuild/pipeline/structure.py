"""What the compiler sees of a module, recorded at build and checked before a load reports a hit.

A key is computed from the recipe (the component's class and config, the compile settings, ...),
so it cannot see what a user did to the module after loading it: a LoRA adapter (peft replaces each
targeted ``Linear`` with a ``lora.Linear`` holding ``lora_A``/``lora_B``), a quantization (torchao
replaces weights with ``Int8Tensor`` subclasses), a swapped attention processor. Compiled code is
specialized on all of that, so an entry built for the plain module would "hit" and then compile on
the first call (measured: a LoRA'd UNet, jit-cache, 1 FX graph miss, a 34 s step). So every entry
records its component's structure (:func:`record`): one line per submodule (its path and class) and
per parameter and buffer (its path, tensor class, dtype and shape), never a weight value (changed
weights on the same structure keep hitting), and the compiler settings a library may have changed
for the whole process (the target's ``global_settings``: torchao's ``quantize_`` sets Inductor's
``coordinate_descent_tuning`` and friends, which the FX graph cache key includes). A load compares
the live module with the record first (:func:`mismatch`): a difference is a miss naming the first
one (``unet.down_blocks.0...attn1.to_q: peft.tuners.lora.layer.Linear here, torch.nn...Linear in
the entry``), before any call. aotbuild's own wrappers (a dispatcher, a compiled forward) are
instance attributes, not submodules: a second ``load_compiled`` on the same pipe still hits.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from aotbuild.utils.text import printable

__all__ = ["describe", "record", "mismatch", "settings_mismatch"]


def _class(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _tensor(t: Any) -> str:
    import torch

    kind = type(t)
    name = "Tensor" if kind in (torch.Tensor, torch.nn.Parameter) else _class(kind)
    return f"{name} {str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def describe(module: Any) -> list[str]:
    """``path: class`` per submodule, then ``path: param|buffer <tensor class> <dtype> <shape>``."""
    lines = [f"{name or '.'}: {_class(type(sub))}" for name, sub in module.named_modules(remove_duplicate=False)]
    lines += [f"{name}: param {_tensor(t)}" for name, t in module.named_parameters(remove_duplicate=False)]
    lines += [f"{name}: buffer {_tensor(t)}" for name, t in module.named_buffers(remove_duplicate=False)]
    return lines


def digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def record(module: Any, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``structure``: the module's lines and their digest, and the global compiler settings."""
    lines = describe(module)
    return {"digest": digest(lines), "lines": lines, "compiler": dict(settings)}


def _split(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        path, _, what = line.partition(": ")
        out.setdefault(path, what)
    return out


def mismatch(module: Any, recorded: Mapping[str, Any], component: str) -> str:
    """Why ``module`` is not the module the entry was built for (its first difference), or ""."""
    lines = describe(module)
    if digest(lines) == recorded.get("digest"):
        return ""
    here, there = _split(lines), _split(list(recorded.get("lines", [])))
    for path, what in here.items():
        if there.get(path) != what:
            where = component if path == "." else f"{component}.{path}"
            entry = there.get(path, "absent")
            return (f"{printable(where)}: {printable(what)} here, {printable(entry)} in the entry: the module "
                    f"differs from the one the entry was built for (an adapter, a quantization, another attention "
                    f"processor?)")
    for path, what in there.items():
        if path not in here:
            return (f"{printable(component)}.{printable(path)}: absent here, {printable(what)} in the entry: the "
                    f"module differs from the one the entry was built for")
    return f"{component} differs from the module the entry was built for (the order of its submodules)"


def settings_mismatch(recorded: Mapping[str, Any], here: Mapping[str, Any]) -> str:
    """Why this process's global compiler settings would miss the entry's compiled graphs, or ""."""
    changed = sorted(k for k in set(recorded) | set(here) if recorded.get(k) != here.get(k))
    if not changed:
        return ""
    k = changed[0]
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    return (f"compiler setting {printable(k)}: {_shown(here.get(k))} here, {_shown(recorded.get(k))} in the entry"
            f"{more}: a library changed it for the whole process (torchao's quantize_ does) or the environment "
            f"differs, and the compiler's cache key holds it")


def _shown(value: Any) -> str:
    text = json.dumps(value) if value is not None else "absent"
    return printable(text if len(text) <= 60 else text[:57] + "...")
