"""``strategy: jit-cache``: ``torch.compile``'s own caches, captured by the build and laid back at load.

Build: the job compiles the component (or its repeated blocks) with the target's compile call and
runs the warmup; everything the compiler left in its cache folder (pointed at an empty folder by the
target's ``capture_env``) is the entry. Load: the target installs those files where this process's
compiler reads them, and the component is compiled again with the same call, so Dynamo traces (that
is not compiling) and every graph hits the compiler's cache. Runs on every target; what counts as a
compile in a serving process is the target's to say (``Target.compile_counter``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from aotbuild.dispatch import install_dispatcher
from aotbuild.strategies.base import BuildJob, Built, Planned, Resolved, Strategy

if TYPE_CHECKING:
    from aotbuild.cache.store import Entry
    from aotbuild.targets.base import InstallResult, Target


class JitCache(Strategy):
    name = "jit-cache"
    summary = "torch.compile with its caches captured (any target); Dynamo traces again at load"
    graph_breaks = True  # several graphs, each in the FX cache, each traced and hit again at load
    text_lengths = True  # mark_dynamic before each call: the same symbolic graph at build and at load

    def build(self, job: BuildJob) -> Built:
        ctx = job.ctx
        compiled = ctx.target.compile(job.module, ctx.recipe, ctx.device)
        dispatcher = install_dispatcher(job.module, job.component, {}, compiled, "record")
        if job.text is not None:
            dispatcher.patterns.append(job.text)
        job.run_warmup()
        return Built(sorted(dispatcher.built))

    def check(self, ctx: Resolved, module: Any, component: str, entry: Entry) -> str:
        # Dynamo traces again at load and the compiler looks its graphs up by a key that holds its
        # global settings: a library that changed them for the process (torchao's quantize_) misses.
        from aotbuild.pipeline.structure import settings_mismatch

        recorded = (entry.manifest.structure or {}).get("compiler", {})
        return settings_mismatch(recorded, ctx.target.global_settings())

    def install(self, ctx: Resolved, planned: list[Planned], policy: str) -> InstallResult | None:
        files = [f for p in planned for e in p.entries for f in e.files]
        result = ctx.target.install(files, ctx.device) if files else None
        for p in planned:
            compiled: Any = None
            if p.entries or policy == "compile":
                compiled = ctx.target.compile(p.module, ctx.recipe, ctx.device)
            # Dynamo traces and loads the installed kernels at each signature's first call, not here.
            routes = {sig: _loading(ctx.target, compiled, p.component, refuse=policy == "error")
                      for e in p.entries for sig in e.manifest.signatures}
            install_dispatcher(p.module, p.component, routes, compiled, policy)
        return result


def _loading(target: Target, compiled: Any, component: str = "", refuse: bool = False) -> Callable[..., Any]:
    """A built signature's route: the compiled forward, its first call (where Dynamo traces and the
    compiler loads the installed kernels) inside the target's ``loading()``, later calls as they are.
    The fallback for unbuilt signatures (``on_miss="compile"``) stays outside: a real compile keeps
    every speed-up the compiler has. ``refuse`` (on_miss="error": this pipeline never compiles): a
    graph the installed cache does not have (a Dynamo guard failed on a change the dependency check
    cannot see, then an FX graph cache miss) raises ``StaleGraph`` at Inductor's code generation
    instead of compiling silently (issue 31)."""
    loaded = False

    def route(*args: Any, **kwargs: Any) -> Any:
        nonlocal loaded
        with _refusing_codegen(component) if refuse else contextlib.nullcontext():
            try:
                if loaded:
                    return compiled(*args, **kwargs)
                with target.loading():
                    out = compiled(*args, **kwargs)
            except Exception as exc:
                stale = _stale_cause(exc)
                if stale is None:
                    raise
                raise stale from None
        loaded = True
        return out

    return route


#: Which component's route the current thread is in, while that route refuses code generation
_REFUSING = threading.local()
_GATE_LOCK = threading.Lock()
_GATE: dict[str, Any] = {"depth": 0, "compiler": None, "original": None}


@contextlib.contextmanager
def _refusing_codegen(component: str) -> Iterator[None]:
    """Inductor's code generation raises while held, in this thread only. Inductor's entry to it
    (``_InProcessFxCompile.codegen_and_compile``) is wrapped by a gate while any thread holds this (a
    depth count under a lock) and put back when the last one leaves; the gate refuses only in a thread
    inside a refusing route. Until issue 52 the entry itself was replaced and put back per call: two
    overlapping calls on two threads refused every other thread's compile meanwhile, and could leave
    it replaced for the whole process (the second saved the first's replacement as "the original").
    Not imported before a route needs it."""
    with _GATE_LOCK:
        if _GATE["depth"] == 0:
            import torch._inductor.compile_fx as fx

            compiler = fx._InProcessFxCompile
            original = vars(compiler)["codegen_and_compile"]

            def gate(*args: Any, **kwargs: Any) -> Any:
                refusing = getattr(_REFUSING, "component", None)
                if refusing is None:
                    return original(*args, **kwargs)
                from aotbuild.errors import StaleGraph

                raise StaleGraph(f"{refusing}: a call needs a graph the installed cache does not have (a Dynamo "
                                 f"guard failed: something the graph depends on changed), and load_compiled("
                                 f"on_miss=\"error\") never compiles; load with on_miss=\"compile\" to compile it")

            compiler.codegen_and_compile = gate
            _GATE.update(compiler=compiler, original=original)
        _GATE["depth"] += 1
    outer = getattr(_REFUSING, "component", None)
    _REFUSING.component = component
    try:
        yield
    finally:
        _REFUSING.component = outer
        with _GATE_LOCK:
            _GATE["depth"] -= 1
            if _GATE["depth"] == 0:
                _GATE["compiler"].codegen_and_compile = _GATE["original"]
                _GATE.update(compiler=None, original=None)


def _stale_cause(exc: BaseException) -> BaseException | None:
    """The StaleGraph that Dynamo wrapped (BackendCompilerFailed), if any."""
    from aotbuild.errors import StaleGraph

    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, StaleGraph):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
