"""Reading recipe files: bounded YAML (recipes come from pull requests) and finding them in folders.

A recipe file is read as a regular file of at most ``MAX_RECIPE_BYTES``, opened without blocking;
its YAML is composed into a node graph that is measured as if every alias were expanded (nodes,
depth, string length) before anything is constructed, with safe tags only. What comes out is plain
data for :func:`aotbuild.recipe.parse_structure`; validating it is aotbuild/recipes.py's concern.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aotbuild.errors import RecipeError

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
    import os
    import stat

    try:
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise RecipeError(source, None, "no such file") from None
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise RecipeError(source, None, "is a folder; name a .yaml file") from None
        if exc.errno == errno.ENAMETOOLONG:
            raise RecipeError(source[:80] + "...", None, "the path is too long") from None
        raise RecipeError(source, None, f"cannot be read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise RecipeError(source, None, "is a folder; name a .yaml file")
        if not stat.S_ISREG(info.st_mode):
            raise RecipeError(source, None, "is not a regular file (a pipe or a device?); name a .yaml file")
        if info.st_size > MAX_RECIPE_BYTES:
            raise RecipeError(source, None, f"is {info.st_size} bytes; a recipe may have at most {MAX_RECIPE_BYTES}")
        data = os.read(fd, MAX_RECIPE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_RECIPE_BYTES:
        raise RecipeError(source, None, f"is over {MAX_RECIPE_BYTES} bytes, the most a recipe may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(source, None, f"is not UTF-8 text (byte {exc.start})") from None


def _parse_yaml(source: str, text: str) -> Any:
    """YAML to plain data with bounded work: the node graph is composed (aliases stay references),
    measured as if every alias were expanded (nodes, depth, string length; a recursive alias is
    refused), and only then constructed. Safe tags only (yaml.SafeLoader)."""
    import yaml

    try:
        loader = yaml.SafeLoader(text)
    except yaml.YAMLError as exc:  # the reader refuses control characters before anything is parsed
        raise RecipeError(source, None, f"is not valid YAML: {str(exc).splitlines()[0]}") from None
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise RecipeError(source, None, f"is not valid YAML: {where}{problem} (check the indentation and "
                                            "the colons around there)") from None
        except RecursionError:
            raise RecipeError(source, None, f"is nested too deeply (at most {MAX_RECIPE_DEPTH} levels)") from None
        if node is None:
            raise RecipeError(source, None, "is empty: a recipe needs at least model and shapes "
                                            "(recipes/tiny_sd_cpu.yaml is a complete example)")
        _measure_yaml(source, node)
        try:
            return loader.construct_document(node)
        except yaml.YAMLError as exc:
            raise RecipeError(source, None, f"is not plain YAML data: {str(exc).splitlines()[0]}") from None
    finally:
        loader.dispose()


def _measure_yaml(source: str, root: Any) -> None:
    """Nodes and depth after alias expansion, computed once per distinct node (so a bomb of 10
    nested aliases costs 10 steps, not 10**9), without recursion."""
    import yaml

    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (nodes, depth) of its expansion
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes and not children_done:
            continue
        children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if not children_done:
            if isinstance(node, yaml.ScalarNode) and len(node.value) > MAX_RECIPE_STRING:
                line = node.start_mark.line + 1
                raise RecipeError(source, None, f"line {line}: a value of {len(node.value)} characters; at most "
                                                f"{MAX_RECIPE_STRING} are allowed")
            if key in on_path:
                raise RecipeError(source, None, f"line {node.start_mark.line + 1}: an alias refers to itself")
            on_path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            if len(on_path) > MAX_RECIPE_DEPTH:
                raise RecipeError(source, None, f"is nested more than {MAX_RECIPE_DEPTH} levels deep")
            continue
        on_path.discard(key)
        nodes = 1 + sum(sizes[id(c)][0] for c in children)
        depth = 1 + max((sizes[id(c)][1] for c in children), default=0)
        if nodes > MAX_RECIPE_NODES:
            raise RecipeError(source, None, f"expands to more than {MAX_RECIPE_NODES} values (aliases counted "
                                            f"as often as they are used)")
        if depth > MAX_RECIPE_DEPTH:
            raise RecipeError(source, None, f"is nested more than {MAX_RECIPE_DEPTH} levels deep")
        sizes[key] = (nodes, depth)


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
