"""The per-call sample check of a prepacked package's source weights (issue 52 item 3), in one gather.

A write to a weight that bypasses its version counter (``w.data[...] = ...``, numpy, an inference tensor)
leaves a prepacked copy stale. The runner (runner.py) compares, before every call, a few elements of
every source weight with their values at the last derive: one element of each output channel, at a
different position in each (the diagonal), for a weight of two or more dimensions, and
:data:`SAMPLES_PER_WEIGHT` spread over a smaller one. At SD 1.5 size that is 686 weights and ~110,000
elements; read as 686 views (``torch.cat`` or ``_foreach_copy_``), the check cost 1.2-1.6 ms a call,
about a microsecond and a half a view, against a steady UNet call of 0.9 s at 256x256.

Here the elements are read by **one gather per element size**: a tensor over the address range that
spans every sampled element (no memory of its own: a ``ctypes`` buffer at the lowest address, wrapped by
``torch.frombuffer``; the range holds unmapped holes, which nothing reads), indexed by each element's
offset from its start (``take``). The storages of the sampled weights are held, so an element's memory
stays valid even after its weight is replaced (``w.data = t`` swaps the storage of the same object):
the runner's identity check sees the replacement before it reads samples, and a write racing a call on
another thread reads the old memory, never freed memory. Weights not on the CPU, and any that cannot
be gathered so, are read as views.
"""

from __future__ import annotations

from typing import Any

#: Elements sampled per weight of fewer than two dimensions (first, last and evenly between).
SAMPLES_PER_WEIGHT = 4

#: An integer dtype per element size: the gather compares raw words, whatever the float format
_WORDS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def positions(t: Any) -> tuple[int, int, int] | None:
    """The sampled elements of ``t`` as (first storage index, step, count), or None where ``t`` is not a
    plain dense tensor (an expanded view, no data, a discarded or opaque one)."""
    if (t is None or t.numel() == 0 or type(t).__name__ == "DiscardedWeight" or t.is_mkldnn
            or t.device.type == "meta" or not _dense(t)):
        return None
    span, offset = t.numel(), t.storage_offset()
    if t.dim() >= 2 and t.shape[0] > 1 and t.is_contiguous():
        rows = t.shape[0]
        per_row = span // rows
        return offset, per_row + 1 if rows <= per_row else per_row, rows
    return offset, max(1, (span - 1) // (SAMPLES_PER_WEIGHT - 1)), min(SAMPLES_PER_WEIGHT, span)


def view(t: Any) -> Any:
    """The sampled elements of ``t`` as a view into its storage (read anew at every use); None as
    :func:`positions`."""
    where = positions(t)
    if where is None:
        return None
    offset, step, count = where
    return t.detach().as_strided((count,), (step,), offset)


def _dense(t: Any) -> bool:
    """Whether ``t``'s elements fill its storage span exactly, in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class Samples:
    """The sampled elements of some named tensors, their values when taken, and whether they moved."""

    def __init__(self, tensors: dict[str, Any]):
        import torch

        #: name -> (group, first, end): where its elements are in its group's values
        self.where: dict[str, tuple[int, int, int]] = {}
        #: per group: (the gather's flat tensor or None, index or the views, values when taken)
        self.groups: list[tuple[Any, Any, Any]] = []
        self._storages = []  # the sampled memory stays valid while these are held
        gathered: dict[tuple[int, str], list[tuple[str, list[int]]]] = {}
        viewed: list[tuple[str, Any]] = []
        for name, t in tensors.items():
            where = positions(t)
            if where is None:
                continue
            offset, step, count = where
            size = t.element_size()
            if t.device.type == "cpu" and size in _WORDS:
                base = t.untyped_storage().data_ptr()
                self._storages.append(t.untyped_storage())
                gathered.setdefault((size, "cpu"), []).append(
                    (name, [base + (offset + k * step) * size for k in range(count)]))
            else:
                viewed.append((name, view(t)))
        for (size, _), items in sorted(gathered.items()):
            self._add_gather(size, items, torch)
        if viewed:
            self._add_views(viewed, torch)

    def _add_gather(self, size: int, items: list[tuple[str, list[int]]], torch: Any) -> None:
        import ctypes

        addresses = [a for _, addrs in items for a in addrs]
        low = min(addresses) // size * size
        span = max(addresses) + size - low
        flat = torch.frombuffer((ctypes.c_char * span).from_address(low), dtype=getattr(torch, _WORDS[size]))
        index = torch.tensor([(a - low) // size for a in addresses], dtype=torch.int64)
        group, first = len(self.groups), 0
        for name, addrs in items:
            self.where[name] = (group, first, first + len(addrs))
            first += len(addrs)
        self.groups.append((flat, index, flat.take(index)))

    def _add_views(self, viewed: list[tuple[str, Any]], torch: Any) -> None:
        group, first = len(self.groups), 0
        for name, v in viewed:
            self.where[name] = (group, first, first + v.numel())
            first += v.numel()
        views = [v for _, v in viewed]
        self.groups.append((None, views, torch.cat([v.reshape(-1).to(views[0].dtype) for v in views])))

    @staticmethod
    def _read(flat: Any, index: Any) -> Any:
        import torch

        if flat is not None:
            return flat.take(index)
        return torch.cat([v.reshape(-1).to(index[0].dtype) for v in index])

    def moved(self) -> bool:
        """Whether any sampled element differs from its value when taken."""
        import torch

        return any(not torch.equal(self._read(flat, index), values) for flat, index, values in self.groups)

    def moved_names(self) -> set[str]:
        """The names whose sampled elements differ from their values when taken."""
        now = [self._read(flat, index) for flat, index, _ in self.groups]
        import torch

        return {name for name, (group, first, end) in self.where.items()
                if not torch.equal(now[group][first:end], self.groups[group][2][first:end])}
