"""Reading recipe files: bounded YAML (recipes come from pull requests) and finding them in folders.

A recipe file is read as a regular file of at most ``MAX_RECIPE_BYTES``, opened without blocking;
its YAML is composed into a node graph that is measured as if every alias were expanded (nodes,
depth, string length) before anything is constructed, with safe tags only. What comes out is plain
data for :func:`aotbuild.recipe.schema.parse_structure`; validating it is aotbuild/recipe/rules.py's concern. The
reading and the measuring are aotbuild.utils.safeio's (the one reader of outside files); the caps are here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aotbuild.errors import RecipeError
from aotbuild.utils import safeio

#: Caps on a recipe file, checked while it is read (recipes come from pull requests: docs/recipes.md).
MAX_RECIPE_BYTES = 1 << 20
MAX_RECIPE_NODES = 100_000  # after alias expansion: an alias "billion laughs" is refused, not expanded
MAX_RECIPE_DEPTH = 64
MAX_RECIPE_STRING = 4096


def read_recipe_data(path: str | Path) -> Any:
    """One recipe file's YAML as plain data, read with bounded work (every problem a RecipeError)."""
    source = str(path)
    return _parse_yaml(source, _read_recipe_text(source))


def _read_recipe_text(source: str) -> str:
    """A regular file of at most MAX_RECIPE_BYTES, opened without blocking (a FIFO cannot hang us)."""
    import errno

    try:
        return safeio.read_text(source, MAX_RECIPE_BYTES)
    except FileNotFoundError:
        raise RecipeError(source, None, "no such file") from None
    except safeio.NotRegularFile as exc:
        if exc.is_dir:
            raise RecipeError(source, None, "is a folder; name a .yaml file") from None
        raise RecipeError(source, None, "is not a regular file (a pipe or a device?); name a .yaml file") from None
    except safeio.FileTooLarge as exc:
        if exc.size is None:
            raise RecipeError(source, None, f"is over {MAX_RECIPE_BYTES} bytes, the most a recipe may have") from None
        raise RecipeError(source, None, f"is {exc.size} bytes; a recipe may have at most {MAX_RECIPE_BYTES}") from None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise RecipeError(source[:80] + "...", None, "the path is too long") from None
        raise RecipeError(source, None, f"cannot be read: {exc.strerror or exc}") from None
    except safeio.BadData as exc:
        raise RecipeError(source, None, f"is {exc}") from None


def _parse_yaml(source: str, text: str) -> Any:
    """YAML to plain data with bounded work (aotbuild.utils.safeio.loads_yaml: measured as if every alias
    were expanded before anything is constructed, safe tags only); an empty file is refused."""
    empty = object()
    try:
        data = safeio.loads_yaml(text, max_nodes=MAX_RECIPE_NODES, max_depth=MAX_RECIPE_DEPTH,
                                 max_string=MAX_RECIPE_STRING, empty=empty)
    except safeio.BadData as exc:
        raise RecipeError(source, None, str(exc)) from None
    if data is empty:
        raise RecipeError(source, None, "is empty: a recipe needs at least model and shapes "
                                        "(recipes/tiny_sd_cpu.yaml is a complete example)")
    return data


def repository(folder: Path) -> Path:
    """The repository a recipe is in: its nearest folder holding .git or pyproject.toml, else its own. A
    file a recipe names (a LoRA adapter, a warmup image) must be inside it."""
    folder = folder.resolve()
    for candidate in (folder, *folder.parents):
        if (candidate / ".git").exists() or (candidate / "pyproject.toml").is_file():
            return candidate
    return folder


def find_recipes(paths: list[str] | tuple[str, ...]) -> list[Path]:
    """Files named directly, and every ``*.yaml``/``*.yml`` inside folders, sorted, without repeats."""
    found: list[Path] = []
    for item in paths:
        p = Path(item)
        if p.is_dir():
            found.extend(sorted(x for x in p.rglob("*") if x.suffix in (".yaml", ".yml") and x.is_file()))
        else:
            found.append(p)
    seen: set[Path] = set()
    unique = []
    for p in found:
        r = p.resolve()
        if r not in seen:
            seen.add(r)
            unique.append(p)
    return unique
