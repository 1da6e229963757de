"""One loaded AOTInductor package bound to one module's live weights, for a server's whole life (issue 52).

A package built without weights reads the module's own tensors (handed over at load, not copied) and,
for a package built with freezing, prepacked constants the runner derives from them (prepack.py). A
server swaps weights, calls from several threads and copies pipelines; the runner keeps, before every
call and under one lock per package:

* **the tensors it handed over are the module's now.** A weight replaced (``pipe.to(...)``, a new
  Parameter, ``load_state_dict(assign=True)``, ``.data = ...``) is handed over again, and only that one;
  its shape, dtype, device and strides are checked first (AOTInductor accepts a wrong one silently);
* **prepacked constants follow the weights they come from.** A source weight changed in place
  (``load_state_dict``, ``copy_``, an optimizer, a fused LoRA) bumps its version counter; a write that
  bypasses it (``.data[...] =``, numpy, an inference tensor) is seen where it changes a sampled element:
  one of every output channel (of a share of them past a budget), at a different position in each
  (sampling.py: one gather a call). Only the recipes that read a changed weight are replayed, *into*
  the prepacked tensor they made before, so nothing new is handed over;
  ``aotbuild.refresh(pipe)`` replays every recipe for the writes no check sees (docs/prepack.md);
* **memory stays flat.** What the package is handed is an alias that does not own its memory
  (handover.py), so torch 2.13's runtime, which never releases what it is handed, pins nothing;
* **a call is atomic.** Check, rebind and run happen under the runner's lock: a second thread's call
  waits (a package runs one call at a time anyway: one runner per container).

A copy (``copy.deepcopy`` of the served module or pipeline) gets a runner of its own over the copy's
weights, with the package opened again (:meth:`PackageRunner.copy_for`): never one that serves the
original's weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from aotbuild.errors import PackageMismatch
from aotbuild.strategies import discard as discarding
from aotbuild.strategies import handover, prepack
from aotbuild.strategies.calls import copyable, flatten_call, relayout
from aotbuild.strategies.discard import is_discarded
from aotbuild.strategies.sampling import Samples
from aotbuild.strategies.subclasses import inner_tensors, is_subclass, store_key, unwrapped


def lookup(module: Any, fqn: str) -> tuple[Any, dict[str, Any] | None, list[tuple[dict[str, Any], str, Any]]]:
    """``module``'s parameter or buffer ``fqn`` (or None), the dict it lives in, and the path to it as
    (parent's ``_modules``, name, child) edges: walked afresh at a rebind (a submodule replaced since, a
    LoRA wrapper, must not leave the runner reading the old one), checked edge by edge at every call.
    A name torch.export gives a tensor-subclass weight's inner tensor (subclasses.unwrapped), where the
    module has no tensor under that name (a real parametrization, weight_norm's, has one), is that inner
    tensor of the subclass weight; its dict is the one the subclass weight lives in."""
    found = _walk(module, fqn.split("."))
    parts = unwrapped(fqn) if found[0] is None else None
    if parts is None:
        return found
    t, store, edges = _walk(module, [*filter(None, parts[0].split(".")), parts[1]])
    if t is None or not is_subclass(t):
        return None, None, edges
    inner = inner_tensors(t)
    return (inner[parts[2]] if parts[2] < len(inner) else None), store, edges


def _walk(module: Any, names: list[str]) -> tuple[Any, dict[str, Any] | None, list[tuple[dict[str, Any], str, Any]]]:
    *path, leaf = names
    edges = []
    for part in path:
        children = getattr(module, "_modules", None)
        child = children.get(part) if children is not None else None
        if child is None:
            return None, None, edges
        edges.append((children, part, child))
        module = child
    for store in (module._parameters, module._buffers):
        tensor = store.get(leaf)
        if tensor is not None:
            return tensor, store, edges
    return None, None, edges


def _version(t: Any) -> int:
    """A tensor's version counter (bumped by every in-place change); an inference tensor has none,
    and cannot be changed in place outside inference mode either."""
    return -1 if t.is_inference() else t._version


#: Read by a package's library once, at its first call (a function-local static in the generated C++):
#: "1" makes every call check its inputs' sizes, strides, dtype and device against what the package was
#: built for, so a manifest whose recorded signature is not its package's is refused at the first call,
#: never served at a wrong shape (a few comparisons per input).
CHECK_INPUTS = "AOTI_RUNTIME_CHECK_INPUTS"
_CHECK_LOCK = threading.Lock()
_CHECK: dict[str, Any] = {"depth": 0, "set": False}


@contextlib.contextmanager
def inputs_checked() -> Iterator[None]:
    """While active, :data:`CHECK_INPUTS` is "1" for the packages making their first call: set only
    around those calls (it was set for the whole process, where a user's own AOTInductor packages read
    it too, issue 52), and never where the process set it itself (a caller's "0" is respected)."""
    with _CHECK_LOCK:
        if _CHECK["depth"] == 0 and CHECK_INPUTS not in os.environ:
            os.environ[CHECK_INPUTS] = "1"
            _CHECK["set"] = True
        _CHECK["depth"] += 1
    try:
        yield
    finally:
        with _CHECK_LOCK:
            _CHECK["depth"] -= 1
            if _CHECK["depth"] == 0 and _CHECK["set"]:
                os.environ.pop(CHECK_INPUTS, None)
                _CHECK["set"] = False


def named_tensors(module: Any) -> dict[str, Any]:
    """Every parameter and buffer of ``module`` under every name it has: torch.export names a tied
    weight or a buffer registered twice by each of its names, and a package asks for the one its
    graph read (``named_parameters()`` keeps only the first: the build refused 'the package needs
    constant c.alias', issue 36 item 4). A tensor-subclass weight (torchao's quantized ones) is its
    plain inner tensors, under the names torch.export gives them (:func:`unwrapped`), as a package
    reads them."""
    out = {}
    for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        if is_subclass(t):
            prefix, _, leaf = name.rpartition(".")
            for i, inner in enumerate(inner_tensors(t)):
                out[f"{prefix}{'.' if prefix else ''}parametrizations.{leaf}.original{i}"] = inner
        else:
            out[name] = t
    return out


def tensor_digest(t: Any) -> str:
    import torch

    data = t.detach().to("cpu").contiguous()
    if data.dtype == torch.bfloat16:  # numpy has no bfloat16: hash the raw 16-bit words
        data = data.view(torch.int16)
    return hashlib.sha256(memoryview(data.numpy()).cast("B")).hexdigest()  # read in place: no copy of the bytes


#: Below this many bytes in all, :func:`tensor_digests` hashes in the calling thread (a pool costs more).
PARALLEL_DIGEST_BYTES = 64 << 20


def tensor_digests(tensors: list[Any]) -> list[str]:
    """:func:`tensor_digest` of each, in order, on one thread per core: hashlib releases the GIL while it
    hashes. An int8static load hashes every weight (the SD 1.5-size UNet: 686 tensors, 3.3 GB) to know
    they are the ones calibrated on: 3.03 s in one thread, 1.66 s on 2 (a 2-core Xeon with SHA-NI,
    1.26 GB/s a core)."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    workers = min(len(tensors), os.cpu_count() or 1, 32)
    if workers < 2 or total < PARALLEL_DIGEST_BYTES:
        return [tensor_digest(t) for t in tensors]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="aotbuild-digest") as pool:
        return list(pool.map(tensor_digest, tensors))


def calibrated_problem(tensors: dict[str, Any], calibrated: dict[str, str]) -> str:
    """Why ``tensors`` are not the weights an int8static package was calibrated on (its record's
    ``calibrated``: every weight's sha256), or "". A weight dropped by ``discard_weights`` is skipped: only
    ``aotbuild.refit`` changes it, and that passes the new one here."""
    import torch

    present = {fqn: t for fqn in calibrated if isinstance(t := tensors.get(fqn), torch.Tensor) and not is_discarded(t)}
    digests = dict(zip(present, tensor_digests(list(present.values())), strict=True))
    for fqn, digest in calibrated.items():
        t = tensors.get(fqn)
        if isinstance(t, torch.Tensor) and is_discarded(t):
            continue
        if not isinstance(t, torch.Tensor) or digests[fqn] != digest:
            return (f"was calibrated on other weights (int8static: {len(calibrated)} weights, e.g. {fqn} differs): "
                    f"build the recipe with these weights")
    return ""


def baked_digests(module: Any, supplied: list[str] | dict[str, Any]) -> dict[str, str]:
    """sha256 of every tensor of ``module`` that the package does *not* take as a constant.

    Measured on the tiny UNet: ``get_constant_fqns()`` lists 143 of its 208 parameters and buffers;
    the other 65 (biases, norm weights) are compiled into the package itself. So a package embeds
    those values, and may only run with a module whose same tensors are equal. A tensor the package
    takes under another of its names (a tied weight) is supplied, not compiled in."""
    state = named_tensors(module)
    taken = {id(state[fqn]) for fqn in supplied if fqn in state}
    kept = {fqn: t for fqn, t in sorted(state.items()) if fqn not in supplied and id(t) not in taken}
    return dict(zip(kept, tensor_digests(list(kept.values())), strict=True))


def _describe(t: Any) -> tuple[list[int], str, str]:
    return list(t.shape), str(t.dtype).replace("torch.", ""), t.device.type


class PackageRunner:
    """One loaded package (``model``) bound to one module's live weights (module docstring).

    ``pinning``: the package's runtime keeps whatever it is handed (handover.leaks): hand it aliases.
    ``opener``: opens the package again, for a copy of the module (:meth:`copy_for`); None: copies
    are refused by name. ``bind_at_first_call``: under ``offload: model`` the weights are on the CPU
    until the offload hook moves them; bound then, and refused at load if anything but their device
    differs."""

    def __init__(self, model: Any, module: Any, component: str, package: dict[str, Any], device: str,
                 lifted: dict[str, Any] | None = None, bind_at_first_call: bool = False, *,
                 pinning: bool = False, opener: Callable[[], Any] | None = None, checked: bool = True):
        self.model = model
        #: the values of tensors the model makes in forward (stored beside the package), on the device
        self.lifted = lifted or {}
        self.module = module
        self.component = component
        self.package = package
        self.device = device
        self.meta: dict[str, list[Any]] = package["constants"]
        self.constant_strides: dict[str, list[int]] = package.get("constant_strides", {})
        self.strides = package.get("strides")
        self.baked: dict[str, str] = package.get("baked", {})
        #: int8static: every weight's sha256 at calibration; other values are refused, never served
        self.calibrated: dict[str, str] = package.get("calibrated", {})
        #: freezing (prepack.py): constants replayed from the module's weights, and the weights they come from
        self.derived: dict[str, dict[str, Any]] = package.get("derived", {})
        self.derived_from: dict[str, list[Any]] = package.get("derived_from", {})
        self.derived_values: dict[str, Any] = {}
        self._views: set[str] = set()  # derived constants that are views of a weight (never written into)
        self.unsupplied = set(package.get("lifted_unsupplied", []))
        self.pinning = pinning
        self.opener = opener
        self.bind_at_first_call = bind_at_first_call
        #: discard_weights=True (discard.py): the weights dropped as soon as their constants are derived
        self.discarding: set[str] = set()
        self.dropped = 0  # bytes of dense weights dropped
        self.lock = threading.RLock()
        #: handed-over tensors the package's runtime pins (not aliasable): kept for the next runner when
        #: this one goes (handover.retire), where the runtime pins them
        self._pinned: list[Any] = []
        #: what the package reads now, by name (the owners of the aliases it was handed)
        self.handed: dict[str, Any] = {}
        if pinning:
            import weakref

            weakref.finalize(self, handover.retire, self._pinned)
        self.rebinds = 0
        self.swaps = 0  # kept for reports: every instance has a package of its own since issue 52
        self.calls = 0
        self.replayed = 0  # recipes replayed since load (a changed weight replays only its own)
        #: every name the runner watches: supplied constants, derived constants' sources, baked tensors
        self.watched = list(dict.fromkeys((*self.meta, *self.derived_from, *self.baked)))
        self._readers = {src: [name for name, r in self.derived.items() if src in r["inputs"]]
                         for src in self.derived_from}
        if discarding.DISCARDING.get():
            self.discarding = set(discarding.discardable(self))
        self.bound: list[Any] | None = None  # the watched tensors' identity at the last bind
        self._last: dict[str, Any] = {}  # each watched tensor's identity at the last bind
        self._source_versions: dict[str, int] = {}
        self._edges: tuple[list[Any], list[str], list[Any]] = ([], [], [])
        self._stores: tuple[list[Any], list[str]] = ([], [])
        self._tracked: list[Any] = []  # the derived constants' sources that have a version counter
        self._samples: Samples | None = None  # the sources' sampled elements at the last derive
        #: whether the load checked the values of the tensors compiled in and calibrated on (check_baked):
        #: every other bind checks them itself (a copy's first, every rebind)
        self._values_checked = checked
        if not checked:
            return  # a copy's runner: its module is still being copied; checked and bound at its first call
        if not bind_at_first_call:
            self._bind()  # a module that does not fit is refused at load
        else:
            self._check(self._lookup_all()[0], device=False)

    # -- what the module holds now ------------------------------------------------------------

    def _lookup_all(self) -> tuple[dict[str, Any], list[tuple[dict[str, Any], str, Any]], list[Any]]:
        tensors, edges, stores = {}, {}, []
        for fqn in self.watched:
            t, store, path = lookup(self.module, fqn)
            tensors[fqn] = t
            stores.append(store)
            for parent, name, child in path:
                edges[(id(parent), name)] = (parent, name, child)
        return tensors, list(edges.values()), stores

    def _current(self) -> list[Any] | None:
        """The watched tensors, read through the edges and dicts of the last bind; None when a module on
        the way was replaced (then :meth:`_lookup_all` walks the paths again)."""
        parents, names, children = self._edges
        if list(map(dict.get, parents, names)) != children:
            return None
        return list(map(dict.get, *self._stores))

    @staticmethod
    def _identity(tensors: list[Any]) -> list[Any]:
        present = [t for t in tensors if t is not None]
        if len(present) != len(tensors):
            return [None]
        import torch

        # A new shape comes with new strides or new memory: sizes are not compared (77 us at SD 1.5 size)
        return [list(map(id, present)), list(map(torch.Tensor.data_ptr, present)),
                list(map(torch.Tensor.stride, present))]

    def _versions(self) -> list[int]:
        return [t._version for t in self._tracked]

    def _changed(self) -> bool:
        """Whether anything the package reads changed since the last bind (the per-call check)."""
        tensors = self._current()
        if tensors is None or self._identity(tensors) != self.bound[0] or self._versions() != self.bound[1]:
            return True
        return self._samples is not None and self._samples.moved()

    # -- binding --------------------------------------------------------------------------------

    def _check(self, tensors: dict[str, Any], device: bool = True, meta: dict[str, list[Any]] | None = None) -> None:
        """Every constant the package asked for, with its shape, dtype and (``device``) device."""
        # AOTInductor takes a missing buffer or lifted constant with a warning, and the next call
        # segfaults: every name it asked for must be supplied (a missing parameter it does refuse).
        for fqn, (shape, dtype, device_kind) in (self.meta if meta is None else meta).items():
            t = tensors[fqn]
            if t is None:
                raise PackageMismatch(f"{self.component}: the module has no {fqn!r}, which its AOT package needs; "
                                      f"rebuild the recipe for this model")
            have = _describe(t)
            if have[:2] != (shape, dtype) or (device and have[2] != device_kind):
                raise PackageMismatch(
                    f"{self.component}: {fqn} is now {have[1]} {have[0]} on {have[2]}, but its AOT package was "
                    f"built for {dtype} {shape} on {device_kind}; rebuild the recipe for this dtype/device or "
                    f"load it again with load_compiled")
            strides = self.constant_strides.get(fqn)
            if strides is not None and list(t.stride()) != strides and t.numel() > 1:
                raise PackageMismatch(
                    f"{self.component}: {fqn} has strides {list(t.stride())}, but its AOT package reads it with "
                    f"{strides} (another memory format: channels_last?); convert it back "
                    f"(.to(memory_format=torch.contiguous_format)) or rebuild the recipe for this layout")

    def calibrated_problem(self, given: dict[str, Any] | None = None) -> str:
        """int8static: why the module's weights, with ``given`` (name -> tensor) in place of its own, are not
        the ones the package was calibrated on, or "" (and "" for any other package)."""
        if not self.calibrated:
            return ""
        return calibrated_problem({**named_tensors(self.module), **(given or {})}, self.calibrated)

    def _check_values(self) -> None:
        """The values a package cannot follow: int8static's weights (its scales are theirs) and the tensors
        compiled into it, each as the build digested them."""
        why = self.calibrated_problem()
        if why:
            raise PackageMismatch(f"{self.component}: its AOT package {why}, or load_compiled again with the "
                                  f"weights it was built for")
        if self.baked and baked_digests(self.module, [*self.meta, *self.derived_from]) != self.baked:
            raise PackageMismatch(f"{self.component}: tensors compiled into its AOT package changed since load; "
                                  f"rebuild the recipe for these weights")

    def _hand_over(self, tensors: dict[str, Any]) -> None:
        if tensors:
            self.model.load_constants(handover.prepare(tensors, self.pinning), check_full_update=False,
                                      user_managed=True)
        # An alias does not own what it reads: the tensor itself is kept until it is replaced here, so a
        # weight the module dropped (replaced, its module deleted) lives while a call may read it.
        self.handed.update(tensors)

    def _bind(self, full: bool = True) -> None:
        """Check what the module holds and hand the package what changed since the last bind (everything
        when ``full``): a replaced weight, and the prepacked constants replayed from changed sources."""
        tensors, edges, stores = self._lookup_all()
        self._check(tensors)
        if self.derived_from:
            self._check(tensors, meta=self.derived_from)
        if self.bound is not None or not self._values_checked:
            # a rebind or a copy's first bind (the load checked them): before anything is handed over, so a
            # refused change stays refused at every call until it is undone, never served with the package's
            # old values
            self._check_values()
        if self.bound is None:
            self._warn_inference(tensors)
        full = full or self.bound is None
        if full:
            changed, sources = set(self.watched), set(self.derived_from)
        else:
            now = dict(zip(self.watched, self._identity_each(tensors.values()), strict=True))
            changed = {fqn for fqn in self.watched if self._last.get(fqn) != now[fqn]}
            moved = self._samples.moved_names() if self._samples is not None else set()
            sources = {fqn for fqn in self.derived_from
                       if fqn in changed or fqn in moved or self._moved(fqn, tensors[fqn])}
        handed = {fqn: tensors[fqn] for fqn in self.meta if fqn in changed}
        new = self._derive(tensors, sources, full)
        if full:  # every name the package asked for: a missing one segfaults the next call
            lifted = {k: v for k, v in self.lifted.items() if k not in self.unsupplied}
            everything = {**handed, **lifted, **self.derived_values}
            self.model.load_constants(handover.prepare(everything, self.pinning), check_full_update=True,
                                      user_managed=True)
            self.handed = everything
        else:
            self._hand_over({**handed, **new})
        self._last = dict(zip(self.watched, self._identity_each(tensors.values()), strict=True))  # dropped ones too
        self._remember(tensors, edges, stores)
        if sources:
            handover.trim()  # the replays' temporaries, as large as the weights they read

    def _warn_inference(self, tensors: dict[str, Any]) -> None:
        """Inference tensors have no version counter: an in-place write to one (in inference mode) is seen
        only where it changes a sampled element. Said once per runner, at its first bind."""
        inference = [fqn for fqn in self.derived_from if tensors[fqn].is_inference()]
        if inference:
            import warnings

            warnings.warn(f"aotbuild: {self.component}: {len(inference)} weights its prepacked constants come from "
                          f"are inference tensors (e.g. {inference[0]}, made under torch.inference_mode()): an "
                          f"in-place write to one is not counted; call aotbuild.refresh(pipe) after such a write",
                          stacklevel=4)

    @staticmethod
    def _identity_each(tensors: Any) -> list[Any]:
        return [None if t is None else (id(t), t.data_ptr(), tuple(t.stride()), tuple(t.shape), t.dtype, t.device)
                for t in tensors]

    def _moved(self, fqn: str, t: Any) -> bool:
        """Whether source ``fqn``'s version counter moved since the last derive."""
        last = self._source_versions.get(fqn)
        return last is not None and not t.is_inference() and t._version != last

    def _derive(self, tensors: dict[str, Any], sources: set[str], full: bool) -> dict[str, Any]:
        """Replay the recipes that read a weight in ``sources`` (all of them when ``full``), into the
        prepacked tensors they made before where the result has their layout; the constants that are
        new tensors (to hand over)."""
        if not self.derived:
            return {}
        names = list(self.derived) if full else list(dict.fromkeys(n for s in sorted(sources)
                                                                   for n in self._readers[s]))
        inputs = {**tensors, **self.lifted}
        new = {}
        # discard_weights: each dense weight dropped once the last recipe reading it has run
        unread = {src: set(self._readers[src]) for src in self.discarding} if full else {}
        scratch = prepack.Scratch()  # the intermediates' memory, reused from one recipe to the next
        for name in names:
            old = self.derived_values.get(name)
            if old is not None and all(is_discarded(inputs[i]) for i in self.derived[name]["inputs"]
                                       if i not in self.lifted):
                continue  # discard_weights: only aotbuild.refit changes it (discard.py)
            value = self._replay(name, inputs, scratch)
            for src in self.derived[name]["inputs"]:
                readers = unread.get(src)
                if readers is not None:
                    readers.discard(name)
                    if not readers:  # its last reader ran: the dense weight goes now
                        del unread[src]
                        self.dropped += discarding.drop(self.module, src, f"{self.component}.{src}")
                        tensors[src] = inputs[src] = lookup(self.module, src)[0]
            self._settle(name, value, inputs, new)
            self.replayed += 1
            del value
        return new

    def _replay(self, name: str, inputs: dict[str, Any], scratch: prepack.Scratch | None = None) -> Any:
        try:
            return prepack.replay(self.derived[name], inputs, scratch)
        except prepack.RecipeError as exc:
            raise prepack.RecipeError(f"{self.component}: the recipe of {name!r}: {exc}") from None

    def _settle(self, name: str, value: Any, inputs: dict[str, Any], new: dict[str, Any]) -> None:
        """Keep ``value``, the re-derived constant ``name``: written into the one handed over where it has
        its layout and owns its memory, else kept to hand over (in ``new``). A constant that is a view of
        a weight (a reshape) is never written into: that would write into the weight the user's module
        held before (a checkpoint it may keep to swap back)."""
        old = self.derived_values.get(name)
        if old is not None and name not in self._views and _same_layout(old, value):
            _write_into(old, value)  # in place: the package reads it as it is, nothing is handed over
            return
        if any(_shares_memory(value, inputs.get(i)) for i in self.derived[name]["inputs"]):
            self._views.add(name)
        else:
            self._views.discard(name)
        if self.pinning and not handover.aliasable(value):  # pinned once handed over: a pooled one
            value = handover.reuse(value)
            self._pinned.append(value)
        self.derived_values[name] = new[name] = value

    def _remember(self, tensors: dict[str, Any], edges: list[Any], stores: list[Any]) -> None:
        self._edges = ([e[0] for e in edges], [e[1] for e in edges], [e[2] for e in edges])
        # a name the module lacks reads from an empty dict: None, so every call rebinds, and the bind refuses it
        # the key each tensor is under in its dict: a subclass weight's inner tensor is read through the weight
        self._stores = ([st if st is not None else {} for st in stores],
                        [fqn.rsplit(".", 1)[-1] if st is None or st.get(fqn.rsplit(".", 1)[-1]) is tensors[fqn]
                         else store_key(fqn) for fqn, st in zip(self.watched, stores, strict=True)])
        kept = [f for f in self.derived_from if not tensors[f].is_inference() and not is_discarded(tensors[f])]
        self._source_versions = {f: tensors[f]._version for f in kept}
        # and a tensor compiled into the package, changed in place, must be seen (and refused)
        kept += [f for f in self.baked if f not in self._source_versions and tensors[f] is not None
                 and not tensors[f].is_inference()]
        if self.calibrated:  # int8static: a weight handed over as it is (a bias), changed in place, is refused too
            kept += [f for f in self.meta if f not in kept and tensors[f] is not None and not tensors[f].is_inference()]
        self._tracked = [tensors[f] for f in kept]
        self._samples = Samples({fqn: tensors[fqn] for fqn in self.derived_from}) if self.derived_from else None
        # what the per-call check reads (:meth:`_current`): a subclass weight itself, not its inner tensors
        self.bound = [self._identity(self._current() or [None]), self._versions()]

    def forget_dense(self) -> None:
        """After :func:`~aotbuild.strategies.discard.discard`: watch the placeholders the module holds now
        (their identity; no version, no samples) and keep no reference to the dense weights."""
        tensors, edges, stores = self._lookup_all()
        self._last = dict(zip(self.watched, self._identity_each(tensors.values()), strict=True))
        self._remember(tensors, edges, stores)
        handover.trim()

    def refit(self, given: dict[str, Any]) -> int:
        """Replay every recipe that reads a weight in ``given`` (name -> tensor), with the given tensors in
        place of the module's (a discarded weight's only way to change), into the prepacked tensors handed
        over; how many were replayed."""
        with self.lock:
            tensors, edges, stores = self._lookup_all()
            inputs = {**tensors, **given}
            why = self.calibrated_problem(given)  # int8static: its scales are those of the weights calibrated on
            if why:
                raise PackageMismatch(f"{self.component}: refit: its AOT package {why}")
            names = list(dict.fromkeys(n for s in sorted(given) for n in self._readers.get(s, ())))
            new, scratch = {}, prepack.Scratch()
            for name in names:
                self._settle(name, self._replay(name, {**inputs, **self.lifted}, scratch), inputs, new)
                self.replayed += 1
            self._hand_over(new)
            self._last = dict(zip(self.watched, self._identity_each(tensors.values()), strict=True))
            self._remember(tensors, edges, stores)
            handover.trim()
            return len(names)

    def refresh(self) -> None:
        """Replay every recipe on the weights as they are and hand over every tensor again: what a write
        no per-call check sees needs (``aotbuild.refresh``)."""
        with self.lock:
            self._bind(full=True)

    # -- calls ------------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if handover.TRIM_PENDING[0]:  # another runner went: the weights it served are free now
            handover.trim()
        with self.lock:  # a rebind and the call it serves are one step for other threads
            if self.bound is None:
                self._bind()  # the first call of a runner bound at its first call (offload, a copy)
            elif self._changed():  # pipe.to(...), dtype, LoRA fuse, new weights, an in-place write
                self.rebinds += 1
                self._bind(full=False)
            try:
                if self.calls:
                    self.calls += 1
                    return self.model(*args, **kwargs)
                with inputs_checked():
                    out = self.model(*args, **kwargs)
                self.calls += 1
                return out
            except RuntimeError as exc:  # the package's own input check (AOTI_RUNTIME_CHECK_INPUTS)
                if "input_handles[" not in str(exc):
                    raise
                first = next((x.strip() for x in str(exc).splitlines() if "input_handles[" in x), "")
                raise PackageMismatch(f"{self.component}: its AOT package {self.package['path']} refused the "
                                      f"call ({first}): it was not built for the call signature its manifest "
                                      f"records (a damaged or altered store: run aotbuild verify, rebuild the "
                                      f"recipe)") from None

    def adapt(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's inputs laid out as the package reads them. A package reads each input with the
        strides it was built for, so an input whose strides differ where it matters is copied into
        exactly those strides (``.contiguous()`` would not do: it keeps a size-1 dimension's stride
        and cannot make a strided layout). The inputs themselves when nothing differs (the usual case)."""
        if self.strides is None:
            return args, kwargs
        import torch
        from torch.utils._pytree import tree_unflatten

        leaves, spec = flatten_call(args, kwargs)
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if len(positions) != len(self.strides):
            raise PackageMismatch(f"{self.component}: called with {len(positions)} tensors, its AOT package was "
                                  f"built for {len(self.strides)}; rebuild the recipe")
        changed = False
        for i, want in zip(positions, self.strides, strict=True):
            t = leaves[i]
            if list(t.stride()) == list(want):  # exactly: the package checks every stride, size-1 ones too
                continue
            if t.dim() != len(want) or not copyable(t.shape, want):
                raise PackageMismatch(f"{self.component}: an input of shape {list(t.shape)} has strides "
                                      f"{list(t.stride())}; its AOT package was built for {want}, which no copy "
                                      f"can make; rebuild the recipe")
            leaves[i] = relayout(t, want)
            changed = True
        return tree_unflatten(leaves, spec) if changed else (args, kwargs)

    # -- copies -----------------------------------------------------------------------------------

    def copy_for(self, module: Any) -> PackageRunner:
        """A runner of the same package for ``module`` (a copy of this runner's): the package opened
        again, so the two never share constants; bound at its first call."""
        if self.opener is None:
            raise PackageMismatch(f"{self.component}: a copy of a served module cannot get its own AOT package "
                                  f"here (the package was not loaded from a store); load the copy with "
                                  f"load_compiled(recipe, pipe=copy)")
        return PackageRunner(self.opener(), module, self.component, self.package, self.device, self.lifted,
                             self.bind_at_first_call, pinning=self.pinning, opener=self.opener, checked=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> PackageRunner:
        import copy

        return self.copy_for(copy.deepcopy(self.module, memo))

    def __reduce__(self) -> Any:
        raise TypeError(f"{self.component}: a served AOT package cannot be pickled; torch.save the module (it "
                        f"saves as its eager self) or its state_dict")


def _shares_memory(value: Any, t: Any) -> bool:
    """Whether the dense tensor ``value`` is a view of the dense tensor ``t``'s memory."""
    if t is None or is_discarded(t) or getattr(value, "is_mkldnn", True) or getattr(t, "is_mkldnn", True):
        return False
    try:
        return t.device == value.device and t.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False


def _same_layout(a: Any, b: Any) -> bool:
    """Whether ``b`` can be written into ``a`` (a re-derived constant into the one handed over)."""
    if a.is_mkldnn or b.is_mkldnn:
        import torch

        return (a.is_mkldnn and b.is_mkldnn and a.dtype == b.dtype and a.shape == b.shape
                and torch.ops.mkldnn._nbytes(a) == torch.ops.mkldnn._nbytes(b))
    return (a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
            and a.untyped_storage().nbytes() == b.untyped_storage().nbytes())


#: The load report's note for a package with prepacked constants (once per load).
REFRESH_NOTE = ("prepacked weights follow any change of a weight's tensor and any in-place write that bumps its "
                "version counter; after a partial write that does not (w.data[...] = ..., numpy, an inference "
                "tensor), call aotbuild.refresh(pipe) (docs/prepack.md, \"Changing weights\")")


def _write_into(target: Any, value: Any) -> None:
    if target.is_mkldnn:
        target.copy_(value)  # oneDNN reorders into the target's own blocked layout
    else:
        target.untyped_storage().copy_(value.untyped_storage())


class PackageRoute:
    """A built signature's route to its runner: the call's inputs laid out as the package reads them,
    then the runner. A deep copy routes to a runner of its own over the copied module's weights."""

    def __init__(self, runner: PackageRunner):
        self.runner = runner

    @property
    def notes(self) -> tuple[str, ...]:
        return (REFRESH_NOTE,) if self.runner.derived else ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self.runner.adapt(args, kwargs)
        return self.runner(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> PackageRoute:
        import copy

        return PackageRoute(copy.deepcopy(self.runner, memo))
