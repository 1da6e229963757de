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
#: A memo's "not yet asked" (None is an answer: the call's batch is not what differs).
_UNSEEN = object()


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
    images: int  # images per call: the shape's batch_size times the warmup's prompts (guidance may double the batch)
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
        """From the component's entries: (key, shape label, images per call (the shape's batch_size times the
        warmup's prompts), signatures, the proof's padding record or None)."""
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
        differs from the built ones (remembered per signature). Thread-safe: the answer is returned from a
        local, never read back from the memo, which another thread may have cleared in between."""
        found = self._fits.get(sig, _UNSEEN)
        if found is _UNSEEN:
            found = self._fit(sig)
            if len(self._fits) >= _REMEMBERED:
                self._fits.clear()
            self._fits[sig] = found
        return found  # type: ignore[return-value]

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
    """Rows of the component's batch per image of the call, as the pipeline called it at build (2:
    guidance's two halves in one batch), where every built size agrees; else 1. ``Built.images`` counts
    the call's images (prompts times images per prompt): a 2-prompt warmup of 3 images each without
    guidance is a batch of 6 for 6 images, ratio 1."""
    ratios = {b.batch // b.images for b in group if b.images and b.batch % b.images == 0}
    return ratios.pop() if len(ratios) == 1 else 1


def _images(batch: int, group: Sequence[Built]) -> str:
    """A batch of the component in the caller's terms: images per call (with the component's batch where
    the pipeline calls it with more rows than images: guidance's two halves in one batch)."""
    r = _ratio(group)
    if batch % r:
        return f"a batch of {batch}"
    n = batch // r
    rows = "guidance's two halves" if r == 2 else f"{r} rows per image"
    return f"{n} image{'s' if n != 1 else ''} per call" + (f" (batch {batch}: {rows})" if r > 1 else "")


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


def pad_other(args: tuple[Any, ...], kwargs: dict[str, Any], fit: Fit) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's inputs padded to ``fit.target``'s batch with rows unlike :func:`pad`'s copies: the proof's
    exact check that the real samples do not see the padding (:func:`other_rows`)."""
    assert fit.target is not None
    size = fit.target.batch
    return _apply(args, kwargs, fit.inputs, lambda t: other_rows(t, size))


def other_rows(t: Any, batch: int) -> Any:
    """``t`` grown to ``batch`` rows unlike copies of its own: a floating input by its row of the largest
    magnitude times -3 (a sum, a mean, a max or a dynamic quantization's scale over the batch then moves,
    where copies of a real row can leave a max as it was), any other by copies of its first row."""
    import torch

    n = t.shape[0]
    if t.is_floating_point() or t.is_complex():
        k = int(t.reshape(n, -1).abs().amax(dim=1).argmax()) if t.numel() else 0
        row = t[k:k + 1] * -3
    else:
        row = t[:1]
    return torch.cat([t, row.expand(batch - n, *t.shape[1:])])


def take(args: tuple[Any, ...], kwargs: dict[str, Any], inputs: tuple[Path, ...],
         batch: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's first ``batch`` samples (the proof's smaller calls)."""
    return _apply(args, kwargs, inputs, lambda t: t[:batch])


def _leaves(value: Any) -> list[Any]:
    """An output's leaves: the tensors of a tuple, a dict or a diffusers output class (pytree nodes), None
    where it holds one, and anything torch cannot see into as itself."""
    from torch.utils._pytree import tree_leaves

    return tree_leaves(value)


def output_problem(out: Any, batch: int) -> str:
    """Why the output of a call padded to ``batch`` cannot be cut back to the call's samples ("" where it
    can): every leaf must be a tensor whose leading dimension is ``batch`` (None aside). A 0-d or other
    result computed over the batch (a mean, a count) holds the padding; an object torch cannot see into
    would come back with its padding rows; an output without a tensor holds nothing to cut."""
    import torch

    leaves = _leaves(out)
    for i, x in enumerate(leaves):
        where = f"output {i + 1} of {len(leaves)}"
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            return (f"its {where} is of type {type(x).__name__}, not a tensor or an output class torch's pytree "
                    f"reads: a padded call's rows cannot be cut from it")
        if x.dim() == 0 or x.shape[0] != batch:
            return (f"its {where} is {list(x.shape) if x.dim() else '0-d'} ({str(x.dtype).replace('torch.', '')}), "
                    f"not one row per sample of the padded batch ({batch}): it may be computed over the batch")
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        return f"its output ({type(out).__name__}) holds no tensor: a padded call's rows cannot be cut from it"
    return ""


