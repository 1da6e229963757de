"""A long-lived server can trust a served pipeline (issue 52): what a package is handed, when it is handed
again, threads and copies, checked through small fakes of AOTInductor's loaded package (what the runner
calls: ``load_constants`` and the call). The real package's memory over swaps, reloads, copies and
threads: tests/test_soak.py; served pipelines: tests/test_server_pipelines.py."""

from __future__ import annotations

import copy
import gc
import io
import os
import threading
import warnings
import weakref

import pytest
import torch
from torch import nn

from aotbuild.dispatch import install_dispatcher
from aotbuild.strategies import handover, runner
from aotbuild.strategies.runner import PackageRoute, PackageRunner


class Pinning:
    """A package whose runtime keeps a reference to everything it is handed (torch 2.13's)."""

    def __init__(self):
        self.kept = []
        self.constants = {}
        self.handed = []  # the names handed over, per load_constants call

    def load_constants(self, tensors, check_full_update, user_managed):
        self.kept += list(tensors.values())
        self.constants.update(tensors)
        self.handed.append(sorted(tensors))

    def __call__(self, *args, **kwargs):
        return None


class Releasing(Pinning):
    """A package whose runtime drops what a constant held when it is replaced (the upstream fix)."""

    def load_constants(self, tensors, check_full_update, user_managed):
        self.constants.update(tensors)
        self.handed.append(sorted(tensors))


def test_the_probe_tells_a_runtime_that_pins_from_one_that_releases():
    assert handover.probe(Pinning(), "w") is True
    assert handover.probe(Releasing(), "w") is False
    handover._LEAKS.pop("test-version", None)
    assert handover.leaks(Pinning(), ["w"], "test-version") is True
    assert handover.leaks(Releasing(), ["w"], "test-version") is True  # once per torch version: remembered
    handover._LEAKS.pop("test-version")


def test_an_alias_reads_the_same_memory_and_does_not_keep_it():
    t = torch.arange(12.0).reshape(3, 4).t()  # strided
    a = handover.alias(t)
    assert a is not t and a.data_ptr() == t.data_ptr() and a.stride() == t.stride() and torch.equal(a, t)
    t[1, 1] = 100.0
    assert a[1, 1] == 100.0  # one memory
    alive = weakref.ref(t)
    del t
    gc.collect()
    assert alive() is None  # the alias does not own what it reads
    assert handover.prepare({"x": torch.ones(2)}, pinning=False)["x"].untyped_storage().nbytes() == 8


def _package(derived: bool = True) -> dict:
    """A package record over a two-layer module: ``0.weight`` supplied as it is, and (``derived``) a
    "prepacked" constant for each of ``1.weight`` and ``1.bias`` computed from them (x 2)."""
    record = {"path": "aoti/fake.pt2", "strides": None, "constants": {"0.weight": [[4, 4], "float32", "cpu"]},
              "baked": {}}
    if derived:
        double = [["input", [0], {}], ["aten.mul.Tensor", [{"ref": 0}, 2.0], {}]]
        record["derived"] = {"_frozen_param0": {"inputs": ["1.weight"], "program": double, "value": {
                                 "shape": [4, 4], "dtype": "float32", "layout": "strided", "stride": [4, 1],
                                 "nbytes": 64}},
                             "_frozen_param1": {"inputs": ["1.bias"], "program": double, "value": {
                                 "shape": [4], "dtype": "float32", "layout": "strided", "stride": [1],
                                 "nbytes": 16}}}
        record["asks"] = ["0.weight", "_frozen_param0", "_frozen_param1"]
        record["derived_from"] = {"1.weight": [[4, 4], "float32", "cpu"], "1.bias": [[4], "float32", "cpu"]}
    return record


def _served(model=None, derived: bool = True, pinning: bool = True):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4))
    model = model or Pinning()
    run = PackageRunner(model, module, "unet", _package(derived), "cpu", pinning=pinning)
    return module, model, run


