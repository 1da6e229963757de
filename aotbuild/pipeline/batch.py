"""Batch buckets (issue 56, item 3): which inputs of a call hold the batch, and a call padded up to a
built batch.

A shape's ``batch_size`` may be a list: one entry per size. A server that batches requests calls the
denoiser at any batch; with the recipe's ``pad_batch: true`` a call between two built sizes is padded
to the next one up on every input whose leading dimension is the batch (:func:`record`: recorded per
signature by the build's proof), the padding rows copies of the last real sample, and the padding is
dropped from the output. The batch is the component's, as the pipeline calls it: with guidance's two
halves in one call (SD, SDXL) a recipe of ``[1, 4]`` images builds batches 2 and 8.

Whether padding gives each real sample its own output is proven per entry (aotbuild/builder/proof.py:
every smaller batch padded to the entry's, each sample compared with eager at its own batch) and kept
in the manifest (``proof.padding``). An entry without that record, or whose proof found a difference
(a dynamic quantization's scale computed over the batch), is not padded to: the call is refused by name
(``Fit.why``, the advice of aotbuild/pipeline/callterms.py's one refusal), as is a batch above the largest
built.

Stdlib only at import (the dispatcher's runtime path); torch inside the functions that touch tensors.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aotbuild.utils.safeio import loads_json

#: An input's place in a call: ("args", 0), ("kwargs", "encoder_hidden_states"), ("kwargs",
#: "added_cond_kwargs", "time_ids"), as in the call's signature (aotbuild/dispatch.py).
Path = tuple[Any, ...]

#: A signature is JSON of at most this size and depth (the dispatcher's bounds).
_SIG_BYTES = 1 << 16
_SIG_DEPTH = 64
#: Signatures whose fit is remembered per table (a server sees few).
_REMEMBERED = 4096


def _tensors(value: Any, path: Path) -> Iterator[tuple[Path, list[int]]]:
    """(path, shape) of every tensor in a decoded signature's value."""
    if isinstance(value, list) and value[:1] == ["tensor"]:
        yield path, list(value[1])
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _tensors(item, (*path, i))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, (*path, key))


def _decode(sig: str) -> dict[str, Any]:
    return loads_json(sig, max_bytes=_SIG_BYTES, max_depth=_SIG_DEPTH)


def batch_inputs(sig: str) -> tuple[int, tuple[Path, ...]] | None:
    """A signature's batch and the inputs that hold it: the leading dimension of its largest tensor
    (the latents or the text states: both carry the batch), and every tensor input whose leading
    dimension is that size. None for a call without a tensor of one dimension or more, or a signature
    that is not one (a manifest's text is hostile input: never a failed load)."""
    try:
        data = _decode(sig)
        found = [(p, s) for p, s in _tensors({"args": data["args"], "kwargs": data["kwargs"]}, ())
                 if s and all(isinstance(n, int) for n in s)]
    except (ValueError, KeyError, TypeError):
        return None
    if not found:
        return None
    _, largest = max(found, key=lambda ps: _numel(ps[1]))
    batch = largest[0]
    return batch, tuple(p for p, s in found if s[0] == batch)


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def record(sig: str) -> dict[str, Any] | None:
    """What the build records of a built signature a smaller call can be padded to (its batch is at
    least 2): ``{"signature", "batch", "inputs"}``; None otherwise."""
    found = batch_inputs(sig)
    if found is None or found[0] < 2:
        return None
    batch, inputs = found
    return {"signature": sig, "batch": batch, "inputs": [list(p) for p in inputs]}


