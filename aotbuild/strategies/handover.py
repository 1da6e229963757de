"""Handing tensors to an AOTInductor package without pinning them for the life of the process (issue 52).

A package built without weights is given its constants at load with ``load_constants(...,
user_managed=True)``: the package reads the given tensors' memory, nothing is copied. In torch 2.13 the
package's runtime (header code compiled into every package's ``.so``: ``MaybeOwningAtenTensorHandle``
in ``aoti_runtime/utils.h``) takes a new reference to each such tensor (``aoti_torch_new_tensor_handle``)
and never drops it: not when the constant is replaced, not when the package is freed. The fix is
upstream (pytorch#194480), not in 2.13, and even there ``free_inactive_constant_buffer()`` does not
release user-managed handles. So every tensor ever handed over stayed in memory: a weight swap that
replaced tensors, every re-derived prepacked set, every reload kept a full copy of the weights
(measured: 6 swaps grew RSS by 6x the UNet's bytes, 2 reloads by 4x).

The way round it here: what a package is handed is an *alias* of the tensor, a tensor over the same
memory whose storage does not own it (a ``ctypes`` buffer over the address, wrapped by
``torch.frombuffer``). The leaked reference then pins the alias (a few hundred bytes of bookkeeping), not
the memory, which goes when its real owner drops it. That owner is the served module (its weights) or
the runner (the derived, prepacked constants); the runner checks before every call that the module
still holds the tensors it handed over and hands over new aliases when it does not, so the package
never reads memory its owner freed. And the runner hands over as little as it can: a weight changed in
place is re-derived *into* the prepacked tensor it had (runner.PackageRunner), so a swap hands over nothing.

Whether a package's runtime leaks is a property of the torch that compiled it (header code), so it is
found out on the package itself (:func:`leaks`), once per torch version that built the entries a
process loads: a small probe tensor is handed over, replaced, and its buffer's release observed
(in process, on the very package: deterministic, where a subprocess looping handovers would measure RSS).
Where the runtime releases what it is given, the tensors are handed over as they are.

Aliases are made for dense CPU tensors. A tensor no alias can be made of stays pinned once handed over
on a leaking torch: oneDNN's prepacked weights (opaque tensors, the bulk of a frozen package's constants)
and tensors on another device. For those, nothing new is handed over while a runner lives (its changed
constants are written into the tensors it handed over), and when a runner goes (a reload, a dropped
copy), the pinned tensors it handed over are kept in a pool (:func:`retire`) that the next runner's
constants of the same shape and layout are written into (:func:`reuse`) instead of allocating more:
a process holds at most as many such sets as it ever served at once. The pool holds only memory the
leaked references pin anyway.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

#: torch version that built the entry -> whether its packages' runtime pins what it is handed
_LEAKS: dict[str, bool] = {}
#: guards _LEAKS; the probe's gc.collect() runs finalizers, among them a dropped runner's retire (which
#: takes _LOCK): one lock for both deadlocked a load in a process that had dropped a pinning runner
_LEAKS_LOCK = threading.Lock()
#: guards _POOL; reentrant: a collection inside a pool operation may run a dropped runner's retire
_LOCK = threading.RLock()


class _Buffer(bytearray):
    """A probe's memory: a bytearray that can be referred to weakly."""


def probe(model: Any, name: str) -> bool:
    """Whether ``model`` (a loaded package) keeps a reference to a tensor handed over with
    ``user_managed=True`` after that constant is replaced. Hands ``name`` a one-element tensor, then
    another; the caller binds the real constants after (the package never runs with these)."""
    import torch

    buffer = _Buffer(8)
    released = weakref.ref(buffer)
    first = torch.frombuffer(buffer, dtype=torch.uint8)
    model.load_constants({name: first}, check_full_update=False, user_managed=True)
    del first, buffer
    model.load_constants({name: torch.zeros(1, dtype=torch.uint8)}, check_full_update=False, user_managed=True)
    gc.collect()
    return released() is not None


def leaks(model: Any, names: list[str], built_by: str | None) -> bool:
    """Whether packages built by torch ``built_by`` pin what they are handed (probed on ``model`` the
    first time a process meets that version; every time where the version is not known)."""
    if not names:
        return False
    with _LEAKS_LOCK:
        if built_by is not None and built_by in _LEAKS:
            return _LEAKS[built_by]
        leaking = probe(model, names[0])
        if built_by is not None:
            _LEAKS[built_by] = leaking
        return leaking


