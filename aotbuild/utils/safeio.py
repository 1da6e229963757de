"""The one reader and writer of files that came from outside the package (docs/security.md).

Recipes, model folders, manifests, failure records, journals, ``pyproject.toml``, key files,
remote blobs and packs, LoRA files: each is read here, with bounded work, and each file aotbuild
writes in a place others read is written here, atomically. Standard library only (the runtime
imports it); YAML is imported when a YAML text is parsed.

Reading: :func:`open_regular` opens without blocking (a FIFO without a writer cannot hang a reader)
and refuses anything but a regular file (a FIFO, a device, a folder); ``follow_symlinks=False``
refuses a symbolic link as the last part of the path, ``within=FOLDER`` refuses a path whose real
path leaves that folder (a model folder's link out of it). A trusted-keys symlink is the operator's
choice, so key files follow links. :func:`read_bytes` reads at most ``max_bytes``.

Parsing: :func:`loads_json` measures size and nesting depth before ``json.loads`` (so a deep text is
refused, not a ``RecursionError``) and refuses NaN and Infinity; :func:`loads_toml` the same for
TOML; :func:`loads_yaml` composes the YAML node graph and measures it as if every alias were
expanded before anything is constructed, safe tags only.

Writing: :func:`atomic_write` writes a temp file in the destination's folder (or the one a caller's
``make_temp`` gives), fsyncs it and renames it into place; on any failure the temp file is removed.
:func:`place` puts a file made by a callback (a hard link, a copy) into place the same way,
:func:`write_new` creates a file that must not replace one (a private key), and
:func:`append_line` appends to a regular file that is not a link, without blocking.

Every refusal is an exception of this module: an ``OSError`` for the file (:class:`NotRegularFile`,
:class:`FileTooLarge`, :class:`LinkRefused`) and a ``ValueError`` for its content
(:class:`BadData`); callers turn them into their own one-line errors.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["NotRegularFile", "FileTooLarge", "LinkRefused", "BadData", "TooDeep", "open_regular", "read_bytes",
           "read_text", "read_tail", "json_depth", "loads_json", "read_json", "loads_toml", "loads_yaml",
           "atomic_write", "place", "write_new", "append_line"]


class NotRegularFile(IsADirectoryError):
    """Not a regular file: a FIFO, a device, a socket or a folder (an ``IsADirectoryError`` with
    errno EISDIR, as the store's readers raised before). ``is_dir`` says which."""

    def __init__(self, path: str | os.PathLike, is_dir: bool = False):
        super().__init__(errno.EISDIR, "is a folder" if is_dir else "not a regular file", str(path))
        self.is_dir = is_dir


class FileTooLarge(OSError):
    """More bytes than the caller allows; ``size`` is the file's size (None when it grew while read)."""

    def __init__(self, path: str | os.PathLike, limit: int, size: int | None):
        what = f"{size} bytes" if size is not None else "grew while read"
        super().__init__(errno.EFBIG, f"{what}, more than the {limit} allowed", str(path))
        self.limit, self.size = limit, size


class LinkRefused(OSError):
    """A symbolic link where the caller refuses one, or a real path outside the caller's folder."""

    def __init__(self, path: str | os.PathLike, why: str):
        super().__init__(errno.ELOOP, why, str(path))


class BadData(ValueError):
    """Content that is not what the caller may parse (not UTF-8, not JSON/TOML/YAML, NaN, too many values)."""


class TooDeep(BadData):
    """Nested deeper than the caller allows; ``depth`` is how deep (a lower bound for YAML)."""

    def __init__(self, message: str, depth: int, limit: int):
        super().__init__(message)
        self.depth, self.limit = depth, limit


# -- reading ----------------------------------------------------------------------------------

def open_regular(path: str | os.PathLike, *, follow_symlinks: bool = True,
                 within: str | os.PathLike | None = None) -> BinaryIO:
    """``path`` opened for reading (a blocking binary file), never blocking while it is opened.

    Refused: anything but a regular file (:class:`NotRegularFile`); with ``follow_symlinks=False``
    a symbolic link as the path's last part (:class:`LinkRefused`); with ``within``, a path whose
    real path is outside that folder (:class:`LinkRefused`). Other errors are the OSError of ``open``
    (FileNotFoundError ...)."""
    if within is not None and not Path(path).resolve().is_relative_to(Path(within).resolve()):
        raise LinkRefused(path, f"outside {within} (a symlink?)")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow_symlinks and exc.errno in (errno.ELOOP, errno.EMLINK):
            raise LinkRefused(path, "a symbolic link") from None
        if exc.errno == errno.ENXIO:  # a FIFO or socket opened without a partner
            raise NotRegularFile(path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, is_dir=stat.S_ISDIR(mode))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike, max_bytes: int, *, follow_symlinks: bool = True,
               within: str | os.PathLike | None = None) -> bytes:
    """The whole of a regular file of at most ``max_bytes`` (:func:`open_regular`'s refusals, and
    :class:`FileTooLarge` for a larger file, checked by its size and again while reading)."""
    with open_regular(path, follow_symlinks=follow_symlinks, within=within) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise FileTooLarge(path, max_bytes, size)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLarge(path, max_bytes, None)
    return data


