"""Call signatures and the dispatcher that stands in a compiled component's ``forward``.

A *signature* is what a static-shape compile specializes on: every tensor's shape, dtype and device
kind, and the value of every non-float Python argument (floats are not specialized by Dynamo). The
builder records the signatures each warmup produced; at runtime the dispatcher sends a call whose
signature was built to the compiled forward, and any other call to the policy the user chose:
compile it (plain ``torch.compile`` behaviour), run it eagerly, or raise ``ShapeNotBuilt``. A
signature may hold a text range (``text_length``, aotbuild/pipeline/textlen.py): it then serves every call
that differs from it only by a text length inside the range.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from aotbuild import forwards
from aotbuild.errors import ShapeNotBuilt, StaleGraph
from aotbuild.pipeline import textlen
from aotbuild.utils.safeio import loads_json

#: A call signature is read back from manifests (strings of up to 4096 characters): parsed with bounded
#: depth, so a hostile one is a ValueError, never a RecursionError.
SIGNATURE_BYTES = 1 << 16
SIGNATURE_DEPTH = 64
#: Call signatures whose text pattern a dispatcher remembers (a server sees few).
_REMEMBERED = 4096
#: A memo's "not yet asked" (None is an answer).
_UNSEEN = object()


def _encode(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype).replace("torch.", ""), value.device.type]
    if isinstance(value, float):
        return ["float"]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    return ["object", type(value).__qualname__]


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return json.dumps({"args": _encode(list(args)), "kwargs": _encode(kwargs)}, sort_keys=True)


def describe(sig: str) -> str:
    """Tensor shapes of a signature, short enough for an error message."""
    data = loads_json(sig, max_bytes=SIGNATURE_BYTES, max_depth=SIGNATURE_DEPTH)
    parts = []

    def walk(name: str, v: Any) -> None:
        if isinstance(v, list) and v[:1] == ["tensor"]:
            parts.append(f"{name}={'x'.join(map(str, v[1])) or 'scalar'}:{v[2]}")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(f"{name}[{i}]", x)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(k, x)

    walk("arg", data["args"])
    walk("", data["kwargs"])
    return ", ".join(p.lstrip("[") for p in parts) or "no tensors"


class RouteDeclined(Exception):
    """Raised by a route before it runs anything: it was built for this signature but cannot serve this
    call (its own guards refused it). The dispatcher then treats the call as unbuilt, with the reason."""


class Dispatcher:
    """Replaces ``module.forward``: a built signature runs its route, others follow ``on_unbuilt``.

    ``routes`` maps each built signature to what runs it (the compiled forward for jit-cache, one
    AOTInductor package per signature for aot-package). ``on_unbuilt``: ``"record"`` (build: run
    ``fallback`` and remember the signature, calling ``on_record(sig, args, kwargs)`` the first
    time), ``"compile"`` (run ``fallback``, which compiles as torch.compile would), ``"eager"``, or
    ``"error"`` (raise ``ShapeNotBuilt``).
    """

    #: what aotbuild/pipeline/dependencies.py leaves out of a module's snapshot: it wraps the graph, it is not in it
    aotbuild_wrapper = True

    def __init__(self, component: str, eager: Callable[..., Any], routes: dict[str, Callable[..., Any]],
                 fallback: Callable[..., Any] | None, on_unbuilt: str,
                 on_record: Callable[[str, tuple[Any, ...], dict[str, Any]], None] | None = None):
        self.component = component
        self.eager = eager
        self.routes = dict(routes)
        self.fallback = fallback
        self.on_unbuilt = on_unbuilt
        self.on_record = on_record
        self.calls = {"built": 0, "unbuilt": 0}
        self.declined = ""  # why a route last refused a call (warned about once)
        #: told the seconds of the first call a route served, then dropped (load_compiled's report)
        self.on_first_call: Callable[[float], None] | None = None
        #: the per-call check of what the routes' graphs depend on (aotbuild/pipeline/dependencies.py ``Watch``:
        #: ``check() -> reason or ""``), and what a call does when it fails: load_compiled's on_miss
        self.watch: Any = None
        self.on_stale = "error"
        self.stale = ""  # the last reason warned about
        #: where the pipeline was loaded from (aotbuild/advice.py ``Situation``): a refusal's build advice names
        #: that cache (``cache=``) when the default rule would not find it
        self.situation: Any = None
        #: text patterns (aotbuild/pipeline/textlen.py): built signatures whose text dimensions serve a range of
        #: lengths, read off the routes' signatures (a build's recorder is given its pattern)
        self.patterns = textlen.patterns(self.routes)
        self._fits: dict[str, textlen.Pattern | None] = {}  # a call's signature -> the pattern it fits
        #: a static build's text lengths (textlen.static_patterns): only to name a refused prompt's length
        self.static_text: list[textlen.Pattern] = []
        self.copied = False  # a deep copy's dispatcher, before its first call (:meth:`_finish_copy`)
        #: the component's built batches (aotbuild/pipeline/batch.py ``Padding``): a call between two is padded
        #: to the next (the recipe's pad_batch, where the entry's proof showed it exact) or refused by name
        self.padding: Any = None
        #: timestep conversions (aotbuild/pipeline/timesteps.py ``Conversions``, from the entries' proofs): a call
        #: whose timestep's dtype or rank was not built is converted where proven, under every policy (issue 56)
        self.timesteps: Any = None
        #: who calls it, for refusals in the caller's terms (aotbuild/pipeline/callterms.py ``Caller``; issue 55)
        self.caller: Any = None

    def _pattern(self, sig: str) -> textlen.Pattern | None:
        """The text pattern serving a call of signature ``sig`` (remembered: a server sees few). The answer
        is returned from a local: another thread may clear the memo between its store and a read back."""
        found = self._fits.get(sig, _UNSEEN)
        if found is _UNSEEN:
            found = next((p for p in self.patterns if p.serves(sig)), None)
            if len(self._fits) >= _REMEMBERED:
                self._fits.clear()
            self._fits[sig] = found
        return found  # type: ignore[return-value]

    @property
    def built(self) -> set[str]:
        return set(self.routes)

    def __deepcopy__(self, memo: dict[int, Any]) -> Dispatcher:
        """The dispatcher of a copy ``copy.deepcopy`` makes of the module (or of a pipeline), for the copy's
        own weights (issue 52: a copy used to call the original's routes, closures over the original
        module, and served its weights). A route that can follow a copy (an AOT package's: opened again
        for the copy; aot-compile's: its functions take the module) is copied with it; any other (jit-cache's
        forward, compiled for the original module) serves the copy eagerly, with a warning at its first call,
        as do unbuilt calls (the fallback compile was the original's). ``load_compiled(recipe, pipe=copy)``
        serves such a copy compiled."""
        import copy

        new = Dispatcher.__new__(Dispatcher)  # not copy.copy: that pickles (__reduce__, below)
        new.__dict__.update(self.__dict__)
        memo[id(self)] = new
        new.eager = copy.deepcopy(self.eager, memo)
        new.routes = {sig: copy.deepcopy(route, memo) if hasattr(type(route), "__deepcopy__")
                      else _CopyRunsEagerly(new) for sig, route in self.routes.items()}
        new.fallback = None
        new.watch = copy.deepcopy(self.watch, memo)
        new.calls = {"built": 0, "unbuilt": 0}
        new.on_first_call, new._fits, new.declined, new.stale = None, {}, "", ""
        new.copied = True
        new.caller = self.caller.copied(memo) if self.caller is not None else None
        owner = getattr(self.eager, "__self__", None)
        if owner is not None:
            forwards.copied(owner, memo)
        return new

    def __reduce__(self) -> Any:
        """``torch.save`` or pickle of a served module saves it as its eager self: what is below the
        dispatcher (the class's forward, bound at unpickling) takes its place; an AOT package or a compiled
        forward is no picklable value. Load the unpickled module with ``load_compiled(recipe, pipe=...)``."""
        return self.eager.__reduce__()

    def _finish_copy(self) -> None:
        """At a copy's first call: a compiled call a regional compile set on the copied blocks
        (``_compiled_call_impl``, copied as the original's function) runs the original blocks: dropped,
        so that what serves the copy eagerly runs the copy's own."""
        self.copied = False
        owner = getattr(self.eager, "__self__", None)
        for sub in owner.modules() if owner is not None else ():
            if vars(sub).get("_compiled_call_impl") is not None:
                sub._compiled_call_impl = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.copied:
            self._finish_copy()
        # ``called``: the caller's own signature, what every refusal shows (a converted call's is another)
        sig = called = signature(args, kwargs)
        route = self.routes.get(sig)
        timestep = None  # why the call's timestep could not be converted (timesteps.Refused), for the refusal
        if route is None and self.timesteps is not None:  # before any fallback, under every policy (issue 56)
            converted = self.timesteps.convert(sig, args, kwargs)
            if isinstance(converted, tuple):  # the timestep in the built dtype and rank, where the entry proved it
                args, kwargs, plan = converted
                sig = plan.sig
                route = self.routes.get(sig)
            else:
                timestep = converted
        unbuilt = sig  # the call as the cache's tables read it: converted where it was
        pattern = self._pattern(sig) if route is None and self.patterns else None
        if pattern is not None:  # a text length inside a built range: that range's graph, dimensions marked
            sig = pattern.sig
            route = self.routes.get(sig)
            pattern.mark_dynamic(args, kwargs)
        # a batch between two built ones: the next one's route, on the call padded to it (issue 56)
        fit = self.padding.fit(unbuilt) if route is None and pattern is None and self.padding is not None else None
        if fit is not None and not fit.why:
            route = self.routes.get(fit.target.sig)
            sig, fit = (fit.target.sig, fit) if route is not None else (sig, None)
        why = ""
        if route is not None and self.watch is not None:
            stale = self.watch.check()
            if stale:
                return self._stale(stale, args, kwargs)
        if route is not None:
            timed, start = self.on_first_call, time.perf_counter()
            try:
                out = _padded(route, fit, args, kwargs) if fit is not None else route(*args, **kwargs)
            except RouteDeclined as exc:
                why = str(exc)
                self._warn_declined(why)
                sig, fit = unbuilt, None
            except StaleGraph as exc:  # a route's own refusal (jit-cache's, a Dynamo guard failed): how to build it
                if self.situation is None:
                    raise
                raise StaleGraph(f"{exc}{_rebuild_advice('', self.situation)}") from None
            else:
                self.calls["built"] += 1
                if fit is not None:
                    self.calls["padded"] = self.calls.get("padded", 0) + 1
                if timed is not None:
                    self.on_first_call = None
                    timed(time.perf_counter() - start)
                return out
        self.calls["unbuilt"] += 1
        if self.on_unbuilt == "record":
            from aotbuild.pipeline.dependencies import observe

            # the global state the build's graphs are traced under, and what the module holds at its first
            # call (a pipeline may set a processor just before): the manifest records both
            observe(getattr(self.eager, "__self__", None))
            assert self.fallback is not None
            if self.on_record is not None:
                self.on_record(sig, args, kwargs)
            self.routes[sig] = self.fallback
            return self.fallback(*args, **kwargs)
        if self.on_unbuilt == "error" and why:
            raise ShapeNotBuilt(self._refusal(called, why=why, converted=unbuilt))
        # the call differs from a built one in its timestep alone: the refusal leads with it, naming the scheduler
        if timestep is not None and timestep.alone and fit is None:
            said = self._scheduler(timestep.why)
            if self.on_unbuilt == "error":
                raise ShapeNotBuilt(self._refusal(called, why=said))
            self._warn_declined(said)
        if fit is not None:  # a batch not padded (issue 56): why, in the one format of a refusal
            if self.on_unbuilt == "error":
                raise ShapeNotBuilt(self._refusal(called, advice=fit.why, converted=unbuilt))
            if self.padding.allowed and self.on_unbuilt != "record":  # padding was asked for: say why not, once
                self._warn_declined(fit.why)
        known = self.patterns + self.static_text
        outside = textlen.outside(known, unbuilt) if self.on_unbuilt == "error" and known else None
        if outside is not None:
            raise ShapeNotBuilt(textlen.refusal(self.component, *outside, policy=self.policy))
        if self.on_unbuilt == "error":
            raise ShapeNotBuilt(self._refusal(called, hint=_batch_hint(called, sorted(self.routes)), converted=unbuilt))
        if self.on_unbuilt == "eager" or self.fallback is None:
            import torch

            with torch.compiler.set_stance("force_eager"):
                return self.eager(*args, **kwargs)
        return self.fallback(*args, **kwargs)

    @property
    def policy(self) -> str:
        """The policy that refuses, in the user's words: ``on_miss="error"`` or ``strict_shapes=True``."""
        from aotbuild.pipeline.callterms import DEFAULT_POLICY

        return self.caller.policy if self.caller is not None else DEFAULT_POLICY

    def _refusal(self, sig: str, why: str = "", hint: str = "", advice: str = "", converted: str = "") -> str:
        """A ShapeNotBuilt's message in the caller's terms (aotbuild/pipeline/callterms.py): what the pipeline was
        called at and what was built, then the latents; a component called directly, its inputs only. ``sig``:
        the caller's own call; ``converted``: its timestep converted, where it was (its text length is read
        off that one, as the built ones hold their timestep)."""
        from aotbuild.pipeline import callterms

        known = self.patterns + self.static_text
        found = textlen.outside(known, converted or sig) if known else None
        return callterms.refusal(self.component, sig, list(self.routes), self.caller, describe, why=why, hint=hint,
                                 text=found[0] if found else None, advice=advice)

    def _scheduler(self, why: str) -> str:
        """A timestep that cannot be converted, naming the pipeline's scheduler (what chose that timestep)."""
        from aotbuild.pipeline.timesteps import DECLARE, scheduler_of

        name = scheduler_of(self.caller.pipe) if self.caller is not None else ""
        if not name:
            return why
        return f"`pipe.scheduler` is {name}, and {why}; to serve {name} compiled, {DECLARE.format(name=name)}"

    def _stale(self, why: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A built signature whose graph no longer computes what the module does (issue 31): never served.
        on_miss "error" raises, "eager" runs the module eagerly, "compile" compiles it (with a warning)."""
        self.calls["stale"] = self.calls.get("stale", 0) + 1
        if self.on_stale == "error":
            raise StaleGraph(f"{self.component} changed since its entry was built, and load_compiled(on_miss="
                             f"\"error\") never compiles: {why}. Undo the change, or load with on_miss=\"eager\" "
                             f"(this module then runs eagerly){_rebuild_advice(why, self.situation)}")
        if why != self.stale:
            import warnings

            self.stale = why
            then = "runs eagerly" if self.on_stale == "eager" or self.fallback is None else "compiles"
            warnings.warn(f"aotbuild: {self.component}: {why}; its entry no longer fits, the call {then}",
                          stacklevel=3)
        if self.on_stale == "eager" or self.fallback is None:
            import torch

            with torch.compiler.set_stance("force_eager"):
                return self.eager(*args, **kwargs)
        return self.fallback(*args, **kwargs)

    def _warn_declined(self, why: str) -> None:
        if why != self.declined:
            import warnings

            self.declined = why
            then = {"error": "raises", "eager": "runs eagerly"}.get(self.on_unbuilt, "compiles")
            warnings.warn(f"aotbuild: {self.component}: {why}; the call {then}", stacklevel=3)


def _padded(route: Callable[..., Any], fit: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``route`` called with the call padded to ``fit``'s built batch, the padding dropped from its output."""
    from aotbuild.pipeline import batch

    padded_args, padded_kwargs = batch.pad(args, kwargs, fit)
    return batch.unpad(route(*padded_args, **padded_kwargs), fit)


class _CopyRunsEagerly:
    """A route of a copied dispatcher that cannot follow the copy: the copy's eager forward, with a
    warning at its first call."""

    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        d = self.dispatcher
        if not d.declined:
            import warnings

            d.declined = "copied"
            warnings.warn(f"aotbuild: {d.component} of a copied pipeline runs eagerly: its compiled forward "
                          f"belongs to the original; load_compiled(recipe, pipe=copy) serves the copy compiled",
                          stacklevel=3)
        with torch.compiler.set_stance("force_eager"):
            return d.eager(*args, **kwargs)


def _rebuild_advice(why: str, situation: Any = None) -> str:
    """How to serve a changed module compiled: the recipe key that declares the change, or the build for the
    pipeline object (which re-creates only what a recipe can declare, and refuses the rest with the reason),
    into the cache the pipeline was loaded from (``situation``: aotbuild/advice.py, ``cache=`` where the
    default rule would not find it)."""
    import dataclasses

    from aotbuild import advice
    from aotbuild.pipeline.dependencies import recipe_key

    situation = situation if situation is not None else advice.Situation()
    build = advice.build_command(dataclasses.replace(situation, pipe=True))
    key = recipe_key(why)
    if key:
        return (f"; to serve it compiled, declare it in the recipe ({key}: docs/recipes.md, \"Declared changes\") "
                f"and build, or build for this pipeline with {build}, then load again")
    return (f"; {build} builds for a changed pipeline only the changes a recipe can declare "
            "(changes: freeu, attention_processor, attention_backend, memory_format; plan refuses a cache hook for "
            "now) and refuses others with the reason")


def _first_tensor(sig: str) -> list[int] | None:
    def walk(v: Any) -> list[int] | None:
        if isinstance(v, list) and v[:1] == ["tensor"]:
            return list(v[1])
        for x in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()):
            found = walk(x)
            if found is not None:
                return found
        return None

    data = loads_json(sig, max_bytes=SIGNATURE_BYTES, max_depth=SIGNATURE_DEPTH)
    return walk(data["args"]) or walk(data["kwargs"])


def _batch_hint(sig: str, built: list[str]) -> str:
    """The most common unbuilt call: the batch differs from a built one's and nothing else does.
    What sets a denoiser's batch is the pipeline's business: the number of prompt texts, images or
    videos per prompt (the shape's batch_size), and for pipelines that batch both halves of
    classifier-free guidance (SD, PixArt), whether guidance is on; others run it as two calls."""
    called = _first_tensor(sig)
    for b in built:
        other = _first_tensor(b)
        if called and other and called[1:] == other[1:] and called[0] != other[0]:
            return (f" The batch is {called[0]} where the cache built {other[0]}: it follows the number of prompts, "
                    f"images or videos per prompt (the shape's batch_size) and, in pipelines that batch guidance's "
                    f"two halves, whether guidance is on, so call with the prompts and guidance of the recipe's "
                    f"warmup.")
    return ""


def dispatchers(module: Any) -> list[Dispatcher]:
    """Every dispatcher aotbuild put in ``module`` and its submodules."""
    return [d for sub in module.modules() for d in forwards.layers(sub, forwards.DISPATCH)]


def uninstall_dispatchers(module: Any) -> int:
    """Remove every dispatcher aotbuild put in ``module`` and its submodules (and a regional compile's
    compiled call), so a second ``load_compiled`` on the same pipe installs on the module itself, not
    around the first install (a compile that wraps a dispatcher raised Dynamo's Unsupported)."""
    removed = 0
    for sub in module.modules():
        while forwards.unwrap(sub, forwards.DISPATCH):  # what was below it comes back (an offload hook)
            removed += 1
        if vars(sub).get("_compiled_call_impl") is not None:
            sub._compiled_call_impl = None
    return removed


_UNTRACED = threading.Lock()


def _untraced() -> None:
    """Dynamo traces no dispatcher: ``torch.compile`` of a served module (or of code around it) breaks its
    graph once, at the dispatcher, which then runs its routes as loaded (a compiled forward called by a
    route still compiles: Dynamo is off for the dispatcher's frame, not for what re-enables it). Traced,
    the dispatcher's Python (a JSON signature, dict lookups) broke the graph 14 times (issue 52). Put on
    the class at the first install: it is defined before torch is imported."""
    with _UNTRACED:
        if vars(Dispatcher).get("_untraced"):
            return
        import torch

        Dispatcher.__call__ = torch.compiler.disable(Dispatcher.__call__)  # type: ignore[method-assign]
        Dispatcher._untraced = True


def install_dispatcher(module: Any, component: str, routes: dict[str, Callable[..., Any]],
                       fallback: Callable[..., Any] | None, on_unbuilt: str,
                       on_record: Callable[[str, tuple[Any, ...], dict[str, Any]], None] | None = None) -> Dispatcher:
    """Put a dispatcher in ``module.forward`` (the layer ``forwards.DISPATCH``: an instance attribute, the
    class untouched), around what was there."""
    _untraced()
    return forwards.wrap(module, forwards.DISPATCH,
                         lambda inner: Dispatcher(component, inner, routes, fallback, on_unbuilt, on_record))
