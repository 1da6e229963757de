"""Text length as a shape: which input dimensions of a component follow the prompt, and serving a range.

Pipelines with an LLM text encoder (QwenImage, CogView4, ...) pad the text to the batch's longest
prompt or to a multiple, not to a fixed length as CLIP (77) and T5 (``max_sequence_length``) do: the
denoiser's text dimension is then the prompt's length, and a static build serves one prompt (issue
34). Nothing here names a pipeline class: a build *measures* it (:func:`detect`): the pipeline is
called with the warmup's prompt and with a longer one, each call stopped at the component's first
call, and the two call signatures (aotbuild/dispatch.py) are compared; a tensor dimension that
differs is prompt-dependent.

With the recipe's ``text_length: {min, max}``, those dimensions become one *text pattern*: the
signature with each such size written ``"text:MIN-MAX"``. A dispatcher that holds a pattern routes
every call whose signature equals it but for a text size inside the range to the pattern's route,
and marks those dimensions dynamic in that range (Dynamo's ``mark_dynamic(t, dim, min, max)``)
before the call, at build and at load alike, so both trace the same symbolic graph and the load
hits the compiler's cache. A pattern is plain text inside the signature: an entry's signatures say
what range it serves, and a load needs nothing else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: How a text dimension is written in a signature's tensor shape.
_MARK = re.compile(r"^text:([0-9]+)-([0-9]+)\Z")
#: Words added to the warmup's prompt for the second, longer probe.
LONGER = " with a small red cat and a big blue dog in the photo"


def mark(lo: int, hi: int) -> str:
    return f"text:{lo}-{hi}"


def _range(value: Any) -> tuple[int, int] | None:
    if not isinstance(value, str):
        return None
    found = _MARK.match(value)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _is_tensor(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 4 and v[0] == "tensor" and isinstance(v[1], list)


@dataclass(frozen=True)
class TextDim:
    """One prompt-dependent dimension: where it is in the call (``encoder_hidden_states``, ``arg[0]``),
    its index, and the sizes the two probes saw."""

    path: str
    dim: int
    sizes: tuple[int, int]

    def __str__(self) -> str:
        return f"{self.path}[dim {self.dim}]"


def compare(sig_a: str, sig_b: str) -> tuple[list[TextDim], str]:
    """The tensor dimensions in which two signatures of the same call differ, and "" ; or ([], why)
    when they differ in anything else (an argument present in one only, a dtype, a non-tensor value):
    then the text length is not just a size of the call."""
    from aotbuild.utils.safeio import loads_json

    # this process's own signatures of the build's calls, parsed with the bounds of a manifest's (Pattern)
    a, b = (loads_json(s, max_bytes=1 << 16, max_depth=64) for s in (sig_a, sig_b))
    dims: list[TextDim] = []
    why: list[str] = []

    def walk(path: str, x: Any, y: Any) -> None:
        if _is_tensor(x) and _is_tensor(y):
            if len(x[1]) != len(y[1]) or x[2:] != y[2:]:
                why.append(f"{path or 'an input'} changes rank or dtype")
                return
            dims.extend(TextDim(path, i, (p, q)) for i, (p, q) in enumerate(zip(x[1], y[1], strict=True)) if p != q)
        elif isinstance(x, dict) and isinstance(y, dict):
            if set(x) != set(y):
                why.append(f"the arguments differ ({', '.join(sorted(set(x) ^ set(y)))})")
                return
            for k in x:
                walk(k if not path else f"{path}.{k}", x[k], y[k])
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y) and not _is_tensor(x):
            for i, (p, q) in enumerate(zip(x, y, strict=True)):
                walk(f"{path}[{i}]" if path else f"arg[{i}]", p, q)
        elif x != y:
            why.append(f"{path or 'an argument'} is {json.dumps(x)[:40]} and {json.dumps(y)[:40]}")

    walk("", a["args"], b["args"])
    walk("", a["kwargs"], b["kwargs"])
    return ([], "; ".join(why)) if why else (dims, "")


def generalize(sig: str, dims: list[TextDim], lo: int, hi: int) -> str:
    """``sig`` with each of ``dims`` written as the range: the pattern's signature."""
    from aotbuild.utils.safeio import loads_json

    data = loads_json(sig, max_bytes=1 << 16, max_depth=64)
    chosen = {(d.path, d.dim) for d in dims}

    def walk(path: str, x: Any) -> Any:
        if _is_tensor(x):
            return ["tensor", [mark(lo, hi) if (path, i) in chosen else n for i, n in enumerate(x[1])], *x[2:]]
        if isinstance(x, dict):
            return {k: walk(k if not path else f"{path}.{k}", v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(f"{path}[{i}]" if path else f"arg[{i}]", v) for i, v in enumerate(x)]
        return x

    return json.dumps({"args": walk("", data["args"]), "kwargs": walk("", data["kwargs"])}, sort_keys=True)


def lengths(pattern: Any, call: Any) -> list[int] | None:
    """The text sizes of ``call`` (a signature's data) where it fits ``pattern`` (another's) but for
    those sizes, whatever their value; None where it does not fit."""
    found: list[int] = []

    def walk(p: Any, c: Any) -> bool:
        if _is_tensor(p):
            if not _is_tensor(c) or len(p[1]) != len(c[1]) or p[2:] != c[2:]:
                return False
            for want, got in zip(p[1], c[1], strict=True):
                if _range(want) is not None and isinstance(got, int):
                    found.append(got)
                elif want != got:
                    return False
            return True
        if isinstance(p, dict):
            return isinstance(c, dict) and set(p) == set(c) and all(walk(p[k], c[k]) for k in p)
        if isinstance(p, list):
            return isinstance(c, list) and len(p) == len(c) and all(walk(x, y) for x, y in zip(p, c, strict=True))
        return p == c

    return found if walk(pattern, call) else None


class Pattern:
    """A built signature with text dimensions: which calls it serves, and marking them dynamic."""

    def __init__(self, sig: str) -> None:
        from aotbuild.utils.safeio import loads_json

        self.sig = sig
        # a built signature is read back from a manifest: parsed with bounded size and depth
        self.data = loads_json(sig, max_bytes=1 << 16, max_depth=64)
        ranges: set[tuple[int, int]] = set()

        def walk(x: Any) -> None:
            if _is_tensor(x):
                ranges.update(r for r in map(_range, x[1]) if r is not None)
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)

        walk(self.data)
        if not ranges or not isinstance(self.data, dict) or {"args", "kwargs"} - set(self.data):
            raise ValueError("not a text pattern")
        self.lo, self.hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
        #: a static build's length, known to follow the prompt: never serves, only names a refused length
        self.static = False

    @classmethod
    def of(cls, sig: str) -> Pattern | None:
        """The pattern a built signature holds, or None (no text range in it, or not a signature)."""
        if '"text:' not in sig:
            return None
        try:
            return cls(sig)
        except ValueError:
            return None

    def sizes(self, call_sig: str) -> list[int] | None:
        """The call's text sizes where it is this pattern but for them (in range or not), else None."""
        return lengths(self.data, json.loads(call_sig))

    def serves(self, call_sig: str) -> bool:
        found = self.sizes(call_sig)
        return bool(found) and len(set(found)) == 1 and self.lo <= found[0] <= self.hi

    def mark_dynamic(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Mark each text dimension of the call's tensors dynamic in the range (before Dynamo sees it)."""
        from torch._dynamo import mark_dynamic

        def walk(p: Any, value: Any) -> None:
            if _is_tensor(p):
                for i, size in enumerate(p[1]):
                    if _range(size) is not None:
                        mark_dynamic(value, i, min=self.lo, max=self.hi)
            elif isinstance(p, dict) and isinstance(value, dict):
                for k, v in p.items():
                    walk(v, value.get(k))
            elif isinstance(p, list) and isinstance(value, (list, tuple)):
                for x, y in zip(p, value, strict=False):
                    walk(x, y)

        walk(self.data["args"], list(args))
        walk(self.data["kwargs"], kwargs)


def patterns(sigs: Any) -> list[Pattern]:
    return [p for p in map(Pattern.of, sigs) if p is not None]


_DIM = re.compile(r"^(.{1,200})\[dim ([0-9]{1,2})\]\Z")


def static_patterns(sigs: Any, measured: list[Any]) -> list[Pattern]:
    """For a static build of a component whose text follows the prompt (a manifest's ``build.text``:
    ``prompt_dependent`` dimensions and the warmup's length, without a range): each built signature
    with those dimensions at that length, as a pattern that only names a refused call's prompt length."""
    out: list[Pattern] = []
    for text in measured:
        if not isinstance(text, dict) or not isinstance(text.get("warmup_length"), int):
            continue
        dims = [TextDim(m.group(1), int(m.group(2)), (text["warmup_length"],) * 2)
                for d in text.get("prompt_dependent") or [] if isinstance(d, str) and (m := _DIM.match(d))]
        for sig in sigs:
            if not dims or '"text:' in sig:
                continue
            n = text["warmup_length"]
            pattern = Pattern.of(generalize(sig, dims, n, n))
            found = pattern.sizes(sig) if pattern is not None else None
            if pattern is not None and found and set(found) == {n}:  # this signature is the warmup's length
                pattern.static = True
                out.append(pattern)
    return out


def outside(pats: list[Pattern], call_sig: str) -> tuple[int, Pattern] | None:
    """The text length of a call that fits a pattern but for a length outside its range."""
    for p in pats:
        found = p.sizes(call_sig)
        if found:
            return max(found, key=lambda n: 0 if p.lo <= n <= p.hi else 1), p
    return None


def refusal(component: str, n: int, p: Pattern, policy: str = "strict_shapes=True") -> str:
    """What a strict dispatcher says of a prompt whose length the entry does not serve (``policy``: the
    refusing policy in the user's words, aotbuild/pipeline/callterms.py)."""
    if p.static:
        return (f"{component} was called with a prompt of {n} tokens (the text length the pipeline passes it), "
                f"and this cache serves only the warmup's prompt length ({p.lo} tokens, {policy}): "
                f"this pipeline's text length follows the prompt; add text_length: {{min: 2, max: 512}} to the "
                f"recipe and rebuild to serve every length in that range (docs/recipes.md, \"Prompts and text "
                f"length\")")
    return (f"{component} was called with a prompt of {n} tokens (the text length the pipeline passes it), "
            f"outside the text_length this cache built ({p.lo} to {p.hi}, {policy}): shorten the "
            f"prompt, or raise text_length in the recipe and rebuild")


# -- measuring, in a build job ------------------------------------------------------------------

def probe(pipe: Any, module: Any, call: dict[str, Any], signature: Callable[..., str]) -> str:
    """The signature (``signature``: aotbuild/dispatch.py's) of the component's first call when the
    pipeline is called with ``call`` (forwards.first_call)."""
    from aotbuild import forwards

    return signature(*forwards.first_call(pipe, module, call))


def longer(call: dict[str, Any]) -> dict[str, Any] | None:
    """The call with every prompt made longer (a list: each item), or None without a prompt."""
    from aotbuild.constants import PROMPT_ARGUMENTS

    out = dict(call)
    changed = False
    for name in PROMPT_ARGUMENTS:
        value = out.get(name)
        if isinstance(value, str):
            out[name], changed = value + LONGER, True
        elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            out[name], changed = [v + LONGER for v in value], True
    return out if changed else None


@dataclass(frozen=True)
class Measured:
    """What the probes found: the prompt-dependent dimensions (none: the text length is fixed), the
    warmup's signature, and why the two calls could not be compared (then ``dims`` is empty)."""

    dims: tuple[TextDim, ...]
    warmup_sig: str
    why: str = ""

    @property
    def length(self) -> int | None:
        """The warmup's text length (its first dimension's size), or None."""
        return self.dims[0].sizes[0] if self.dims else None

    def as_json(self) -> dict[str, Any]:
        return {"prompt_dependent": [str(d) for d in self.dims],
                **({"warmup_length": self.length} if self.dims else {}), **({"why": self.why} if self.why else {})}


def detect(pipe: Any, module: Any, warmup: dict[str, Any], signature: Callable[..., str]) -> Measured:
    """Measure which of the component's input dimensions follow the prompt (two probes)."""
    first = probe(pipe, module, warmup, signature)
    other = longer(warmup)
    if other is None:
        return Measured((), first, "the pipeline call has no prompt")
    dims, why = compare(first, probe(pipe, module, other, signature))
    return Measured(tuple(dims), first, why)


def resized(value: Any, dims: list[tuple[Any, int]], n: int) -> Any:
    """A copy of a call's tensor with dimension ``dim`` made ``n`` long: its own values repeated along
    it, then cut (a mask of ones stays ones, embeddings stay embeddings): a call at another length."""
    import torch

    out = value
    for _, dim in dims:
        reps = -(-n // out.shape[dim])
        tiles = [1] * out.dim()
        tiles[dim] = reps
        out = out.repeat(*tiles).narrow(dim, 0, n)
    # Dense, in the canonical strides a pipeline's torch.stack/cat gives (``.contiguous()`` would keep
    # a size-1 batch dimension's stride, and Dynamo guards the strides of a dynamic dimension).
    return torch.empty(tuple(out.shape), dtype=out.dtype, device=out.device).copy_(out)


def call_at(p: Pattern, args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> tuple[tuple[Any, ...], dict]:
    """The recorded call ``(args, kwargs)`` with every text dimension of ``p`` made ``n`` long."""

    def walk(pat: Any, value: Any) -> Any:
        if _is_tensor(pat):
            text = [i for i, size in enumerate(pat[1]) if _range(size) is not None]
            return resized(value, [(None, i) for i in text], n) if text else value
        if isinstance(pat, dict) and isinstance(value, dict):
            return {k: walk(pat.get(k), v) for k, v in value.items()}
        if isinstance(pat, list) and isinstance(value, (list, tuple)):
            items = [walk(x, y) for x, y in zip(pat, value, strict=False)]
            return type(value)(items) if isinstance(value, tuple) else items
        return value

    return tuple(walk(p.data["args"], list(args))), walk(p.data["kwargs"], kwargs)


def proof_lengths(lo: int, hi: int) -> list[int]:
    """The lengths a proof replays: both ends of the range and its middle."""
    return sorted({lo, (lo + hi) // 2, hi})


# -- what plan says ------------------------------------------------------------------------------

def plan_note(limits: Any, component: str, measured: Any) -> dict[str, Any]:
    """What ``plan`` says of one job's text length: whether the component's input follows the prompt
    (True, False, or None: not measured yet, a build measures it), how the recipe serves it, and a
    warning with the fix where a prompt other than the warmup's would compile (or, with
    ``strict_shapes``, be refused). ``limits``: the recipe's ``text_length`` or None; ``measured``:
    the ``text`` record a build of this component wrote into its manifest (``build.text``), or None."""
    from aotbuild.utils.text import printable

    dims = measured.get("prompt_dependent") if isinstance(measured, dict) else None
    follows = None if not isinstance(dims, list) else bool(dims)
    shown = ", ".join(printable(str(d))[:60] for d in (dims or [])[:4])
    note: dict[str, Any] = {"follows_prompt": follows, "dims": [printable(str(d))[:60] for d in (dims or [])[:4]]}
    if limits is not None:
        note["served"] = f"text lengths {limits.min} to {limits.max} (text_length)"
        if follows is False:
            note["warning"] = (f"{component}: text_length is set, but no input of {component} follows the prompt "
                               f"(measured by a build): its build fails; remove text_length")
        return note
    if follows is None:
        note["served"] = "not measured yet (a build measures whether the text length follows the prompt)"
    elif follows:
        length = measured.get("warmup_length")
        at = f" ({length} tokens)" if isinstance(length, int) else ""
        note["served"] = f"the warmup's text length only{at}"
        note["warning"] = (f"{component}'s text input follows the prompt ({shown}, measured by a build): this "
                           f"recipe serves only the warmup's prompt length{at}, and any other prompt compiles "
                           f"(with strict_shapes=True it is refused); fix: add text_length: {{min: 2, max: 512}} "
                           f"to the recipe (strategy jit-cache), docs/recipes.md, \"Prompts and text length\"")
    else:
        note["served"] = "every prompt (the pipeline pads the text to a fixed length)"
    return note
