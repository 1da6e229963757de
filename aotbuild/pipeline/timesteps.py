"""Timesteps in any dtype and rank the model treats alike (issue 56, item 1).

A scheduler hands the denoiser its timestep as int64 (DDIM, DDPM, PNDM, DPM-Solver++, UniPC, DEIS),
float32 (Euler, Heun, KDPM2, LMS) or float64 (DPM-Solver SDE), 0-d or 1-d (a pipeline that expands
it over the batch). Dtype and rank are part of a call's signature (aotbuild/dispatch.py), so a
scheduler swapped after load used to be a shape not built, decided by a dtype the user never chose.

At build, :func:`measure` runs the component eagerly on the warmup's own first call with its
timestep in each other dtype of :data:`DTYPES` and each other rank of :data:`FORMS`, and records
which give the built call's output (the entry's ``build.timestep``: :func:`check_record` is what a
manifest may hold there). At a call, :class:`Conversions` turns a timestep whose dtype or rank was
not built into the built one only where the entry's record proves that pair alike and every value
is exactly representable in the built dtype; otherwise it says why not (:meth:`Conversions.convert`).
A model that reads its timestep as an index (an embedding table) raises or differs for a float, so
it is never converted: it is refused, never served wrong. A Python number as the timestep is left
alone (its value is in the signature).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

#: The record's layout (a manifest holding another is read as "nothing proven").
VERSION = 1
#: The dtypes a build tries the timestep in: what diffusers' schedulers hand out.
DTYPES = ("float32", "float64", "int64")
#: A timestep's rank, as pipelines pass it: 0-d (SD's ``t``), one value (``t[None]``), one per sample
#: (``t.expand(batch)``: Flux, Wan, PixArt).
FORMS = ("scalar", "one", "batch")
#: The forward's parameter that holds the timestep, in diffusers' denoisers.
NAMES = ("timestep", "timesteps")
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


class _Probed(Exception):
    """Stops the pipeline at the component's first call."""


