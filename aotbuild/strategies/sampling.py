"""The per-call sample check of a prepacked package's source weights (issue 52 item 3), in one gather.

A write to a weight that bypasses its version counter (``w.data[...] = ...``, numpy, an inference tensor)
leaves a prepacked copy stale. The runner (runner.py) compares, before every call, some elements of
every source weight with their values at the last derive: for a weight of two or more dimensions one
element of each output channel, at a different position in each (the diagonal), within a budget of
elements per call (:data:`SAMPLE_BUDGET`: where the output channels of all the weights exceed it, an
evenly spaced share of each weight's channels); :data:`SAMPLES_PER_WEIGHT` spread over a smaller one.

Measured at SD 1.5 size (686 source weights, ~319,000 output channels; a steady UNet call of 0.92 s at
256x256 on 2 cores): read as one view per weight (``torch.cat``), 4-6 ms a call, about a microsecond
and a half a view; all 319,000 channels by one gather, 4.0 ms (each element in another page: memory
latency); 16,384 by one gather, ~0.2 ms.

The elements are read by **one gather per element size**: a tensor over the address range that spans
every sampled element (no memory of its own: a ``ctypes`` buffer at the lowest address, wrapped by
``torch.frombuffer``; the range holds unmapped holes, which nothing reads), indexed by each element's
offset from its start (``take``). The storages of the sampled weights are held, so an element's memory
stays valid even after its weight is replaced (``w.data = t`` swaps the storage of the same object):
the runner's identity check sees the replacement before it reads samples, and a write racing a call on
another thread reads the old memory, never freed memory. Weights not on the CPU, and any of an odd
element size, are read by a gather each.
"""

from __future__ import annotations

from typing import Any

#: Elements sampled per weight of fewer than two dimensions, and at least per larger one.
SAMPLES_PER_WEIGHT = 4

#: Elements read per call at most, over all the weights of one runner (module docstring). Where every
#: output channel fits (the tiny models; any model of up to ~16,000 output channels in all), every one
#: is read.
SAMPLE_BUDGET = 16384

#: An integer dtype per element size: the gather compares raw words, whatever the float format
_WORDS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def rows_of(t: Any) -> int:
    """How many elements of ``t`` one sample per output channel reads (its rows for a tensor of two or
    more dimensions, :data:`SAMPLES_PER_WEIGHT` otherwise), or 0 where ``t`` is no plain dense tensor
    (an expanded view, no data, a discarded or opaque one)."""
    if (t is None or t.numel() == 0 or type(t).__name__ == "DiscardedWeight" or t.is_mkldnn
            or t.device.type == "meta" or not _dense(t)):
        return 0
    return t.shape[0] if _by_rows(t) else min(SAMPLES_PER_WEIGHT, t.numel())


def _by_rows(t: Any) -> bool:
    return t.dim() >= 2 and t.shape[0] > 1 and t.is_contiguous()


def positions(t: Any, share: float = 1.0) -> list[int]:
    """Storage indices of ``t``'s sampled elements: for a tensor of two or more dimensions, one element of
    each sampled output channel, at a different position in each (row o at its o-th element, so a write
    to one output or input channel shows): every channel where ``share`` is 1, else that share of them,
    evenly spaced (at least :data:`SAMPLES_PER_WEIGHT`); for a smaller one, that many spread over it.
    [] where :func:`rows_of` is 0."""
    rows = rows_of(t)
    if not rows:
        return []
    span, offset = t.numel(), t.storage_offset()
    if _by_rows(t):
        per_row = span // rows
        count = rows if share >= 1 else min(rows, max(SAMPLES_PER_WEIGHT, int(rows * share)))
        picked = sorted({j * rows // count for j in range(count)})
        return [offset + r * per_row + r % per_row for r in picked]
    step = max(1, (span - 1) // (SAMPLES_PER_WEIGHT - 1))
    return [offset + k * step for k in range(rows)]


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

    def __init__(self, tensors: dict[str, Any], budget: int = SAMPLE_BUDGET):
        import torch

        #: name -> (group, first, end): where its elements are in its group's values
        self.where: dict[str, tuple[int, int, int]] = {}
        #: per group: (the gather's flat tensor, or None for tensors read one by one; its index, or the
        #: (tensor, index) pairs; the values when taken)
        self.groups: list[tuple[Any, Any, Any]] = []
        self._storages: list[Any] = []  # the sampled memory stays valid while these are held
        total = sum(rows_of(t) for t in tensors.values())
        share = 1.0 if total <= budget else budget / total
        #: whether every output channel of every sampled weight is read (else a share of them)
        self.every_channel = share >= 1
        gathered: dict[int, list[tuple[str, list[int]]]] = {}
        one_by_one: list[tuple[str, Any, Any]] = []
        for name, t in tensors.items():
            picked = positions(t, share)
            if not picked:
                continue
            size = t.element_size()
            if t.device.type == "cpu" and size in _WORDS:
                self._storages.append(t.untyped_storage())
                base = self._storages[-1].data_ptr()
                gathered.setdefault(size, []).append((name, [base + k * size for k in picked]))
            else:
                one_by_one.append((name, t.detach(), torch.tensor(picked, dtype=torch.int64, device=t.device)))
        for size, items in sorted(gathered.items()):
            self._add_gather(size, items, torch)
        if one_by_one:
            self._add_one_by_one(one_by_one)

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

    def _add_one_by_one(self, items: list[tuple[str, Any, Any]]) -> None:
        group, first = len(self.groups), 0
        for name, _, index in items:
            self.where[name] = (group, first, first + index.numel())
            first += index.numel()
        reads = [(t, index) for _, t, index in items]
        self.groups.append((None, reads, self._read(None, reads)))

    @staticmethod
    def _read(flat: Any, index: Any) -> Any:
        import torch

        if flat is not None:
            return flat.take(index)
        # each tensor's elements by storage index, through a view over its whole storage, as raw bytes
        return torch.cat([t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
                          .take(i).reshape(-1).view(torch.uint8) for t, i in index])

    def moved(self) -> bool:
        """Whether any sampled element differs from its value when taken."""
        import torch

        return any(not torch.equal(self._read(flat, index), values) for flat, index, values in self.groups)

    def moved_names(self) -> set[str]:
        """The names whose sampled elements differ from their values when taken."""
        import torch

        now = [self._read(flat, index) for flat, index, _ in self.groups]
        moved = set()
        for name, (group, first, end) in self.where.items():
            values = self.groups[group][2]
            if self.groups[group][0] is None:  # bytes: each tensor's elements are element_size bytes
                moved |= {name} if not torch.equal(now[group], values) else set()
            elif not torch.equal(now[group][first:end], values[first:end]):
                moved.add(name)
        return moved