def alias(t: Any) -> Any:
    """A tensor over ``t``'s memory, with ``t``'s shape, strides, offset and dtype, whose storage does
    not own that memory; ``t`` itself where no alias can be made (not on the CPU, no storage, a
    oneDNN-opaque tensor). The caller keeps ``t`` alive for as long as the alias is read."""
    import ctypes

    import torch

    if (t.device.type != "cpu" or t.is_mkldnn or t.is_sparse or t.numel() == 0
            or type(t) not in (torch.Tensor, torch.nn.Parameter)):
        return t
    storage = t.untyped_storage()
    nbytes, address = storage.nbytes(), storage.data_ptr()
    if nbytes == 0 or address == 0 or nbytes % t.element_size():
        return t
    raw = torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)
    return raw.view(t.dtype).as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())


def aliasable(t: Any) -> bool:
    """Whether :func:`alias` makes an alias of ``t`` (else ``t`` stays pinned once handed over)."""
    return alias(t) is not t


#: tensors pinned by a dropped package's leaked references, by shape and layout, for reuse
_POOL: dict[tuple[Any, ...], list[Any]] = {}


def _pool_key(t: Any) -> tuple[Any, ...]:
    import torch

    nbytes = torch.ops.mkldnn._nbytes(t) if t.is_mkldnn else t.untyped_storage().nbytes()
    return (t.is_mkldnn, tuple(t.shape), tuple(t.stride()) if not t.is_mkldnn else (), t.dtype, str(t.device), nbytes)


def retire(tensors: list[Any]) -> None:
    """Keep ``tensors`` (handed over, not aliasable, so pinned for the process's life) for :func:`reuse`;
    called as a runner is collected, before its module's weights are freed, so the memory they free is
    given back at the next call of any runner (:data:`TRIM_PENDING`)."""
    with _LOCK:
        for t in tensors:
            _POOL.setdefault(_pool_key(t), []).append(t)
        tensors.clear()
    TRIM_PENDING[0] = True


#: A runner went (a reload, a dropped copy): its module's freed weights are given back to the system
#: (:func:`trim`) at the next call of a package (runner.py), not left in the C allocator's heaps.
TRIM_PENDING = [False]


def reuse(value: Any) -> Any:
    """A pinned tensor of the pool with ``value``'s shape and layout, holding ``value``'s values; or
    ``value`` itself where the pool has none."""
    key = _pool_key(value)
    with _LOCK:
        kept = _POOL.get(key)
        if not kept:
            return value
        target = kept.pop()
    if target.is_mkldnn:
        target.copy_(value)  # oneDNN copies into the target's own blocked layout
    else:
        target.untyped_storage().copy_(value.untyped_storage())
    return target


def pooled() -> int:
    """How many pinned tensors wait in the pool (tests, benchmarks)."""
    with _LOCK:
        return sum(map(len, _POOL.values()))


_LIBC: list[Any] = []


def trim() -> None:
    """Give the memory the C allocator holds free back to the system (glibc's ``malloc_trim``), after a
    rebind freed a set of temporaries as large as the weights it replayed. glibc serves allocations of
    up to 32 MB from its heaps once it saw one freed (its dynamic mmap threshold), and a heap keeps freed
    memory: a server swapping weights of a mid-size model grew by about a quarter of the weights per swap
    until it settled at several times their size (benchmarks/soak.py: 4x 9.4 MB convolutions, +5.5x the
    weights over 24 rounds; with the trim, flat). A no-op where the C library is not glibc."""
    if not _LIBC:
        import ctypes
        import ctypes.util

        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.append(getattr(libc, "malloc_trim", None))
        except OSError:
            _LIBC.append(None)
    TRIM_PENDING[0] = False
    if _LIBC[0] is not None:
        _LIBC[0](0)


def prepare(tensors: dict[str, Any], pinning: bool) -> dict[str, Any]:
    """What to hand a package for ``tensors``: aliases where its runtime pins what it is handed."""
    return {name: alias(t) for name, t in tensors.items()} if pinning else dict(tensors)
