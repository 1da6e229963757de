"""The blocks of ``compile.scope: regional``: which submodules are compiled (or packaged) one by one.

By default the classes diffusers lists in the component's ``_repeated_blocks`` (what
``compile_repeated_blocks`` compiles). A recipe's ``compile.blocks`` names them instead, for models
that list none (SD3's ``JointTransformerBlock``) or to pick some of them. Checked against the model:
against the loaded module by every build job and load, and by ``plan`` against a weightless copy
built from the component's config on the meta device, where that can be built.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from aotbuild.errors import UsageError

if TYPE_CHECKING:
    from aotbuild.recipe.schema import Recipe

#: How many repeating classes an error lists before "and N more".
SHOWN = 8


def repeating_classes(module: Any) -> list[tuple[str, int]]:
    """(class name, count) of every class with at least two instances in ``module``, torch's own
    layers (Linear, LayerNorm, ...) left out, in the order of first appearance: blocks come before
    the layers inside them."""
    counts: Counter[str] = Counter()
    for _, m in module.named_modules():
        if not type(m).__module__.startswith("torch."):
            counts[type(m).__name__] += 1
    return [(name, n) for name, n in counts.items() if n >= 2]


def describe_repeating(module: Any) -> str:
    """``"JointTransformerBlock x3, Attention x3, ..."``, or a sentence saying there are none."""
    found = repeating_classes(module)
    if not found:
        return f"{type(module).__name__} has no class that repeats"
    shown = ", ".join(f"{name} x{n}" for name, n in found[:SHOWN])
    more = f", and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    return f"its classes that repeat: {shown}{more}"


def block_problem(module: Any, classes: tuple[str, ...] | None) -> tuple[str, str]:
    """(recipe key, why ``classes`` cannot be the blocks of ``module``), or ("", "")."""
    from aotbuild.utils.suggest import suggest

    cls = type(module).__name__
    if not classes:
        declared = tuple(getattr(module, "_repeated_blocks", None) or ())
        if not declared:
            return ("compile.scope", f"regional scope needs the component's block classes; {cls} declares no "
                                     f"_repeated_blocks: name them in compile.blocks ({describe_repeating(module)}), "
                                     f"or use scope: full")
        if not any(type(m).__name__ in declared for _, m in module.named_modules()):
            return ("compile.scope", f"{cls} has none of its _repeated_blocks ({', '.join(declared)}): name its "
                                     f"block classes in compile.blocks ({describe_repeating(module)})")
        return ("", "")
    present = Counter(type(m).__name__ for name, m in module.named_modules() if name)
    for name in classes:
        if name not in present:
            known = [c for c, _ in repeating_classes(module)]
            return ("compile.blocks", f"{cls} has no block class {name!r}{suggest(name, known)} "
                                      f"({describe_repeating(module)})")
    chosen = [n for n, m in module.named_modules() if n and type(m).__name__ in classes]
    for name in chosen:  # a block inside another block would be compiled twice, once inlined
        outer = next((o for o in chosen if name.startswith(o + ".")), None)
        if outer is not None:
            inner_cls, outer_cls = type(module.get_submodule(name)).__name__, type(module.get_submodule(outer)).__name__
            return ("compile.blocks", f"{inner_cls} ({name}) is inside {outer_cls} ({outer}): name only one of them")
    return ("", "")


def select_blocks(module: Any, classes: tuple[str, ...] | None = None,
                  recipe: Recipe | None = None) -> list[tuple[str, Any]]:
    """(name, instance) of every block of ``classes`` (default: the module's ``_repeated_blocks``),
    outermost first; a recipe error (``recipe.error``) when they do not fit the module."""
    key, why = block_problem(module, classes)
    if why:
        raise recipe.error(key, why) if recipe is not None else UsageError(f"{key}: {why}")
    wanted = set(classes or getattr(module, "_repeated_blocks", None) or ())
    return [(name, m) for name, m in module.named_modules() if name and type(m).__name__ in wanted]


def compile_regional(module: Any, recipe: Recipe, compile_kwargs: dict[str, Any]) -> None:
    """diffusers' ``compile_repeated_blocks``, or with the recipe's ``compile.blocks`` the same thing
    for those classes: every instance compiled in place with ``block.compile(**compile_kwargs)``."""
    if recipe.compile.blocks is None:
        module.compile_repeated_blocks(**compile_kwargs)
        return
    for _, block in select_blocks(module, recipe.compile.blocks, recipe):
        block.compile(**compile_kwargs)


def meta_module(library: str, class_name: str, config: dict[str, Any]) -> Any:
    """The component built from its config on the meta device: every submodule, no weights, no
    memory; None when that cannot be done here (a class that is not importable, a custom init)."""
    import importlib
    import warnings

    if library not in ("diffusers", "transformers"):  # never import a module a model folder names
        return None
    try:
        import torch

        cls = getattr(importlib.import_module(library), class_name)
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            if hasattr(cls, "from_config"):  # diffusers
                return cls.from_config(config)
            if hasattr(cls, "config_class"):  # transformers
                return cls(cls.config_class.from_dict(config))
    except Exception:  # noqa: BLE001 - any failure only means plan cannot check; the job will
        return None
    return None


def blocks_setting(recipe: Recipe) -> dict[str, Any]:
    """The key factor of ``compile.blocks`` for a target's compile settings: absent when the recipe
    names none (so keys of recipes without it stay as they were), else the sorted class names."""
    return {} if recipe.compile.blocks is None else {"blocks": sorted(recipe.compile.blocks)}