def read_text(path: str | os.PathLike, max_bytes: int, *, follow_symlinks: bool = True,
              within: str | os.PathLike | None = None) -> str:
    """:func:`read_bytes` decoded as UTF-8 (:class:`BadData` when it is not)."""
    return _decode(read_bytes(path, max_bytes, follow_symlinks=follow_symlinks, within=within))


def read_tail(path: str | os.PathLike, max_bytes: int, *, follow_symlinks: bool = False) -> bytes:
    """The last ``max_bytes`` of a regular file (a log that only grows), from a line start when it
    was cut: what is read is bounded, whatever the file's size."""
    with open_regular(path, follow_symlinks=follow_symlinks) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            f.seek(size - max_bytes)
        data = f.read(max_bytes)
    if size > max_bytes:
        data = data[data.find(b"\n") + 1:] if b"\n" in data else b""
    return data


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadData(f"not UTF-8 text (byte {exc.start})") from None


# -- JSON and TOML ----------------------------------------------------------------------------

#: What decides the depth: a quote, an escape (inside a string it hides the next character) and brackets.
_SPECIAL = re.compile(r'\\.|["\[\]{}]', re.S)


def json_depth(text: str) -> int:
    """Deepest nesting of ``[`` and ``{`` in JSON text (strings skipped), without parsing it.

    One pass, linear in the text: a regular expression for whole strings backtracks from every
    unterminated quote, which made a hostile 1 MB header take hours (review of issue 30's safeio).
    A backslash outside a string is not JSON: the parser refuses it, and what is nested before it is counted."""
    depth = deepest = 0
    in_string = False
    for m in _SPECIAL.finditer(text):
        token = m.group()
        if in_string:
            in_string = token != '"'
        elif token == '"':
            in_string = True
        elif token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str | bytes, *, max_bytes: int, max_depth: int) -> Any:
    """JSON text to data with bounded work: at most ``max_bytes`` (:class:`BadData`), nested at most
    ``max_depth`` deep (:class:`TooDeep`, counted before parsing), no NaN or Infinity (:class:`BadData`)."""
    if len(text) > max_bytes:
        raise BadData(f"{len(text)} bytes, more than the {max_bytes} allowed")
    if isinstance(text, bytes):
        text = _decode(text)
    depth = json_depth(text)
    if depth > max_depth:
        raise TooDeep(f"JSON nested {depth} deep, more than the {max_depth} allowed", depth, max_depth)
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise BadData(f"not JSON ({str(exc)[:80]})") from None


def read_json(path: str | os.PathLike, *, max_bytes: int, max_depth: int, follow_symlinks: bool = True,
              within: str | os.PathLike | None = None) -> Any:
    """:func:`read_bytes` then :func:`loads_json`."""
    return loads_json(read_bytes(path, max_bytes, follow_symlinks=follow_symlinks, within=within),
                      max_bytes=max_bytes, max_depth=max_depth)


