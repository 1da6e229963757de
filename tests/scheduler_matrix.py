"""The scheduler matrix (issue 56, item 4): each scheduler swapped after load into a served pipeline,
compared with an eager pipeline with that scheduler, the same seed and call. A cell is served (0
compiles: Inductor's code generation fails the cell, and Dynamo traces no graph; every denoiser call
routed to the entry; within 1e-4 of eager), or refused naming the scheduler and why (a regular
expression the refusal must match: a refusal for another reason fails), or the scheduler does not
work with the pipeline at all, in eager either (said with diffusers' reason). Used by
tests/test_schedulers.py (tiny-sd) and tests/test_regional.py (tiny-flux); docs/runtime.md shows the
results ("Schedulers").
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

#: What a cell expects: served, refused (its refusal matches ``names``), or not usable with the pipeline
#: (``names`` matches eager's own error).
SERVED, REFUSED, UNUSABLE = "served", "refused", "unusable"


@dataclass(frozen=True)
class Cell:
    scheduler: str
    expect: str = SERVED
    names: str = ""  # what a refusal (or eager's error) must say
    config: dict[str, Any] = field(default_factory=dict)  # from_config's overrides (use_flow_sigmas=True)
    call: dict[str, Any] = field(default_factory=dict)  # the call's own arguments (per-request guidance)
    needs: tuple[str, ...] = ()  # the libraries diffusers needs for this scheduler (``aotbuild[schedulers]``)


@contextlib.contextmanager
def no_codegen() -> Iterator[None]:
    """A compile is a failure: abort at Inductor's first code generation instead of waiting for it."""
    from unittest import mock

    from torch._inductor import compile_fx

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Inductor generated code: a cell compiled")

    with mock.patch.object(compile_fx._InProcessFxCompile, "codegen_and_compile", refuse):
        yield


def _made(cell: Cell, config: Any) -> Any:
    import diffusers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' notes on config keys a class does not take
        return getattr(diffusers, cell.scheduler).from_config(config, **cell.config)


def run(label: str, served: Any, eager_pipe: Any, cells: dict[str, Cell], call: dict[str, Any], component: str) -> dict:
    """Each cell on ``served`` (a pipeline load_compiled returned, ``on_miss="error"``) against a deep copy of
    ``eager_pipe`` (the same model, never compiled), under :func:`no_codegen`. Returns label -> what
    happened, for the printed matrix."""
    threads = torch.get_num_threads()
    # One thread: the tiny models gain nothing from two, and an AOT package's OpenMP threads spinning after its
    # call slowed the eager pipeline's next ops tenfold on a shared 2-core host.
    torch.set_num_threads(1)
    try:
        with no_codegen():
            return _run(label, served, eager_pipe, cells, call, component)
    finally:
        torch.set_num_threads(threads)


def _run(label: str, served: Any, eager_pipe: Any, cells: dict[str, Cell], call: dict[str, Any],
         component: str) -> dict:
    from torch._dynamo.utils import counters

    from aotbuild.dispatch import dispatchers
    from aotbuild.errors import ShapeNotBuilt

    own = served.scheduler.config
    routed = dispatchers(getattr(served, component))
    results = {}
    for name, cell in cells.items():
        missing = [m for m in cell.needs if importlib.util.find_spec(m) is None]
        if missing:  # pyproject.toml's ``schedulers`` extra: CI's newest job installs it and runs this cell
            results[name] = f"not run here: needs {', '.join(missing)} (pip install 'aotbuild[schedulers]')"
            continue
        kwargs = {**call, **cell.call}
        eager = copy.deepcopy(eager_pipe)
        try:
            eager.scheduler = _made(cell, own)
            expected = _image(eager, kwargs)
        except Exception as exc:  # noqa: BLE001 - the scheduler does not work with this pipeline in eager
            why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            results[name] = f"not usable with {type(eager_pipe).__name__}, in eager either: {why}"
            assert cell.expect == UNUSABLE and re.search(cell.names, why), f"{label} {name}: eager failed: {why}"
            continue
        served.scheduler = _made(cell, own)
        graphs = counters["stats"]["unique_graphs"]
        before = [dict(d.calls) for d in routed]
        try:
            got = _image(served, kwargs)
        except ShapeNotBuilt as exc:
            results[name] = f"refused: {exc}"
            assert cell.expect == REFUSED, f"{label} {name}: refused: {exc}"
            assert cell.scheduler in str(exc) and re.search(cell.names, str(exc)), f"{label} {name}: {exc}"
            continue
        error = (got - expected).abs().max().item()
        built = sum(d.calls["built"] - b["built"] for d, b in zip(routed, before, strict=True))
        unbuilt = sum(d.calls["unbuilt"] - b["unbuilt"] for d, b in zip(routed, before, strict=True))
        results[name] = f"served, {error:.1e} from eager ({built} compiled calls)"
        assert cell.expect == SERVED, f"{label} {name}: served, but expected {cell.expect}"
        assert built >= 1 and unbuilt == 0, f"{label} {name}: {built} calls served, {unbuilt} not"
        assert counters["stats"]["unique_graphs"] == graphs, f"{label} {name}: Dynamo traced"
        assert error <= 1e-4, f"{label} {name}: {error} from eager"
    print(f"\n{label}:\n" + "\n".join(f"  {n}: {r[:300]}" for n, r in results.items()))
    return results


def _image(pipe: Any, kwargs: dict[str, Any]) -> Any:
    torch.manual_seed(0)  # schedulers that draw their own noise (ancestral, SDE) draw the same
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="pt").images.float()
