"""Stand-ins for compiled entries: small real files stored the way the builder stores them.

The builder's plan, verification, store, locks and gc run for real on these; only the compile is
replaced (the ``fake_compiles`` fixture of tests/conftest.py returns ``artifacts`` for each job).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from aotbuild.store import Store
from tests import manifests

ARTIFACT_SIZE = 3000


def key_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def add_entry(store: Store, tmp_path: Path, name: str, files: dict[str, bytes]) -> str:
    """A stand-in entry made of small real files, stored the way the builder stores one."""
    return manifests.add_entry(store, tmp_path / "src", name, files)


def entries(store: Store, *keys: str):
    out = []
    for key in keys:
        entry, why = store.open_entry(key)
        assert entry is not None, why
        out.append(entry)
    return out


def artifacts(folder: Path, key: str, n: int = 3) -> list[tuple[str, Path]]:
    """A job's stand-in output: n files whose bytes depend only on the key (builds are reproducible)."""
    out = []
    for i in range(n):
        path = folder / key[:12] / f"inductor/{i}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        seed = hashlib.sha256(f"{key}:{i}".encode()).digest()
        path.write_bytes(seed * (ARTIFACT_SIZE // len(seed)))
        out.append((f"inductor/{i}.bin", path))
    return out


def check_no_dangling(store: Store) -> None:
    """The invariant: every manifest on disk names blobs that exist."""
    for m in store.iter_manifests():
        for item in m.files:
            assert store.layout.blob(item.sha256).is_file(), f"{m.key[:12]} points at a missing blob"
