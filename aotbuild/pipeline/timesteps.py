"""Timesteps in any dtype and rank the model treats alike (issue 56, item 1).

A scheduler hands the denoiser its timestep as int64 (DDIM, DDPM, PNDM, DPM-Solver++, UniPC, DEIS),
float32 (Euler, Heun, KDPM2, LMS) or float64 (DPM-Solver SDE), 0-d or 1-d (a pipeline that expands
it over the batch). Dtype and rank are part of a call's signature (aotbuild/dispatch.py), so a
scheduler swapped after load used to be a shape not built, decided by a dtype the user never chose.

At build, :func:`measure` runs the component eagerly on the warmup's own first call with its
timestep in each other dtype of :data:`DTYPES` and each other rank of :data:`FORMS`, at the call's own
value and at the schedule's middle and last step (a model that reads a dtype another way at only some
values is caught there), and records which give the built call's output (the entry's
``build.timestep``: :func:`check_record` is what a manifest may hold there). At a call,
:class:`Conversions` turns a timestep whose dtype or rank was not built into the built one only where
the record of the entry that serves the converted call proves that pair alike and every value is
exactly representable in the built dtype; otherwise it says why not (:meth:`Conversions.convert`). A
model that reads its timestep as an index (an embedding table) raises or differs for a float, so it is
never converted: it is refused, never served wrong. A Python number as the timestep is left alone (its
value is in the signature).

A converted call costs a lookup and a ``.to()``: what a call of a signature needs (where its timestep is,
to which dtype and rank, the converted call's signature) is planned once per signature
(:meth:`Conversions.plan`), and whether a timestep's values convert is read once per scheduler's
``set_timesteps`` (:class:`_Values`), not once per step: on an accelerator, reading a value is a
device-to-host copy that waits for the queued work.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aotbuild.utils.safeio import loads_json
from aotbuild.utils.text import printable

#: The record's layout (a manifest holding another is read as "nothing proven").
VERSION = 1
#: The dtypes a build tries the timestep in: what diffusers' schedulers hand out.
DTYPES = ("float32", "float64", "int64")
#: A timestep's rank, as pipelines pass it: 0-d (SD's ``t``), one value (``t[None]``), one per sample
#: (``t.expand(batch)``: Flux, Wan, PixArt).
FORMS = ("scalar", "one", "batch")
#: The forward's parameter that holds the timestep, in diffusers' denoisers.
NAMES = ("timestep", "timesteps")
#: The longest reason a record holds (``why``, each of ``unlike``), as every text of a manifest.
MAX_TEXT = 4096
#: Timestep values :func:`measure` tries besides the call's own, at most.
MAX_VALUES = 4
#: Call signatures whose plan a dispatcher remembers (a server sees few), and timestep tensors whose
#: values it remembers (a scheduler's, one per ``set_timesteps``), each storage at most this many bytes.
_REMEMBERED = 4096
_STORAGES = 16
_STORAGE_BYTES = 1 << 16
#: A memo's "not yet asked" (None is an answer: nothing to convert).
_UNSEEN = object()
#: Signatures are JSON of at most this size and depth (the dispatcher's bounds).
_SIG_BYTES = 1 << 16
_SIG_DEPTH = 64
#: What a refusal tells the user to do when no conversion can serve their scheduler.
DECLARE = ("declare it in the recipe (schedulers: [{name}]: the build then runs the warmup with it too) "
           "and rebuild (docs/runtime.md, \"Schedulers\")")


def form_of(shape: Any, batch: int) -> str | None:
    """The form of a timestep of ``shape`` in a call of ``batch`` samples: scalar (0-d), batch (one value
    per sample, a batch of one included), one (a single value for several samples); None for any other."""
    shape = list(shape)
    if not shape:
        return "scalar"
    if len(shape) == 1 and shape[0] == batch:
        return "batch"
    if shape == [1]:
        return "one"
    return None


def locate(module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[str, int | None] | None:
    """Where the call holds the timestep: (parameter name, index in ``args`` or None for a keyword);
    None when the forward names no timestep parameter or the call does not pass it."""
    params = parameters(module)
    return _where(params, args, kwargs) if params is not None else None


def parameters(module: Any) -> list[str] | None:
    """The names of the parameters of the module's class ``forward``, self left out (None: unreadable)."""
    try:
        return list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return None