def first_call(pipe: Any, module: Any, call: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The component's first call when the pipeline is called with ``call``: the pipeline runs up to that
    call, which is stopped before it runs (its inputs, as the pipeline made them: stopped there, it
    changes none of them again)."""
    from aotbuild import forwards

    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def stop(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        raise _Probed

    forwards.wrap(module, forwards.PROBE, lambda _inner: stop)
    try:
        pipe(**call)
    except _Probed:
        pass
    finally:
        forwards.unwrap(module, forwards.PROBE)
    if not seen:
        raise RuntimeError("the pipeline never called the component")
    args, kwargs = seen[0]
    return tuple(args), dict(kwargs)


def measure(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tolerance: float = 0.0) -> dict[str, Any]:
    """On the warmup's first call of ``module`` (eager), which dtypes (:data:`DTYPES`) and forms
    (:data:`FORMS`) of its timestep give the built call's output (bit for bit by default: "the same
    output", never a near one): the record an entry keeps (``build.timestep``). Each pair is tried at the
    warmup's values, or at their rounding where those are not representable in that dtype (Euler's
    499.5 as an int64 is 500's question). ``module`` must be the component's own forward (no layer of
    aotbuild's on it)."""
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
    value = t.reshape(-1)[0]

    def run(v: Any) -> list[Any]:
        a, k = _put(args, kwargs, where, v)
        with torch.no_grad():
            return [o.detach().clone() for o in _outputs(module(*a, **k))]

    reference = {False: run(t)}  # at the warmup's value (False) or its rounding (True)
    forms = [f for f in FORMS if not (f == "one" and batch == 1)]
    for name in dict.fromkeys((record["dtype"], *DTYPES)):
        dtype = getattr(torch, name)
        rounded = not exact(value, dtype)
        tried = value.round() if rounded else value
        if not exact(tried, dtype) or not exact(tried, t.dtype):
            record["unlike"][name] = f"{value.item()!r} cannot be written in {name}"
            continue
        if rounded and True not in reference:
            reference[True] = run(_in_form(tried, built_form, batch, expanded))
        alike, why = [], ""
        for form in forms:
            if name == record["dtype"] and form == built_form:
                alike.append(form)
                continue
            try:
                got = run(_in_form(tried.to(dtype), form, batch, expanded))
            except Exception as exc:  # noqa: BLE001 - an index the model cannot take, a shape it refuses
                why = why or f"{form}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                continue
            diff = _difference(got, reference[rounded])
            if diff <= tolerance:
                alike.append(form)
                record["max_abs_diff"] = max(record["max_abs_diff"], diff)
            else:
                why = why or f"{form}: the output differs by {diff:.3g}"
        if alike:
            record["alike"][name] = alike
        if why:
            record["unlike"][name] = why
    return record


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


def check_record(value: Any) -> str:
    """Why ``value`` is not a timestep record a manifest may hold (``build.timestep``), or "". A record of
    another version, or one that only says why nothing was measured, is well formed and proves nothing."""
    if not isinstance(value, dict):
        return "not an object"
    if value.get("version") != VERSION or "why" in value:
        return "" if isinstance(value.get("why", ""), str) else "why: not text"
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
    if not isinstance(unlike, dict) or not all(isinstance(k, str) and len(k) < 16 and isinstance(v, str)
                                               and len(v) <= 4096 for k, v in unlike.items()):
        return "unlike: not {dtype: reason}"
    return ""


class Conversions:
    """A dispatcher's timestep conversions, from its entries' records (``build.timestep``): a call whose
    timestep's dtype or rank is not the built one's is converted to it where every entry proved that pair
    alike and its values are exactly representable; otherwise :meth:`convert` says why not."""

    def __init__(self, params: list[str], records: list[dict[str, Any]], unproven: list[str]):
        self.params = params  # the forward's parameters, self left out: where a call holds its timestep
        self.records = records  # the entries' proofs
        self.unproven = unproven  # why an entry proves nothing (a record of an older aotbuild, or none)

    @classmethod
    def of(cls, module: Any, records: list[Any]) -> Conversions | None:
        """For ``module`` (the component itself, served at the component's scope) and its entries' records
        (``build.timestep``, None where an entry has none); None when it takes no timestep."""
        params = parameters(module)
        if params is None or not any(name in params for name in NAMES):
            return None
        proven, unproven = [], []
        for record in records:
            problem = check_record(record) if record is not None else "absent"
            if not problem and "why" not in record and record.get("version") == VERSION:
                proven.append(record)
            else:
                unproven.append(record["why"] if not problem and isinstance(record.get("why"), str) else
                                "its entry records no timestep proof (built by an aotbuild before issue 56, or a "
                                "damaged record): rebuild it")
        return cls(params, proven, unproven)

    def locate(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[str, int | None] | None:
        """Where the call holds its timestep (:func:`locate`, the parameters read once)."""
        return _where(self.params, args, kwargs)

    def convert(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | str | None:
        """(args, kwargs) with the timestep in the built dtype and rank; None where it already is (or the
        call holds none: nothing to convert); else why it is not converted, for the refusal."""
        import torch

        where = self.locate(args, kwargs)
        t = _get(args, kwargs, where) if where is not None else None
        batch = _batch(args, kwargs)
        form = form_of(t.shape, batch) if isinstance(t, torch.Tensor) and t.numel() else None
        records = [r for r in self.records if where is not None and r["name"] == where[0]]
        if form is None or not (records or self.unproven):
            return None
        have = str(t.dtype).replace("torch.", "")
        built = {(r["dtype"], r["form"], r["expanded"]) for r in records}
        if records and all(d == have and f == form for d, f, _ in built):
            return None  # as built
        if self.unproven:
            return self.unproven[0]
        if len(built) != 1:
            return "the entries were built for timesteps of different dtypes or ranks"
        (want, built_form, expanded), = built
        built_words = f"{want} {_FORM_WORDS[built_form]}"
        for record in records:
            forms = record["alike"].get(have, [])
            if form in forms:
                continue
            unlike = record["unlike"].get(have)
            if not forms:
                return (f"its timestep is {have} {_FORM_WORDS[form]}, the entry was built for {built_words}, and the "
                        f"build's proof found the model reads {have} timesteps differently"
                        + (f" ({unlike})" if unlike else ""))
            return (f"its timestep is {have} {_FORM_WORDS[form]}, the entry was built for {built_words}, and the "
                    f"build proved {have} alike only as {', '.join(_FORM_WORDS[f] for f in forms)}")
        values = t.reshape(-1)
        if values.numel() > 1 and not bool((values == values[0]).all()):
            return (f"its timestep holds one value per sample ({_values(t)}), and the entry was built for one "
                    f"value per call ({built_words})")
        dtype = getattr(torch, want)
        if not exact(values, dtype):
            return (f"its timestep {_values(t)} ({have}) cannot be written exactly in {want}, the dtype the "
                    f"entry was built for")
        return _put(args, kwargs, where, _in_form(values[0].to(dtype), built_form, batch, expanded))


def only_difference(call: str, built: Any) -> bool:
    """Whether the call's signature differs from one of ``built`` only in one 0-d or 1-d tensor (its
    timestep, by all appearances): then a refusal leads with the timestep."""
    from aotbuild.utils.safeio import loads_json

    data = loads_json(call, max_bytes=1 << 16, max_depth=64)
    for sig in built:
        differ: list[tuple[Any, Any]] = []
        if _same_but_small(data, loads_json(sig, max_bytes=1 << 16, max_depth=64), differ) and len(differ) == 1:
            return True
    return False


def _same_but_small(x: Any, y: Any, differ: list[tuple[Any, Any]]) -> bool:
    """Whether two signatures' data are the same but for 0-d or 1-d tensors (added to ``differ``)."""
    small = [isinstance(v, list) and v[:1] == ["tensor"] and len(v) == 4 and len(v[1]) <= 1 for v in (x, y)]
    if all(small):
        if x != y:
            differ.append((x, y))
        return True
    if isinstance(x, dict) and isinstance(y, dict):
        return set(x) == set(y) and all(_same_but_small(x[k], y[k], differ) for k in x)
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y) and x[:1] != ["tensor"]:
        return all(_same_but_small(a, b, differ) for a, b in zip(x, y, strict=True))
    return x == y


def _values(t: Any) -> str:
    shown = ", ".join(repr(v) for v in t.reshape(-1)[:3].tolist())
    return f"[{shown}{', ...' if t.numel() > 3 else ''}]" if t.dim() else shown


_FORM_WORDS = {"scalar": "0-d", "one": "1-d of one value for the batch", "batch": "1-d, one per sample"}


def scheduler_of(pipe: Any) -> str:
    """``pipe.scheduler``'s class name, or ""."""
    scheduler = getattr(pipe, "scheduler", None)
    return type(scheduler).__name__ if scheduler is not None else ""