def _prepacked_is_right(module, model) -> bool:
    return (torch.equal(model.constants["_frozen_param0"], module[1].weight.detach() * 2)
            and torch.equal(model.constants["_frozen_param1"], module[1].bias.detach() * 2))


def test_a_swap_in_place_replays_into_the_handed_tensors_and_hands_nothing_over():
    module, model, run = _served()
    assert model.handed == [["0.weight", "_frozen_param0", "_frozen_param1"]]  # the load: everything
    first = dict(model.constants)
    run()
    with torch.no_grad():
        module[1].weight.add_(1.0)  # load_state_dict, copy_, an optimizer step: a version bump
    run()
    assert len(model.handed) == 1 and run.rebinds == 1 and run.replayed == 3  # only 1.weight's recipe again
    assert model.constants["_frozen_param0"] is first["_frozen_param0"] and _prepacked_is_right(module, model)
    module.load_state_dict({k: v + 1 for k, v in module.state_dict().items()})  # every weight, in place
    run()
    assert len(model.handed) == 1 and run.replayed == 5 and _prepacked_is_right(module, model)


def test_a_replaced_weight_is_handed_over_alone_as_an_alias():
    module, model, run = _served()
    module[0].weight = nn.Parameter(torch.randn(4, 4))  # a new tensor: handed over, nothing replayed
    run()
    assert model.handed[-1] == ["0.weight"] and run.replayed == 2
    handed = model.constants["0.weight"]
    assert handed is not module[0].weight and handed.data_ptr() == module[0].weight.data_ptr()
    alive = weakref.ref(module[0].weight)
    module[0].weight = nn.Parameter(torch.randn(4, 4))
    gc.collect()
    assert alive() is not None  # kept while a call may read it (a call in flight on another thread)
    run()
    gc.collect()
    assert model.handed[-1] == ["0.weight"]
    assert alive() is None  # handed over again: the package's runtime keeps the alias, not the weight
    _, model, _ = _served(Releasing(), pinning=False)  # a runtime that releases: the tensors as they are
    assert all(type(t) is nn.Parameter or t.grad_fn is None for t in model.constants.values())


@pytest.mark.parametrize("write", ["output channel", "input channel", "one element at the end"])
def test_a_write_through_data_is_seen_where_a_sample_reads(write):
    """``.data`` writes bump no version counter: one element per output channel (the diagonal, so an
    input channel shows too) and four spread over the tensor are compared at every call."""
    module, model, run = _served()
    run()
    weight = module[1].weight.data
    if write == "output channel":
        weight[2] *= 3
    elif write == "input channel":
        weight[:, 1] *= 3
    else:
        weight.view(-1)[-1] += 1
    run()
    assert run.rebinds == 1 and _prepacked_is_right(module, model)


def test_refresh_replays_every_recipe_for_a_write_no_check_sees():
    import aotbuild

    module, model, run = _served()
    install_dispatcher(module, "unet", {"sig": PackageRoute(run)}, None, "error")
    weight = module[1].weight.data
    weight[0, 1] += 1  # off the diagonal and off the spread samples: not seen
    run()
    assert run.rebinds == 0 and not _prepacked_is_right(module, model)
    assert aotbuild.refresh(module) == 1 and _prepacked_is_right(module, model)


def test_weights_made_in_inference_mode_are_warned_about_at_load():
    with torch.inference_mode():
        module = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="inference tensors .* aotbuild.refresh"):
        PackageRunner(Pinning(), module, "unet", _package(), "cpu", pinning=True)


class Slow(Pinning):
    """A package whose call waits for ``release``, recording what it was handed meanwhile."""

    def __init__(self):
        super().__init__()
        self.running = threading.Event()
        self.release = threading.Event()
        self.handed_while_running = 0

    def load_constants(self, tensors, check_full_update, user_managed):
        if self.running.is_set():
            self.handed_while_running += 1
        super().load_constants(tensors, check_full_update, user_managed)

    def __call__(self):
        self.running.set()
        assert self.release.wait(10)
        self.running.clear()
        return self.constants["0.weight"].clone()


