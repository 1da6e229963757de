"""Valid manifests for tests that need entries without a compile, and a raw writer for hostile ones."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from aotbuild import constants
from aotbuild.cache.manifest import FileRecord, Manifest
from aotbuild.cache.store import Store
from aotbuild.keys import key_of

FACTORS: dict[str, Any] = {
    "format": constants.FORMAT_VERSION,
    "model": {"pipeline": "StableDiffusionPipeline", "variant": None, "builtin_version": 1},
    "component": {"name": "unet", "class": "UNet2DConditionModel", "config": {"in_channels": 4}, "dtype": "float32"},
    "target": {"name": "inductor", "strategy": "jit-cache"},
    "compile": {"scope": "full", "mode": "default", "options": {}},
    "shape": {"height": 64, "width": 64, "batch_size": 1},
    "warmup": {"guidance_scale": 0.0},
    "env": {"torch": "2.13.0"},
    "device": {"device_kind": "cpu"},
}


def factors(name: str = "", **sections: dict[str, Any]) -> dict[str, Any]:
    """FACTORS with ``sections`` merged in; ``name`` tells entries apart (a model variant)."""
    out = copy.deepcopy(FACTORS)
    if name:
        out["model"]["variant"] = name
    for section, values in sections.items():
        if isinstance(out.get(section), dict) and isinstance(values, dict):
            out[section].update(values)
        else:
            out[section] = values
    return out


def manifest(f: dict[str, Any], files: list[tuple[str, str, int]] = (), recipe: str = "r", **fields: Any) -> Manifest:
    return Manifest(key=key_of(f), recipe=recipe, component=f["component"]["name"], shape=f["shape"],
                    target=f["target"]["name"], strategy=f["target"]["strategy"], factors=f,
                    files=tuple(FileRecord(*item) for item in files), **fields)


def add_entry(store: Store, src: Path, name: str, blobs: dict[str, bytes], recipe: str | None = None,
              **sections: dict[str, Any]) -> str:
    """Store small real files as one entry, the way the builder does: journaled, blobs, then the manifest."""
    from aotbuild.cache.journal import entry_writer
    from aotbuild.cache.locks import store_lock

    f = factors(name, **sections)
    items = []
    with entry_writer(store) as writer, store_lock(store.root, exclusive=False):
        for rel, data in blobs.items():
            path = src / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            digest, size = writer.put_blob(path)
            items.append((rel, digest, size))
        m = manifest(f, items, recipe=recipe or name)
        writer.put_manifest(m)
    return m.key


def write_raw(store: Store, key: str, data: Any) -> Path:
    """Write whatever ``data`` is as the manifest of ``key``, past the codec (an attacker's write)."""
    path = store.layout.manifest(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path