def proof_sizes(batch: int) -> list[int]:
    """The smaller batches the proof pads up to ``batch``: every one up to 8 of them; above that 1, 2, 3,
    the quarters and the last two (the largest padding and the smallest, and between)."""
    if batch <= 9:
        return list(range(1, batch))
    return sorted({1, 2, 3, batch // 4, batch // 2, 3 * batch // 4, batch - 2, batch - 1})


def _template(data: dict[str, Any], inputs: tuple[Path, ...]) -> tuple[int, str] | None:
    """The call's batch (the leading size of every input in ``inputs``, which must agree) and its
    signature with those sizes left out: two calls that differ only in the batch share it. None where an
    input is missing or its leading sizes differ."""
    data = json.loads(json.dumps(data))  # a copy to blank
    batch = None
    for path in inputs:
        holder: Any = data
        try:
            for step in path[:-1]:
                holder = holder[step]
            value = holder[path[-1]]
        except (KeyError, IndexError, TypeError):
            return None
        if not (isinstance(value, list) and value[:1] == ["tensor"] and value[1]):
            return None
        if batch is not None and value[1][0] != batch:
            return None
        batch = value[1][0]
        value[1][0] = None
    if batch is None:
        return None
    return batch, json.dumps(data, sort_keys=True)


@dataclass(frozen=True)
class Built:
    """One built signature of a component, as padding reads it."""

    sig: str
    batch: int  # the component's batch in it
    images: int  # the entry's shape's batch_size: images per call (guidance may double the batch)
    label: str  # the entry's shape label (``64x64b4``)
    key: str  # the entry's key
    inputs: tuple[Path, ...]  # the inputs that hold the batch (derived where the entry records none)
    refused: str = ""  # why padding up to it is refused ("" where its proof showed it exact)


@dataclass(frozen=True)
class Fit:
    """A call that differs from built signatures only in its batch: padded to ``target``, or refused."""

    batch: int  # the call's
    sig: str  # the call's signature
    group: tuple[Built, ...]  # the built batches of the same call, smallest first
    inputs: tuple[Path, ...]
    target: Built | None  # the next built batch up; None: above the largest
    why: str = ""  # why it is refused ("": padded)


class Padding:
    """A dispatcher's batch table: every built signature of its component, grouped by what they hold
    apart from the batch. ``allowed``: the recipe's ``pad_batch``."""

    def __init__(self, component: str, built: Sequence[Built], allowed: bool):
        self.component = component
        self.allowed = allowed
        self.built = tuple(built)
        self.groups: dict[tuple[Path, ...], dict[str, list[Built]]] = {}
        for inputs in dict.fromkeys(b.inputs for b in self.built if b.batch >= 2 and b.inputs):
            for b in self.built:
                found = _template(_decode(b.sig), inputs)
                if found is not None:
                    self.groups.setdefault(inputs, {}).setdefault(found[1], []).append(b)
        self._fits: dict[str, Fit | None] = {}

    @classmethod
    def of(cls, component: str, entries: Sequence[tuple[str, str, int, Sequence[str], Any]],
           allowed: bool) -> Padding:
        """From the component's entries: (key, shape label, batch_size, signatures, the proof's padding
        record or None)."""
        built = []
        for key, label, images, signatures, recorded in entries:
            proven = {r["signature"]: r for r in (recorded or {}).get("signatures", ())}
            for sig in signatures:
                found = batch_inputs(sig)
                if found is None:
                    continue
                mine = proven.get(sig)
                inputs = tuple(tuple(p) for p in mine["inputs"]) if mine else found[1]
                built.append(Built(sig, found[0], images, label, key, inputs, _refused(recorded, mine, key)))
        return cls(component, built, allowed)

    def fit(self, sig: str) -> Fit | None:
        """The padding of a call of signature ``sig`` (unbuilt), or None where its batch is not what
        differs from the built ones (remembered per signature)."""
        if sig not in self._fits:
            if len(self._fits) > _REMEMBERED:
                self._fits.clear()
            self._fits[sig] = self._fit(sig)
        return self._fits[sig]

    def _fit(self, sig: str) -> Fit | None:
        data = _decode(sig)
        for inputs, groups in self.groups.items():
            found = _template(data, inputs)
            group = groups.get(found[1]) if found else None
            if not group:
                continue
            batch = found[0]
            group = sorted(group, key=lambda b: b.batch)
            # a batch of one size only, not padded to and not a bucket: left to the dispatcher's own hint
            if not self.allowed and len({b.batch for b in group}) < 2:
                return None
            target = next((b for b in group if b.batch > batch), None)
            why = _why(self.allowed, batch, group, target, inputs)
            return Fit(batch, sig, tuple(group), inputs, target, why)
        return None


def _refused(recorded: Any, mine: Any, key: str) -> str:
    """Why padding up to a built signature is refused, from its entry's proof record ("" where proven)."""
    if recorded is None:
        return (f"its entry ({key[:12]}) holds no padding proof (built before aotbuild proved padding): `aotbuild rm "
                f"{key[:12]}` and build again")
    if recorded.get("refused"):
        return f"its entry's proof ({key[:12]}) found: {recorded['refused']}"
    if mine is None:
        return f"its entry's proof ({key[:12]}) did not pad to this signature"
    return ""


def _why(allowed: bool, batch: int, group: list[Built], target: Built | None, inputs: tuple[Path, ...]) -> str:
    """Why a call of ``batch`` is not padded ("" where it is), in the caller's terms: the refusal's advice
    (aotbuild/pipeline/callterms.py writes the rest: what was called, what was built, the latents)."""
    called = _images(batch, group)
    if target is None:
        return (f"{called} is above the largest built ({_images(group[-1].batch, group)}): add it to the shape's "
                f"batch_size list and rebuild")
    if not allowed:
        return (f"{called} is not built; a call is padded up to the next built batch size only with pad_batch: true "
                f"in the recipe (docs/runtime.md, \"Batch buckets\")")
    if target.refused:
        return f"{called} is not padded to {target.images}: {target.refused}"
    if target.inputs != inputs:
        return f"{called} is not padded to {target.images}: the build recorded other inputs holding the batch"
    return ""


def _ratio(group: Sequence[Built]) -> int:
    """Rows of the component's batch per image, as the pipeline called it at build (2: guidance's two
    halves in one batch), where every built size agrees; else 1."""
    ratios = {b.batch // b.images for b in group if b.images and b.batch % b.images == 0}
    return ratios.pop() if len(ratios) == 1 else 1


def _images(batch: int, group: Sequence[Built]) -> str:
    """A batch of the component in the caller's terms: images per call (with the component's batch where
    the pipeline doubles it for guidance)."""
    r = _ratio(group)
    if batch % r:
        return f"a batch of {batch}"
    n = batch // r
    return f"{n} image{'s' if n != 1 else ''} per call" + (f" (batch {batch}: guidance's two halves)" if r > 1 else "")


# -- tensors ----------------------------------------------------------------------------------

def _replace(container: Any, path: Path, fn: Callable[[Any], Any]) -> Any:
    """``container`` with the value at ``path`` replaced by ``fn(value)``; every container on the way
    copied (of its own type), none changed in place."""
    if not path:
        return fn(container)
    step, rest = path[0], path[1:]
    if isinstance(container, dict):
        new = dict(container)
        new[step] = _replace(container[step], rest, fn)
        return new
    items = list(container)
    items[step] = _replace(items[step], rest, fn)
    return type(container)(items) if isinstance(container, tuple) else items


def _apply(args: tuple[Any, ...], kwargs: dict[str, Any], inputs: tuple[Path, ...],
           fn: Callable[[Any], Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    call = {"args": tuple(args), "kwargs": dict(kwargs)}
    for path in inputs:
        call = _replace(call, path, fn)
    return call["args"], call["kwargs"]


def pad_tensor(t: Any, batch: int) -> Any:
    """``t`` grown to ``batch`` rows by copies of its last one, in the layout the call had: an expanded
    batch (stride 0, PixArt's ``t.expand(batch)``) stays expanded, since a compiled graph's guards read
    strides."""
    if t.stride(0) == 0:
        return t[:1].expand(batch, *t.shape[1:])
    import torch

    return torch.cat([t, t[-1:].expand(batch - t.shape[0], *t.shape[1:])])


def pad(args: tuple[Any, ...], kwargs: dict[str, Any], fit: Fit) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's inputs padded to ``fit.target``'s batch."""
    assert fit.target is not None
    size = fit.target.batch
    return _apply(args, kwargs, fit.inputs, lambda t: pad_tensor(t, size))


def take(args: tuple[Any, ...], kwargs: dict[str, Any], inputs: tuple[Path, ...],
         batch: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's first ``batch`` samples (the proof's smaller calls)."""
    return _apply(args, kwargs, inputs, lambda t: t[:batch])


def unpad(out: Any, fit: Fit) -> Any:
    """The output of a padded call without its padding rows: every tensor of the padded batch cut to the
    call's (tuples, dicts and diffusers' outputs alike)."""
    import torch
    from torch.utils._pytree import tree_map

    assert fit.target is not None
    size, keep = fit.target.batch, fit.batch
    return tree_map(lambda t: t[:keep] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size else t, out)


@dataclass
class Verdict:
    """What the proof found padding a built signature's recorded call down to smaller batches."""

    sizes: list[int] = field(default_factory=list)
    max_rel_diff: float = 0.0
    refused: str = ""


def compare(served: list[Any], eager: list[Any], batch: int, verdict: Verdict, tolerance: float) -> None:
    """Each real sample of a padded call's outputs (``served``) against eager's at its own batch, relative
    to that sample's largest value; the first one past ``tolerance`` refuses padding in ``verdict``."""
    if len(served) != len(eager):
        verdict.refused = verdict.refused or f"a padded call returned {len(served)} tensors, eager {len(eager)}"
        return
    for a, b in zip(served, eager, strict=True):
        if a.shape != b.shape:
            verdict.refused = verdict.refused or (f"a call at batch {batch} padded returned {list(a.shape)}, eager "
                                                  f"{list(b.shape)}")
            return
        if not a.is_floating_point() or not a.dim():
            continue
        for i in range(min(batch, a.shape[0])):
            scale = max(float(b[i].abs().max()), 1e-30)
            rel = float((a[i].float() - b[i].float()).abs().max()) / scale
            if not rel == rel:  # NaN
                rel = float("inf")
            verdict.max_rel_diff = max(verdict.max_rel_diff, rel)
            if rel > tolerance and not verdict.refused:
                verdict.refused = (f"padding changes a sample's output: sample {i} of a call at batch {batch} padded "
                                   f"was {rel:.2g} from eager at its own batch (relative; bound {tolerance:.0e})")