def test_a_rebind_waits_for_the_call_in_flight_on_another_thread():
    """Check, rebind and call are one step: a second thread's call after a weight change waits until
    the first thread's call returned, which ran with the weights it was bound to."""
    module, model, run = _served(Slow())
    first_weights = module[0].weight.detach().clone()
    out = {}
    a = threading.Thread(target=lambda: out.setdefault("a", run()))
    a.start()
    assert model.running.wait(10)
    module[0].weight = nn.Parameter(torch.randn(4, 4))
    b = threading.Thread(target=lambda: out.setdefault("b", run()))
    b.start()
    b.join(0.2)
    assert b.is_alive() and model.handed_while_running == 0  # waits for the call in flight
    model.release.set()
    a.join(10)
    b.join(10)
    assert torch.equal(out["a"], first_weights) and torch.equal(out["b"], module[0].weight.detach())


def test_a_deep_copy_is_served_by_a_package_of_its_own_with_its_own_weights():
    opened = []

    def opener():
        opened.append(Pinning())
        return opened[-1]

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4))
    run = PackageRunner(opener(), module, "unet", _package(), "cpu", pinning=True, opener=opener)
    install_dispatcher(module, "unet", {"sig": PackageRoute(run)}, None, "error")
    twin = copy.deepcopy(module)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(-1)
    twin_route = twin.forward.routes["sig"]
    assert twin.forward is not module.forward and twin_route.runner.module is twin and len(opened) == 2
    twin_route()
    assert _prepacked_is_right(twin, opened[1]) and _prepacked_is_right(module, opened[0])
    assert torch.equal(opened[1].constants["0.weight"], twin[0].weight.detach())
    from aotbuild import forwards
    from aotbuild.dispatch import uninstall_dispatchers

    assert forwards.layers(twin, forwards.DISPATCH) == [twin.forward]  # the copy's layer is its own
    assert uninstall_dispatchers(twin) == 1 and "forward" not in vars(twin)
    with pytest.raises(Exception, match="cannot get its own AOT package"):  # no way to open it again
        copy.deepcopy(PackageRunner(Pinning(), module, "unet", _package(), "cpu"))


@pytest.mark.parametrize("kind", ["baked", "calibrated"])
def test_a_deep_copy_whose_fixed_values_changed_before_its_first_call_is_refused(kind):
    """A copy's runner binds at its first call, and that bind checked neither the tensors compiled into the
    package nor (int8static) the weights its scales were calibrated on: a copy changed before its first call
    was served with the package's old values."""
    from aotbuild.errors import PackageMismatch
    from aotbuild.strategies.runner import baked_digests, named_tensors, tensor_digest

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4))
    package = _package()
    package["derived"] = {"_frozen_param0": package["derived"]["_frozen_param0"]}
    package["derived_from"] = {"1.weight": package["derived_from"]["1.weight"]}
    if kind == "baked":
        package["baked"] = baked_digests(module, ["0.weight", "1.weight"])  # 1.bias compiled in
        changed = "1.bias"
    else:
        package["calibrated"] = {fqn: tensor_digest(t) for fqn, t in named_tensors(module).items()}
        changed = "1.weight"
    run = PackageRunner(Pinning(), module, "unet", package, "cpu", pinning=True, opener=Pinning)
    install_dispatcher(module, "unet", {"sig": PackageRoute(run)}, None, "error")
    twin = copy.deepcopy(module)
    twin.forward.routes["sig"]()  # the copy as it is: served
    other = copy.deepcopy(module)
    kept = other.get_parameter(changed).detach().clone()
    with torch.no_grad():
        other.get_parameter(changed).add_(1)
    for _ in range(2):
        with pytest.raises(PackageMismatch, match="compiled into its AOT package changed|calibrated on other"):
            other.forward.routes["sig"]()
    with torch.no_grad():
        other.get_parameter(changed).copy_(kept)  # put back: served
    other.forward.routes["sig"]()