def _where(params: list[str], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[str, int | None] | None:
    for name in NAMES:
        if name in kwargs:
            return name, None
    return next(((name, i) for i, name in enumerate(params[:len(args)]) if name in NAMES), None)


def _get(args: tuple[Any, ...], kwargs: Mapping[str, Any], where: tuple[str, int | None]) -> Any:
    name, position = where
    if position is None:
        return kwargs.get(name)
    return args[position] if position < len(args) else None


def _put(args: tuple[Any, ...], kwargs: dict[str, Any], where: tuple[str, int | None],
         value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    name, position = where
    if position is None:
        return args, {**kwargs, name: value}
    return (*args[:position], value, *args[position + 1:]), kwargs


def exact(t: Any, dtype: Any) -> bool:
    """Whether every value of ``t`` is exactly representable in ``dtype`` (there and back gives it again:
    499.5 is no int64, 16777217 no float32, NaN nothing)."""
    import torch

    try:
        return bool(torch.equal(t.to(dtype).to(t.dtype), t))
    except (RuntimeError, TypeError):
        return False


def _in_form(value: Any, form: str, batch: int, expanded: bool) -> Any:
    """A 0-d ``value`` in ``form``: 0-d, ``[1]``, or ``[batch]`` (stride 0 where the built call's is,
    as a pipeline's ``t.expand(batch)`` gives it, else dense: the layout is what a compiled graph saw)."""
    if form == "scalar":
        return value.reshape(())
    if form == "one":
        return value.reshape(1)
    return value.reshape(1).expand(batch) if expanded else value.reshape(1).repeat(batch)


def _batch(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """The call's batch: the leading size of its first tensor of at least 2 dimensions (the latents)."""
    import torch
    from torch.utils._pytree import tree_leaves

    for t in tree_leaves((args, dict(sorted(kwargs.items())))):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0])
    return 1


def _outputs(value: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _difference(a: list[Any], b: list[Any]) -> float:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.numel():
            d = (x.double() - y.double()).abs().max()
            worst = max(worst, float(d) if bool(d.isfinite()) else float("inf"))
    return worst


def measure(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tolerance: float = 0.0,
            values: Sequence[float] = ()) -> dict[str, Any]:
    """On the warmup's first call of ``module`` (eager), which dtypes (:data:`DTYPES`) and forms
    (:data:`FORMS`) of its timestep give the built call's output (bit for bit by default: "the same
    output", never a near one): the record an entry keeps (``build.timestep``). Each pair is tried at the
    call's own value and at each of ``values`` (the schedule's middle and last step, :func:`schedule_values`:
    a model whose integer and float paths agree at one value only is not proven by it), at each value or
    its rounding where it is not representable in that dtype (Euler's 499.5 as an int64 is 500's question);
    a pair is alike where every value agrees. A value the model cannot take in the built dtype is not tried
    (a probe, not the call). ``module`` must be the component's own forward (no layer of aotbuild's on it)."""
    import torch

    where = locate(module, args, kwargs)
    if where is None:
        return {"version": VERSION, "why": "the component's forward takes no timestep argument"}
    t = _get(args, kwargs, where)
    batch = _batch(args, kwargs)
    built_form = form_of(t.shape, batch) if isinstance(t, torch.Tensor) and t.numel() else None
    if built_form is None:
        return {"version": VERSION, "why": f"its {where[0]} is not a 0-d tensor or one value per sample"}
    if not bool((t == t.reshape(-1)[0]).all()):
        return {"version": VERSION, "why": f"its {where[0]} holds several values (one per sample)"}
    expanded = built_form == "batch" and batch > 1 and t.stride() == (0,)
    record: dict[str, Any] = {"version": VERSION, "name": where[0], "position": where[1],
                              "dtype": str(t.dtype).replace("torch.", ""), "form": built_form, "batch": batch,
                              "expanded": expanded, "alike": {}, "unlike": {}, "max_abs_diff": 0.0}

    def run(v: Any) -> list[Any]:
        a, k = _put(args, kwargs, where, v)
        with torch.no_grad():
            return [o.detach().clone() for o in _outputs(module(*a, **k))]

    first = t.reshape(-1)[0]
    probes = [first]
    for v in values:
        probe = torch.tensor(v, dtype=t.dtype, device=t.device) if math.isfinite(v) else None
        if probe is not None and len(probes) <= MAX_VALUES and all(not bool(probe == p) for p in probes):
            probes.append(probe)
    references: dict[tuple[int, bool], list[Any] | None] = {(0, False): run(t)}  # (probe, rounded): its output

    def reference(i: int, tried: Any, rounded: bool) -> list[Any] | None:
        if (i, rounded) not in references:
            try:
                references[i, rounded] = run(_in_form(tried, built_form, batch, expanded))
            except Exception:  # noqa: BLE001 - a probe the model does not take in the built dtype proves nothing
                if i == 0:
                    raise
                references[i, rounded] = None
        return references[i, rounded]

    forms = [f for f in FORMS if not (f == "one" and batch == 1)]
    for name in dict.fromkeys((record["dtype"], *DTYPES)):
        dtype = getattr(torch, name)
        alike, why = set(forms), ""
        for i, value in enumerate(probes):
            tried = value if exact(value, dtype) else value.round()
            if not exact(tried, dtype) or not exact(tried, t.dtype):
                if i == 0:
                    why = f"{value.item()!r} cannot be written in {name}"
                    alike = set()
                    break
                continue  # another value's rounding: not a question this dtype is asked
            expected = reference(i, tried, not exact(value, dtype))
            if expected is None:
                continue
            at = f" at {tried.item()!r}" if i else ""
            for form in forms:
                if form not in alike or (name == record["dtype"] and form == built_form):
                    continue
                try:
                    got = run(_in_form(tried.to(dtype), form, batch, expanded))
                except Exception as exc:  # noqa: BLE001 - an index the model cannot take, a shape it refuses
                    alike.discard(form)
                    first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
                    why = why or f"{form}{at}: {type(exc).__name__}: {printable(first_line)}"
                    continue
                diff = _difference(got, expected)
                if diff <= tolerance:
                    record["max_abs_diff"] = max(record["max_abs_diff"], diff)
                else:
                    alike.discard(form)
                    why = why or f"{form}{at}: the output differs by {diff:.3g}"
        if alike:
            record["alike"][name] = [f for f in forms if f in alike]
        if why:
            record["unlike"][name] = why
    # the values every pair was tried at (the built dtype's: each other's at them or their rounding)
    record["values"] = [float(p.item()) for i, p in enumerate(probes) if references.get((i, False)) is not None]
    return record


def schedule_values(pipe: Any, module: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[float]:
    """The middle and last step of the schedule ``pipe.scheduler`` holds once the pipeline has started its
    loop, as the component sees them: its first call (``args``, ``kwargs``) holds the first step, and where
    that is not the schedule's own value, a pipeline that scales timesteps (Flux divides by 1000) is followed
    by the ratio; half the first call's value where the scheduler holds no schedule. What :func:`measure`
    tries besides the first call's."""
    import torch

    where = locate(module, args, kwargs)
    t = _get(args, kwargs, where) if where is not None else None
    seen = float(t.reshape(-1)[0]) if isinstance(t, torch.Tensor) and t.numel() else None
    if seen is None or not math.isfinite(seen):
        return []
    steps = getattr(getattr(pipe, "scheduler", None), "timesteps", None)
    if not isinstance(steps, torch.Tensor) or steps.dim() != 1 or steps.numel() < 2:
        return [seen / 2]
    first = float(steps[0])
    ratio = 1.0 if first == seen else seen / first if first else None
    if ratio is None or not math.isfinite(ratio):
        return [seen / 2]
    return [float(steps[steps.numel() // 2]) * ratio, float(steps[-1]) * ratio]


def variants(conversions: Conversions, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """The call ``(args, kwargs)`` (a built one) with its timestep in each other dtype and form every
    entry proved alike, at its value or its rounding (as :func:`measure` tried them): what the proof
    serves, converted, beside eager's output for each. [(label, args, kwargs)]"""
    import torch

    where = conversions.locate(args, kwargs)
    t = _get(args, kwargs, where) if where is not None else None
    records = [r for r in conversions.records if where is not None and r["name"] == where[0]]
    if not isinstance(t, torch.Tensor) or not records or conversions.unproven or t.numel() == 0:
        return []
    batch = _batch(args, kwargs)
    value = t.reshape(-1)[0]
    out = []
    for name, forms in records[0]["alike"].items():
        dtype = getattr(torch, name)
        tried = value if exact(value, dtype) else value.round()
        for form in forms:
            if all(form in r["alike"].get(name, []) for r in records) and (name, form) != (
                    records[0]["dtype"], records[0]["form"]) and exact(tried, dtype):
                a, k = _put(args, kwargs, where, _in_form(tried.to(dtype), form, batch, form == "batch" and batch > 1))
                out.append((f"{name} {form}", a, k))
    return out


def _text(value: Any) -> bool:
    """A reason a manifest may hold: text of at most :data:`MAX_TEXT` characters, every one printable (it is
    printed into refusals and warnings: no newline, no escape sequence), as the manifest's other names."""
    return isinstance(value, str) and len(value) <= MAX_TEXT and value.isprintable()


def check_record(value: Any) -> str:
    """Why ``value`` is not a timestep record a manifest may hold (``build.timestep``), or "". A record of
    another version, or one that only says why nothing was measured, is well formed and proves nothing."""
    if not isinstance(value, dict):
        return "not an object"
    if value.get("version") != VERSION or "why" in value:
        return "" if _text(value.get("why", "")) else "why: not printable text of at most 4096 characters"
    if not isinstance(value.get("name"), str) or value["name"] not in NAMES:
        return "name: not a timestep parameter"
    position = value.get("position")
    if position is not None and (not isinstance(position, int) or isinstance(position, bool) or not 0 <= position < 64):
        return "position: not an argument index"
    if value.get("dtype") not in DTYPES + ("float16", "bfloat16", "int32"):
        return "dtype: not a timestep dtype"
    if value.get("form") not in FORMS:
        return "form: not one of " + ", ".join(FORMS)
    batch = value.get("batch")
    if not isinstance(batch, int) or isinstance(batch, bool) or not 0 < batch <= 1 << 20:
        return "batch: not a batch size"
    if not isinstance(value.get("expanded"), bool):
        return "expanded: not true or false"
    alike, unlike = value.get("alike"), value.get("unlike")
    if not isinstance(alike, dict) or not all(k in DTYPES + (value["dtype"],) and isinstance(v, list)
                                              and all(f in FORMS for f in v) for k, v in alike.items()):
        return "alike: not {dtype: [form]}"
    if not isinstance(unlike, dict) or not all(isinstance(k, str) and len(k) < 16 and _text(v)
                                               for k, v in unlike.items()):
        return "unlike: not {dtype: reason} (printable text of at most 4096 characters)"
    tried = value.get("values", [])
    if not isinstance(tried, list) or len(tried) > MAX_VALUES + 1 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in tried):
        return "values: not a list of timesteps"
    return ""


@dataclass(frozen=True)
class Refused:
    """Why a call's timestep is not converted. ``alone``: the call differs from a built signature in its
    timestep alone, so a refusal leads with this (and names the scheduler); otherwise something else
    differs too, and the refusal is the shape's."""

    why: str
    alone: bool


@dataclass(frozen=True)
class Plan:
    """How calls of one signature are converted: the timestep at ``where`` to ``dtype`` in ``form``;
    ``sig``, the converted call's signature (a converted call is not encoded again)."""

    where: tuple[str, int | None]
    dtype: Any  # the torch dtype built
    name: str  # its name ("float32")
    form: str  # the rank built
    batch: int  # the call's batch
    expanded: bool  # a one-per-sample timestep built expanded (stride 0): the graph saw that layout
    sig: str
    have: str  # the call's dtype, for a refusal
    alone: bool  # the call differs from a built signature in its timestep alone (Refused.alone)

    @property
    def words(self) -> str:
        return f"{self.name} {_FORM_WORDS[self.form]}"


@dataclass
class _Entry:
    """One entry, as conversions read it: its proof (None: none, ``why``), its signatures."""

    record: dict[str, Any] | None
    why: str
    signatures: frozenset[str]


class Conversions:
    """A dispatcher's timestep conversions, from its entries' records (``build.timestep``): a call whose
    timestep's dtype or rank is not built is converted to the built one where the record of the entry that
    serves the converted call proved the call's pair alike (every entry of that dtype and rank where the
    converted call is no built signature: padded, or a text range) and its values are exactly representable;
    otherwise :meth:`convert` says why not. A call whose timestep is as some entry built it is nothing to
    convert: whatever else differs is the refusal's business. Thread-safe (its memos are read into locals)."""

    def __init__(self, params: list[str], entries: Sequence[_Entry]):
        self.params = params  # the forward's parameters, self left out: where a call holds its timestep
        self.entries = list(entries)
        self.records = [e.record for e in self.entries if e.record is not None]  # the entries' proofs
        self.unproven = [e.why for e in self.entries if e.record is None]  # why an entry proves nothing
        self._plans: dict[str, Plan | Refused | None] = {}
        self._pairs: dict[tuple[int, tuple[str, int | None]], frozenset[tuple[str, str]]] = {}
        self._masked: dict[tuple[str, int | None], frozenset[str]] = {}
        self._values = _Values()

    @classmethod
    def of(cls, module: Any, entries: Sequence[tuple[Any, Sequence[str]]]) -> Conversions | None:
        """For ``module`` (the component itself, served at the component's scope) and its entries: each its
        record (``build.timestep``, None where it has none) and its signatures. None when the component takes
        no timestep."""
        params = parameters(module)
        if params is None or not any(name in params for name in NAMES):
            return None
        out = []
        for record, signatures in entries:
            problem = check_record(record) if record is not None else "absent"
            if not problem and "why" not in record and record.get("version") == VERSION:
                out.append(_Entry(record, "", frozenset(signatures)))
            else:
                why = (record["why"] if not problem and isinstance(record.get("why"), str) else
                       "its entry records no timestep proof (built by an aotbuild before issue 56, or a damaged "
                       "record): rebuild it")
                out.append(_Entry(None, why, frozenset(signatures)))
        return cls(params, out)

    def locate(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[str, int | None] | None:
        """Where the call holds its timestep (:func:`locate`, the parameters read once)."""
        return _where(self.params, args, kwargs)

    def convert(self, sig: str, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Plan] | Refused | None:
        """The call (of signature ``sig``, not built) with its timestep in the built dtype and rank, and its
        plan (``Plan.sig``: the converted call's signature); None where there is nothing to convert (no
        timestep, or one as built); else why it is not converted."""
        plan = self.plan(sig, args, kwargs)
        if not isinstance(plan, Plan):
            return plan
        t = _get(args, kwargs, plan.where)
        why = self._values.why_not(t, plan)
        if why:
            return Refused(why, plan.alone)
        value = t if t.dim() == 0 else t.reshape(-1)[0]
        a, k = _put(args, kwargs, plan.where, _in_form(value.to(plan.dtype), plan.form, plan.batch, plan.expanded))
        return a, k, plan

    def plan(self, sig: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Plan | Refused | None:
        """What calls of signature ``sig`` need (remembered per signature: a server sees few)."""
        found = self._plans.get(sig, _UNSEEN)
        if found is _UNSEEN:
            found = self._plan(sig, args, kwargs)
            if len(self._plans) >= _REMEMBERED:
                self._plans.clear()
            self._plans[sig] = found
        return found  # type: ignore[return-value]

    def _plan(self, sig: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Plan | Refused | None:
        import torch

        where = self.locate(args, kwargs)
        t = _get(args, kwargs, where) if where is not None else None
        if where is None or not isinstance(t, torch.Tensor) or not t.numel():
            return None
        batch = _batch(args, kwargs)
        form = form_of(t.shape, batch)
        if form is None:
            return None
        have = (str(t.dtype).replace("torch.", ""), form)
        holding = [(e, pairs) for i, e in enumerate(self.entries) if (pairs := self._built_pairs(i, where))]
        if not holding:
            return None  # no entry takes a timestep there
        alone = _masked(sig, where) in self._built_masked(where)
        data = loads_json(sig, max_bytes=_SIG_BYTES, max_depth=_SIG_DEPTH)
        device = t.device.type

        def proven(e: _Entry) -> bool:
            return e.record is not None and e.record["name"] == where[0]

        # the converted call is an entry's built signature: that entry's record decides (another entry,
        # proven or not, has no say in a call it does not serve)
        measured = dict.fromkeys((e.record["dtype"], e.record["form"]) for e, _ in holding if proven(e))
        for pair in measured:
            converted = _converted(data, where, pair, batch, device)
            owners = [e for e, _ in holding if converted in e.signatures]
            if owners and pair != have:
                return self._decide(have, pair, owners, converted, batch, where, alone)
        if any(have in pairs for _, pairs in holding):
            return None  # a timestep as an entry built it: whatever else differs, it is not the timestep
        # otherwise (padded to a built batch, a text range, or not built at all) every entry of that pair
        targets = {p for e, pairs in holding for p in (
            [(e.record["dtype"], e.record["form"])] if proven(e) else pairs)}  # type: ignore[index]
        if len(targets) != 1:
            shown = ", ".join(f"{d} {_FORM_WORDS[f]}" for d, f in sorted(targets))
            return Refused(f"the entries were built for timesteps of different dtypes or ranks ({shown})", alone)
        pair, = targets
        return self._decide(have, pair, [e for e, _ in holding], _converted(data, where, pair, batch, device),
                            batch, where, alone)

    def _decide(self, have: tuple[str, str], pair: tuple[str, str], entries: list[_Entry], converted: str,
                batch: int, where: tuple[str, int | None], alone: bool) -> Plan | Refused:
        """Convert ``have`` to ``pair`` where every one of ``entries`` proved it, else why not."""
        import torch

        built_words = f"{pair[0]} {_FORM_WORDS[pair[1]]}"
        called = f"its timestep is {have[0]} {_FORM_WORDS[have[1]]}, the entry was built for {built_words}, and "
        for e in entries:
            if e.record is None or e.record["name"] != where[0]:
                return Refused(e.why or f"its entry's proof measured {e.record and e.record['name']}, not "
                                        f"{where[0]}: rebuild it", alone)
            forms = e.record["alike"].get(have[0], [])
            if have[1] in forms:
                continue
            unlike = e.record["unlike"].get(have[0])
            if not forms:
                return Refused(called + f"the build's proof found the model reads {have[0]} timesteps differently"
                               + (f" ({unlike})" if unlike else ""), alone)
            return Refused(called + f"the build proved {have[0]} alike only as "
                                    f"{', '.join(_FORM_WORDS[f] for f in forms)}", alone)
        # a pipeline's t.expand(batch) is recorded expanded at a batch above 1 only (issue 56: buckets [1, N])
        expanded = pair[1] == "batch" and batch > 1 and any(e.record is not None and e.record["expanded"]
                                                            for e in entries)
        return Plan(where, getattr(torch, pair[0]), pair[0], pair[1], batch, expanded, converted, have[0], alone)

    def _built_pairs(self, i: int, where: tuple[str, int | None]) -> frozenset[tuple[str, str]]:
        """The (dtype, form) of the timestep at ``where`` in entry ``i``'s signatures."""
        key = (i, where)
        found = self._pairs.get(key)
        if found is None:
            pairs = set()
            for sig in self.entries[i].signatures:
                try:
                    data = loads_json(sig, max_bytes=_SIG_BYTES, max_depth=_SIG_DEPTH)
                    value = _at(data, where)
                except (ValueError, KeyError, IndexError, TypeError):
                    continue
                if _is_tensor(value):
                    form = form_of(value[1], _sig_batch(data))
                    if form is not None:
                        pairs.add((str(value[2]), form))
            found = frozenset(pairs)
            self._pairs[key] = found
        return found

    def _built_masked(self, where: tuple[str, int | None]) -> frozenset[str]:
        """Every entry's signatures with the timestep at ``where`` left out (:func:`_masked`)."""
        found = self._masked.get(where)
        if found is None:
            found = frozenset(m for e in self.entries for sig in e.signatures if (m := _masked(sig, where)))
            self._masked[where] = found
        return found


class _Values:
    """Whether a timestep's values convert (one value per call, each exactly representable in the built
    dtype), read once per tensor of values rather than once per call: a scheduler's timestep is a view of its
    ``timesteps`` (``timesteps[i]``), so on an accelerator one device-to-host copy per ``set_timesteps``
    serves every step (each read waits for the queued work). An answer is never reused for other values: it
    is kept per storage (its address and size), per the tensor's version counter (every in-place write bumps
    it) and per view (offset, shape, strides); and the memo holds the storage, so that its address is not
    given to another tensor while it is remembered. A scheduler that makes a new tensor each step (a CPU one
    included) reads each one once. An inference tensor (no version counter) or a large storage is read at
    every call. Bounded; thread-safe (an answer is returned from a local)."""

    def __init__(self) -> None:
        self._storages: dict[tuple[Any, ...], tuple[Any, Any, dict[tuple[Any, ...], str]]] = {}
        self.reads = 0  # values read (on an accelerator, each a device-to-host copy): counted for the tests

    def why_not(self, t: Any, plan: Plan) -> str:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # a tensor without one (sparse, a subclass)
            storage = None
        if storage is None or t.is_inference() or storage.nbytes() > _STORAGE_BYTES:
            self.reads += 1
            return _why_not(t.detach().cpu(), plan)
        key = (t.device, storage.data_ptr(), storage.nbytes(), t.dtype, t._version)
        found = self._storages.get(key)
        if found is None:
            import torch

            whole = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                storage, 0, (storage.nbytes() // t.element_size(),), (1,))
            found = (t, whole.detach().cpu(), {})  # ``t``: keeps the storage, and so its address, while remembered
            self.reads += 1
            if len(self._storages) >= _STORAGES:
                self._storages.clear()
            self._storages[key] = found
        _, host, answers = found
        view = (t.storage_offset(), tuple(t.shape), t.stride(), plan.name, plan.form)
        why = answers.get(view)
        if why is None:
            why = _why_not(host.as_strided(t.shape, t.stride(), t.storage_offset()), plan)
            answers[view] = why
        return why


def _why_not(values: Any, plan: Plan) -> str:
    """Why a timestep of ``values`` (on the host) is not converted by ``plan`` ("" where it is)."""
    import torch

    flat = values.reshape(-1)
    if flat.numel() > 1 and not bool((flat == flat[0]).all()):
        return (f"its timestep holds one value per sample ({_values(values)}), and the entry was built for one "
                f"value per call ({plan.words})")
    if not exact(flat[:1], getattr(torch, plan.name)):
        return (f"its timestep {_values(values)} ({plan.have}) cannot be written exactly in {plan.name}, the dtype "
                f"the entry was built for")
    return ""


def _is_tensor(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 4 and value[0] == "tensor" and isinstance(value[1], list)


def _at(data: dict[str, Any], where: tuple[str, int | None]) -> Any:
    """A decoded signature's value of the argument at ``where`` (KeyError, IndexError where it has none)."""
    name, position = where
    return data["kwargs"][name] if position is None else data["args"][position]


def _sig_batch(data: dict[str, Any]) -> int:
    """A decoded signature's batch, as :func:`_batch` reads a call's: its first tensor of 2 dimensions or more."""
    def walk(v: Any) -> int | None:
        if _is_tensor(v):
            return v[1][0] if len(v[1]) >= 2 and isinstance(v[1][0], int) else None
        for x in v.values() if isinstance(v, dict) else v if isinstance(v, list) else ():
            found = walk(x)
            if found is not None:
                return found
        return None

    found = walk(data.get("args", []))
    found = found if found is not None else walk(data.get("kwargs", {}))
    return found if found is not None else 1


def _masked(sig: str, where: tuple[str, int | None]) -> str:
    """``sig`` with the argument at ``where`` left out ("" where it has none there or is not a signature): two
    calls that differ in their timestep alone have the same."""
    try:
        data = loads_json(sig, max_bytes=_SIG_BYTES, max_depth=_SIG_DEPTH)
        _at(data, where)
    except (ValueError, KeyError, IndexError, TypeError):
        return ""
    name, position = where
    if position is None:
        data["kwargs"][name] = ["timestep"]
    else:
        data["args"][position] = ["timestep"]
    return json.dumps(data, sort_keys=True)


def _converted(data: dict[str, Any], where: tuple[str, int | None], pair: tuple[str, str], batch: int,
               device: str) -> str:
    """The signature of a call of decoded signature ``data`` with its timestep converted to ``pair`` (the
    dispatcher's encoding, aotbuild/dispatch.py ``signature``: the same JSON, sorted keys)."""
    shape = {"scalar": [], "one": [1], "batch": [batch]}[pair[1]]
    data = json.loads(json.dumps(data))
    value = ["tensor", shape, pair[0], device]
    name, position = where
    if position is None:
        data["kwargs"][name] = value
    else:
        data["args"][position] = value
    return json.dumps(data, sort_keys=True)


def _values(t: Any) -> str:
    shown = ", ".join(repr(v) for v in t.reshape(-1)[:3].tolist())
    return f"[{shown}{', ...' if t.numel() > 3 else ''}]" if t.dim() else shown


_FORM_WORDS = {"scalar": "0-d", "one": "1-d of one value for the batch", "batch": "1-d, one per sample"}


def scheduler_of(pipe: Any) -> str:
    """``pipe.scheduler``'s class name, or ""."""
    scheduler = getattr(pipe, "scheduler", None)
    return type(scheduler).__name__ if scheduler is not None else ""