def loads_toml(text: str, *, max_depth: int) -> dict:
    """TOML text to data, its brackets counted before it is parsed (:class:`TooDeep`); a parse error
    is :class:`BadData` with tomllib's first line."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    depth = deepest = 0
    for c in text:  # brackets outside strings are rare enough in pyproject files: counting all is a bound
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(depth - 1, 0)
    if deepest > max_depth:
        raise TooDeep(f"nested more than {max_depth} levels deep", deepest, max_depth)
    try:
        return tomllib.loads(text)
    except (ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadData(reason[:200]) from None


# -- YAML -------------------------------------------------------------------------------------

def loads_yaml(text: str, *, max_nodes: int, max_depth: int, max_string: int, empty: Any = None) -> Any:
    """YAML to plain data with bounded work: the node graph is composed (aliases stay references),
    measured as if every alias were expanded (nodes, depth, string length; a recursive alias is
    refused), and only then constructed. Safe tags only (yaml.SafeLoader). A text without a
    document gives ``empty``. Every refusal is :class:`BadData` (:class:`TooDeep` for depth) with a one-line reason."""
    import yaml

    try:
        loader = yaml.SafeLoader(text)
    except yaml.YAMLError as exc:  # the reader refuses control characters before anything is parsed
        raise BadData(f"is not valid YAML: {str(exc).splitlines()[0]}") from None
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise BadData(f"is not valid YAML: {where}{problem} (check the indentation and the colons around "
                          f"there)") from None
        except RecursionError:
            raise TooDeep(f"is nested too deeply (at most {max_depth} levels)", max_depth + 1, max_depth) from None
        if node is None:
            return empty
        _measure_yaml(node, max_nodes=max_nodes, max_depth=max_depth, max_string=max_string)
        try:
            return loader.construct_document(node)
        except yaml.YAMLError as exc:
            raise BadData(f"is not plain YAML data: {str(exc).splitlines()[0]}") from None
    finally:
        loader.dispose()


def _measure_yaml(root: Any, *, max_nodes: int, max_depth: int, max_string: int) -> None:
    """Nodes and depth after alias expansion, computed once per distinct node (so a bomb of 10
    nested aliases costs 10 steps, not 10**9), without recursion."""
    import yaml

    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (nodes, depth) of its expansion
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    too_deep = f"is nested more than {max_depth} levels deep"
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes and not children_done:
            continue
        children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if not children_done:
            if isinstance(node, yaml.ScalarNode) and len(node.value) > max_string:
                line = node.start_mark.line + 1
                raise BadData(f"line {line}: a value of {len(node.value)} characters; at most {max_string} are "
                              f"allowed")
            if key in on_path:
                raise BadData(f"line {node.start_mark.line + 1}: an alias refers to itself")
            on_path.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            if len(on_path) > max_depth:
                raise TooDeep(too_deep, len(on_path), max_depth)
            continue
        on_path.discard(key)
        nodes = 1 + sum(sizes[id(c)][0] for c in children)
        depth = 1 + max((sizes[id(c)][1] for c in children), default=0)
        if nodes > max_nodes:
            raise BadData(f"expands to more than {max_nodes} values (aliases counted as often as they are used)")
        if depth > max_depth:
            raise TooDeep(too_deep, depth, max_depth)
        sizes[key] = (nodes, depth)


# -- writing ----------------------------------------------------------------------------------

class AtomicFile:
    """What :func:`atomic_write` yields: ``file`` to write to (binary), ``temp`` its path, and
    ``target``, where it goes on success (a caller that learns it while writing sets it then;
    :meth:`discard` drops the file instead)."""

    def __init__(self, file: BinaryIO, temp: str, target: Path | None):
        self.file, self.temp, self.target = file, temp, target
        self.discarded = False

    def discard(self) -> None:
        self.discarded = True


def _temp_beside(target: Path) -> tuple[int, str]:
    import tempfile

    return tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)


@contextlib.contextmanager
def atomic_write(target: str | os.PathLike | None, *, mode: int = 0o644,
                 make_temp: Callable[[], tuple[int, str]] | None = None) -> Iterator[AtomicFile]:
    """``with atomic_write(path) as w: w.file.write(...)``: a temp file (in ``path``'s folder, or
    from ``make_temp``: an open fd and its path in the same filesystem) is written, flushed, fsynced,
    given ``mode`` and renamed to ``w.target``; readers see the old file or the new one, never part.
    On any exception (or :meth:`AtomicFile.discard`) the temp file is removed and nothing is renamed."""
    final = Path(target) if target is not None else None
    if make_temp is None:
        if final is None:
            raise ValueError("atomic_write needs a target or make_temp")
        make_temp = lambda: _temp_beside(final)  # noqa: E731
    fd, temp = make_temp()
    try:
        with os.fdopen(fd, "wb") as out:
            handle = AtomicFile(out, temp, final)  # type: ignore[arg-type]
            yield handle
            out.flush()
            os.fsync(out.fileno())
        if handle.discarded:
            os.unlink(temp)
            return
        if handle.target is None:
            raise ValueError("atomic_write: no target was set")
        os.chmod(temp, mode)
        os.replace(temp, handle.target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def place(target: str | os.PathLike, make: Callable[[Path], None]) -> None:
    """Put the file ``make(temp)`` creates (a hard link, a copy) at ``target`` by one rename, from a
    temp name beside it; the temp name is removed whatever happens."""
    final = Path(target)
    temp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        make(temp)
        os.replace(temp, final)
    finally:
        if temp.exists() or temp.is_symlink():
            temp.unlink()


def write_new(path: str | os.PathLike, data: bytes, *, mode: int = 0o644) -> None:
    """Create ``path`` with ``data``, never replacing a file or following a link that is there
    (FileExistsError): for files that must not be overwritten (a private key)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def append_line(path: str | os.PathLike, line: str, *, mode: int = 0o644) -> None:
    """Append ``line`` and a newline to a log (created if missing), one write: never through a
    symbolic link, never to anything but a regular file, never blocking (a FIFO planted at a log's
    name is refused, not written to forever)."""
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NONBLOCK", 0)
             | getattr(os, "O_NOFOLLOW", 0))
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):
            raise LinkRefused(path, "a symbolic link") from None
        if exc.errno == errno.ENXIO:
            raise NotRegularFile(path) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(path, is_dir=stat.S_ISDIR(info.st_mode))
        os.write(fd, (line + "\n").encode("utf-8"))
    finally:
        os.close(fd)