def test_a_copy_whose_route_cannot_follow_it_runs_eagerly_and_says_so():
    """A route that closes over the original module (jit-cache's compiled forward) is not copied: the copy
    runs its own weights eagerly, with a warning (before issue 52 it ran the original's route)."""
    module = nn.Linear(4, 4)
    install_dispatcher(module, "unet", {"sig": lambda x: module.forward.eager(x)}, None, "error")
    twin = copy.deepcopy(module)
    with torch.no_grad():
        twin.weight.mul_(-1)
    x = torch.randn(1, 4)
    with pytest.warns(UserWarning, match="copied pipeline runs eagerly"):
        served = twin.forward.routes["sig"](x)
    assert torch.equal(served, nn.functional.linear(x, twin.weight, twin.bias))
    assert not torch.equal(served, nn.functional.linear(x, module.weight, module.bias))


def test_a_served_module_pickles_as_its_eager_self():
    module = nn.Linear(4, 4)
    install_dispatcher(module, "unet", {"sig": PackageRoute.__new__(PackageRoute)}, None, "error")
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(2, 4)
    assert torch.equal(loaded(x), nn.functional.linear(x, module.weight, module.bias))
    assert not hasattr(loaded.forward, "routes")


class ReadsEnv(Pinning):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __call__(self):
        self.seen.append(os.environ.get(runner.CHECK_INPUTS))


def test_input_checking_is_switched_on_around_a_packages_first_call_only(monkeypatch):
    monkeypatch.delenv(runner.CHECK_INPUTS, raising=False)
    _, model, run = _served(ReadsEnv())
    run()
    run()
    assert model.seen == ["1", None] and runner.CHECK_INPUTS not in os.environ
    monkeypatch.setenv(runner.CHECK_INPUTS, "0")  # the process's own choice is kept
    _, model, run = _served(ReadsEnv())
    run()
    assert model.seen == ["0"]


def test_jit_caches_refusal_holds_for_its_own_thread_only_and_is_never_left_behind(monkeypatch):
    """Two routes refusing code generation on two threads, entered and left in an interleaved order: another
    thread compiles meanwhile, and after both left Inductor's entry is its own again (before issue 52 the
    second route put the first's refusal back, for the whole process)."""
    import torch._inductor.compile_fx as fx

    from aotbuild.errors import StaleGraph
    from aotbuild.strategies.jit_cache import _refusing_codegen

    def codegen(self, *args, **kwargs):
        return "compiled"

    monkeypatch.setattr(fx._InProcessFxCompile, "codegen_and_compile", codegen)
    entered = [threading.Event(), threading.Event()]
    leave = [threading.Event(), threading.Event()]
    seen = {}

    def route(i):
        with _refusing_codegen(f"unet{i}"):
            entered[i].set()
            try:
                fx._InProcessFxCompile.codegen_and_compile(None)
            except StaleGraph:
                seen[i] = "refused"
            leave[i].wait(10)

    threads = [threading.Thread(target=route, args=(i,)) for i in (0, 1)]
    threads[0].start()
    assert entered[0].wait(10)
    threads[1].start()
    assert entered[1].wait(10)
    assert fx._InProcessFxCompile.codegen_and_compile(None) == "compiled"  # this thread is in no route
    leave[0].set()  # the first in leaves first
    threads[0].join(10)
    leave[1].set()
    threads[1].join(10)
    assert seen == {0: "refused", 1: "refused"}
    assert vars(fx._InProcessFxCompile)["codegen_and_compile"] is codegen


