"""A folder's artifact files, captured and laid back: what a compiler left in a cache folder becomes
(relative path, file) pairs, and (relative path, blob) pairs become a folder again, by hard links."""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from aotbuild.cache.layout import safe_relpath
from aotbuild.errors import StoreError
from aotbuild.utils.safeio import place


def collect_tree(base: Path) -> list[tuple[str, Path]]:
    """Every regular file under ``base``; a symlink, device file or other special file is refused."""
    found = []
    if not base.is_dir():
        return found
    for folder, dirs, files in os.walk(base):
        for name in sorted(dirs):
            if os.path.islink(os.path.join(folder, name)):
                raise StoreError(f"refusing to capture {os.path.join(folder, name)}: a symlink")
        dirs.sort()
        for name in sorted(files):
            path = Path(folder) / name
            mode = os.lstat(path).st_mode
            if not stat.S_ISREG(mode):
                raise StoreError(f"refusing to capture {path}: not a regular file")
            if name.endswith(".lock"):
                continue
            rel = path.relative_to(base).as_posix()
            safe_relpath(rel)
            found.append((rel, path))
    return found


def lay_tree(files: Iterable[tuple[str, Path]], folder: Path) -> tuple[int, int]:
    """Hard-link (else copy) each blob to ``folder/rel``; existing files of the same size stay.
    Returns (files laid, files already there). A blob named by several paths is copied at most once:
    its other paths link to the first copy (a manifest naming one large blob under thousands of
    paths cannot make a cross-filesystem install copy it thousands of times)."""
    installed = present = 0
    laid: dict[Path, Path] = {}  # blob -> where it was first laid
    for rel, blob in files:
        dest = folder.joinpath(*safe_relpath(rel).parts)
        if dest.is_file() and dest.stat().st_size == blob.stat().st_size:
            present += 1
            laid.setdefault(blob, dest)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)

        def make(tmp: Path, blob: Path = blob) -> None:
            try:
                os.link(blob, tmp)
            except OSError:  # another filesystem, or links not allowed
                try:
                    os.link(laid[blob], tmp)  # KeyError: the first copy of this blob
                except (KeyError, OSError):
                    shutil.copyfile(blob, tmp)

        place(dest, make)  # one rename from a temp name beside it (aotbuild.utils.safeio)
        laid.setdefault(blob, dest)
        installed += 1
    return installed, present
