"""What a remote sends is checked before anything is written or deserialised: a tampered blob, an
unsafe path or a replaced pickle is refused, and a refused pull leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aotbuild.manage import verify
from aotbuild.store import Store
from tests import manifests
from tests.standins import add_entry

# -- 12, 13: what a remote sends is checked before anything is written or deserialised -------------

def test_a_refused_pull_leaves_no_orphan(tmp_path):
    from aotbuild.remote import parse_remote

    remote_store = Store(tmp_path / "remote")
    key = add_entry(remote_store, tmp_path, "a", {"a.so": b"good", "b.so": b"bad-to-be"})
    bad = remote_store.layout.blob(remote_store.read_manifest(key).files[1].sha256)
    bad.chmod(0o644)
    bad.write_bytes(b"tampered")
    local = Store(tmp_path / "local")
    why = parse_remote(f"file://{remote_store.root}").fetch(key, local)
    assert why.startswith("refused")
    assert not local.has(key) and verify(local) == [] and not list(local.blob_files())


@pytest.mark.parametrize("path", ["../x", "/etc/x", "a/../../x"])
def test_a_pulled_manifest_with_an_unsafe_path_is_refused(tmp_path, path):
    from aotbuild.remote import parse_remote

    remote_store = Store(tmp_path / "remote")
    key = add_entry(remote_store, tmp_path, "a", {"x.so": b"kernel"})
    data = remote_store.read_manifest(key).as_json()
    data["files"][0]["path"] = path
    manifests.write_raw(remote_store, key, data)  # the codec would refuse to write it
    local = Store(tmp_path / "local")
    why = parse_remote(f"file://{remote_store.root}").fetch(key, local)
    assert why.startswith("refused") and "unsafe artifact path" in why, why
    assert not local.has(key) and not (tmp_path / "x").exists()


class _Marker:
    """Unpickling this writes a marker file: what a poisoned cache entry would do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "pwned"))


def test_a_tampered_pickle_is_refused_before_anything_deserialises_it(tmp_path):
    import pickle

    from aotbuild.remote import parse_remote

    marker = tmp_path / "marker"
    remote_store = Store(tmp_path / "remote")
    key = add_entry(remote_store, tmp_path, "a", {"fxgraph/entry": pickle.dumps({"graph": "honest"})})
    blob = remote_store.layout.blob(remote_store.read_manifest(key).files[0].sha256)
    blob.chmod(0o644)
    blob.write_bytes(pickle.dumps(_Marker(str(marker))))
    local = Store(tmp_path / "local")
    why = parse_remote(f"file://{remote_store.root}").fetch(key, local)
    assert why.startswith("refused") and "does not match its content" in why
    assert not local.has(key) and not list(local.blob_files())
    assert not marker.exists()