def test_the_pool_reuses_what_a_dropped_runner_left_pinned():
    """oneDNN's prepacked tensors cannot be aliased: on a pinning runtime a dropped runner's stay in memory,
    and the next runner's constants of the same layout are written into them instead of allocating more."""
    before = handover.pooled()  # what other tests of this worker left (other layouts too)
    pinned = [torch.ones(8), torch.ones(8)]
    handover.retire(pinned)
    assert pinned == [] and handover.pooled() == before + 2
    value = torch.full((8,), 3.0)
    reused = handover.reuse(value)
    assert reused is not value and torch.equal(reused, value) and handover.pooled() == before + 1
    handover.reuse(torch.ones(8))  # leave the process's pool as it was (a loop until empty never ends
    assert handover.pooled() == before  # where another test left a tensor of another layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert handover.reuse(torch.ones(3)) is not None


def test_discarded_weights_free_their_memory_and_any_use_names_refit():
    """``discard_weights=True`` (issue 52 item 2): a weight only prepacked constants read is dropped after
    load; its placeholder keeps shape, dtype, strides and ``requires_grad`` (so the module reads as it
    was), any use of its values raises naming ``aotbuild.refit``, and refit replays from new weights."""
    import aotbuild
    from aotbuild.errors import WeightsDiscarded
    from aotbuild.strategies.discard import discard, discardable, is_discarded

    module, model, run = _served()
    install_dispatcher(module, "unet", {"sig": PackageRoute(run)}, None, "error")
    dense = weakref.ref(module[1].weight)
    assert discardable(run) == ["1.bias", "1.weight"]  # 0.weight is handed to the package as it is
    assert discard(run) == (16 + 4) * 4
    gc.collect()
    placeholder = module[1].weight
    assert dense() is None and is_discarded(placeholder) and not is_discarded(module[0].weight)
    assert placeholder.shape == (4, 4) and placeholder.requires_grad and "unet.1.weight" in repr(placeholder)
    run()
    assert run.rebinds == 0  # the placeholders are what the runner watches now
    for use in (lambda: module.state_dict()["1.weight"] + 0, lambda: copy.deepcopy(module),
                lambda: module.forward.eager(torch.randn(1, 4)), lambda: torch.save(module, io.BytesIO())):
        with pytest.raises((WeightsDiscarded, RuntimeError), match="aotbuild.refit"):
            use()
    new = {"1.weight": torch.full((4, 4), 3.0), "1.bias": torch.ones(4), "0.weight": torch.eye(4)}
    assert aotbuild.refit(module, new) == 2 and len(model.handed) == 1  # replayed into what was handed over
    assert torch.equal(model.constants["_frozen_param0"], new["1.weight"] * 2)
    assert torch.equal(model.constants["_frozen_param1"], new["1.bias"] * 2)
    assert torch.equal(module[0].weight.detach(), torch.eye(4))  # kept by the module: written in place
    run()
    assert run.rebinds == 0  # refit left nothing for the per-call check to redo
    with pytest.raises(Exception, match="not Sequential's"):
        aotbuild.refit(module, {"2.weight": torch.ones(1)})
    module[1].weight = nn.Parameter(torch.ones(4, 4))  # a dense weight assigned back: served from it
    run()
    assert run.rebinds == 1 and torch.equal(model.constants["_frozen_param0"], torch.full((4, 4), 2.0))
    with pytest.raises(WeightsDiscarded, match="aotbuild.refit"):
        module.to(torch.float64)  # reaches 1.bias, still discarded