def unpad(out: Any, fit: Fit) -> Any:
    """The output of a padded call without its padding rows: every tensor of the padded batch cut to the
    call's (tuples, dicts and diffusers' outputs alike). Any other leaf (a 0-d result, an object) would hold
    the padding: RuntimeError, never served (the entry's proof refuses padding to such a model:
    :func:`output_problem`)."""
    import torch
    from torch.utils._pytree import tree_map

    assert fit.target is not None
    size, keep = fit.target.batch, fit.batch

    def cut(t: Any) -> Any:
        if t is None:
            return t
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == size:
            return t[:keep]
        raise RuntimeError(f"aotbuild: a call padded from batch {keep} to {size} returned "
                           f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}, which holds the "
                           f"padding and cannot be cut back to the call's samples; its entry's proof did not see such "
                           f"an output")

    return tree_map(cut, out)


@dataclass
class Verdict:
    """What the proof found padding a built signature's recorded call down to smaller batches."""

    sizes: list[int] = field(default_factory=list)
    max_rel_diff: float = 0.0
    refused: str = ""

    def refuse(self, why: str) -> None:
        """The first reason found refuses padding (the others follow from it, or add nothing)."""
        self.refused = self.refused or why


#: What a relative difference is recorded as where it is not finite (a manifest holds finite numbers).
_WORST = 1e300


def compare(served: Any, eager: Any, batch: int, verdict: Verdict, tolerance: float) -> None:
    """Each real sample of a padded call's output (``served``, cut to the call's batch) against eager's at its
    own batch, leaf by leaf: a floating tensor per sample, relative to that sample's largest value, within
    ``tolerance``; an integer or boolean one exactly; a 0-d one whole (a padded call returns none: the
    proof refused it first, :func:`output_problem`). The first one past refuses padding in ``verdict``."""
    import torch

    a, b = _leaves(served), _leaves(eager)
    if len(a) != len(b):
        verdict.refuse(f"a padded call returned {len(a)} outputs, eager {len(b)}")
        return
    for x, y in zip(a, b, strict=True):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            if not (x is None and y is None):
                verdict.refuse(f"a call at batch {batch} padded returned {type(x).__name__}, eager {type(y).__name__}")
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            verdict.refuse(f"a call at batch {batch} padded returned {list(x.shape)} {x.dtype}, eager {list(y.shape)} "
                           f"{y.dtype}")
            return
        rows = [(f"sample {i}", x[i], y[i]) for i in range(min(batch, x.shape[0]))] if x.dim() else [("0-d", x, y)]
        for label, p, q in rows:
            if p.is_floating_point() or p.is_complex():
                scale = max(float(q.abs().max()), 1e-30) if q.numel() else 1.0
                d = float((p.double() - q.double()).abs().max()) if p.numel() else 0.0
                rel = d / scale if d == d and d != float("inf") else float("inf")
            else:  # integers and booleans: exactly
                rel = 0.0 if torch.equal(p, q) else float("inf")
            verdict.max_rel_diff = max(verdict.max_rel_diff, min(rel, _WORST))
            if rel > tolerance:
                verdict.refuse(f"padding changes a sample's output: {label} of a call at batch {batch} padded was "
                               f"{rel:.2g} from eager at its own batch (relative; bound {tolerance:.0e})")


def _bits(t: Any) -> Any:
    import torch

    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def first_difference(x: Any, y: Any, batch: int) -> str:
    """Where two outputs of calls at one batch size differ in their first ``batch`` rows, bit for bit ("" where
    they do not): what the proof's exact check compares, eager with two paddings of one call."""
    import torch

    a, b = _leaves(x), _leaves(y)
    if len(a) != len(b):
        return f"{len(a)} outputs against {len(b)}"
    for i, (p, q) in enumerate(zip(a, b, strict=True)):
        if not (isinstance(p, torch.Tensor) and isinstance(q, torch.Tensor)):
            if isinstance(p, torch.Tensor) or isinstance(q, torch.Tensor) or p != q:
                return f"output {i + 1}"
            continue
        if p.shape != q.shape or p.dtype != q.dtype:
            return f"output {i + 1}'s shape"
        for row in range(min(batch, p.shape[0]) if p.dim() else 0):
            if not torch.equal(_bits(p[row]), _bits(q[row])):
                return f"sample {row}" + (f" of output {i + 1}" if len(a) > 1 else "")
        if not p.dim() and not torch.equal(_bits(p), _bits(q)):
            return f"output {i + 1} (0-d)"
    return ""