def test_a_rebind_of_a_package_with_a_tensor_compiled_in_compares_what_the_build_digested():
    """The build digests every tensor the package takes neither as a constant nor as a recipe's source;
    a rebind compared a digest over the constants only, so a prepacked package with a tensor compiled in
    raised at every rebind (issue 52 item 6)."""
    from aotbuild.strategies.runner import baked_digests

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4))
    package = _package()
    package["derived"] = {"_frozen_param0": package["derived"]["_frozen_param0"]}
    package["derived_from"] = {"1.weight": package["derived_from"]["1.weight"]}
    package["baked"] = baked_digests(module, ["0.weight", "1.weight"])  # as the build: constants and sources
    assert list(package["baked"]) == ["1.bias"]
    model = Pinning()
    run = PackageRunner(model, module, "unet", package, "cpu", pinning=True)
    with torch.no_grad():
        module[1].weight.mul_(2)
    run()
    assert run.rebinds == 1
    with torch.no_grad():
        module[1].bias.add_(1)  # the tensor compiled in changed: refused
    from aotbuild.errors import PackageMismatch

    with pytest.raises(PackageMismatch, match="compiled into its AOT package changed"):
        run()
    # and at every later call, before anything of the change is handed over: the check ran after the
    # handover, so the next call found nothing changed and served the new weights with the old bias
    served = model.constants["_frozen_param0"].clone()
    with torch.no_grad():
        module[1].weight.mul_(2)
    for _ in range(2):
        with pytest.raises(PackageMismatch, match="compiled into its AOT package changed"):
            run()
    assert torch.equal(model.constants["_frozen_param0"], served)  # nothing of the change handed over
    with torch.no_grad():
        module[1].bias.sub_(1)  # put back: served again, with the new weight
    run()
    assert torch.equal(model.constants["_frozen_param0"], module[1].weight.detach() * 2)


def test_a_served_module_dropped_by_its_user_is_freed_with_its_package():
    """A reload drops the old pipeline (``del pipe``): the registry of what aotbuild put in each module's
    forward held the dispatcher, whose eager forward holds the module, so every served module stayed in
    memory for good (issue 52)."""
    from aotbuild.dispatch import dispatchers

    module, model, run = _served()
    install_dispatcher(module, "unet", {"sig": PackageRoute(run)}, None, "error")
    assert dispatchers(module)
    module_alive, model_alive = weakref.ref(module), weakref.ref(model)
    del module, model, run
    gc.collect()
    assert module_alive() is None and model_alive() is None


def test_compiling_a_served_module_breaks_its_graph_once_at_the_dispatcher():
    """``torch.compile`` of a served module traced aotbuild's dispatcher and broke the graph at every Python
    step of it (14 times, issue 52); it now skips the dispatcher, one break, and the route runs as loaded."""
    from torch._dynamo.utils import counters

    from aotbuild.dispatch import signature

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    served_with = []

    def route(x):  # stands for a loaded package: the module's own computation, counted
        served_with.append(x)
        return module[1](module[0](x))

    install_dispatcher(module, "unet", {signature((x,), {}): route}, None, "eager")
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(module, backend="eager")(x)
    assert torch.equal(out, module[1](module[0](x))) and len(served_with) == 1
    assert sum(counters["graph_break"].values()) <= 1, dict(counters["graph_break"])


def test_a_dropped_runner_retired_during_a_probe_does_not_deadlock_the_load():
    """handover.leaks probes a package with a gc.collect(), which runs finalizers: among them a dropped
    pinning runner's retire. The probe and the pool had one lock, so such a load waited forever (the
    suite hung in test_prepack after a dropped runner); they have a lock each now."""
    import gc
    import threading

    class Cycle:
        pass

    class Model:
        def load_constants(self, constants, check_full_update, user_managed):
            pass

    gc.collect()
    gc.disable()  # the cycle is collected by the probe's own gc.collect(), inside leaks
    try:
        dropped = Cycle()
        dropped.me = dropped
        weakref.finalize(dropped, handover.retire, [torch.ones(3)])
        del dropped
        before = handover.pooled()
        done = threading.Thread(target=handover.leaks, args=(Model(), ["c"], None), daemon=True)
        done.start()
        done.join(20)
        assert not done.is_alive(), "the probe deadlocked on the pool's lock"
    finally:
        gc.enable()
    assert handover.pooled() == before + 1
    handover.reuse(torch.ones(3))  # the process's pool as it was
