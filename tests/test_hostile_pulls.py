"""What a remote sends is checked before anything is written or deserialised: a tampered blob, an
unsafe path or a replaced pickle is refused, and a refused pull leaves nothing behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aotbuild.cache.manage import verify
from aotbuild.cache.store import Store
from tests import manifests
from tests.standins import add_entry

# -- 12, 13: what a remote sends is checked before anything is written or deserialised -------------

def test_a_refused_pull_leaves_no_orphan(tmp_path):
    from aotbuild.remote.schemes import parse_remote

    remote_store = Store(tmp_path / "remote")
    key = add_entry(remote_store, tmp_path, "a", {"a.so": b"good", "b.so": b"bad-to-be"})
    bad = remote_store.layout.blob(remote_store.read_manifest(key).files[1].sha256)
    bad.chmod(0o644)
    bad.write_bytes(b"tampered")
    local = Store(tmp_path / "local")
    why = parse_remote(f"file://{remote_store.root}").fetch(key, local)
    assert why.startswith("refused")
    assert not local.layout.manifest(key).is_file() and verify(local) == [] and not list(local.blob_files())


@pytest.mark.parametrize("path", ["../x", "/etc/x", "a/../../x"])
def test_a_pulled_manifest_with_an_unsafe_path_is_refused(tmp_path, path):
    from aotbuild.remote.schemes import parse_remote

    remote_store = Store(tmp_path / "remote")
    key = add_entry(remote_store, tmp_path, "a", {"x.so": b"kernel"})
    data = remote_store.read_manifest(key).as_json()
    data["files"][0]["path"] = path
    manifests.write_raw(remote_store, key, data)  # the codec would refuse to write it
    local = Store(tmp_path / "local")
    why = parse_remote(f"file://{remote_store.root}").fetch(key, local)
    assert why.startswith("refused") and "unsafe artifact path" in why, why
    assert not local.layout.manifest(key).is_file() and not (tmp_path / "x").exists()


class _Marker:
    """Unpickling this writes a marker file: what a poisoned cache entry would do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "pwned"))


def test_a_tampered_pickle_is_refused_before_anything_deserialises_it(tmp_path):
    import pickle

    from aotbuild.remote.schemes import parse_remote

    marker = tmp_path / "marker"
    remote_store = Store(tmp_path / "remote")
    key = add_entry(remote_store, tmp_path, "a", {"fxgraph/entry": pickle.dumps({"graph": "honest"})})
    blob = remote_store.layout.blob(remote_store.read_manifest(key).files[0].sha256)
    blob.chmod(0o644)
    honest_size = blob.stat().st_size
    planted = pickle.dumps(_Marker(str(marker)))
    blob.write_bytes(planted[:honest_size].ljust(honest_size, b"."))  # the declared size: hashed, refused
    local = Store(tmp_path / "local")
    why = parse_remote(f"file://{remote_store.root}").fetch(key, local)
    assert why.startswith("refused") and "does not match its content" in why
    assert not local.layout.manifest(key).is_file() and not list(local.blob_files())
    blob.write_bytes(planted)  # longer than declared: refused once past the declared size
    why = parse_remote(f"file://{remote_store.root}").fetch(key, local)
    assert why.startswith("refused") and f"more bytes than the {honest_size} its manifest declares" in why
    assert not local.layout.manifest(key).is_file() and not list(local.blob_files())
    assert not marker.exists()


LYING_PACKAGE = """
import json, sys
from pathlib import Path
import torch
from aotbuild.errors import PackageMismatch
from aotbuild.strategies import aoti

folder = Path(sys.argv[1])
module = torch.nn.Linear(8, 4)
exported = torch.export.export(module, (torch.randn(2, 8),))
path = folder / "m.pt2"
torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs={
    "aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True})
fqns = list(torch._inductor.aoti_load_package(str(path)).get_constant_fqns())
# The record says the package serves a batch of 3; it was built for 2.
record = {"signature": "batch-3", "path": "aoti/m.pt2", "strides": [[8, 1]],
          "constants": aoti.constant_meta(module, fqns), "baked": aoti.baked_digests(module, fqns)}
run = aoti.load_packages(module, "lin", [(record, {"aoti/m.pt2": path})], "cpu")[""]["batch-3"]
ok = run(torch.randn(2, 8)).shape  # the shape it was built for still serves
try:
    run(torch.randn(3, 8))
    print("RESULT " + json.dumps({"served": True}))
except PackageMismatch as exc:
    print("RESULT " + json.dumps({"served": False, "why": str(exc), "ok": list(ok)}))
"""


@pytest.mark.slow  # one tiny AOTInductor package (about 20 s)
def test_an_aot_package_called_at_another_shape_than_it_was_built_for_is_refused(tmp_path):
    """A manifest whose recorded call signature is not its package's (a damaged or altered store):
    the package's own input check refuses the first such call; it never reads memory at a wrong shape."""
    from tests.conftest import run_python

    proc = run_python(f"import sys; sys.argv = ['x', {str(tmp_path)!r}]; exec({LYING_PACKAGE!r})",
                      env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert result["served"] is False and result["ok"] == [2, 4]
    assert "refused the call (input_handles[0]: unmatched dim value at 0, expected: 2, but got: 3)" in result["why"]


def test_a_fifo_in_a_folder_remote_blob_s_place_is_refused_without_blocking(tmp_path):
    import os

    from aotbuild.remote.schemes import parse_remote

    remote_store = Store(tmp_path / "remote")
    key = add_entry(remote_store, tmp_path, "a", {"x.so": b"kernel"})
    blob = remote_store.layout.blob(remote_store.read_manifest(key).files[0].sha256)
    blob.chmod(0o644)
    blob.unlink()
    os.mkfifo(blob)  # opening it for reading would block forever without O_NONBLOCK
    local = Store(tmp_path / "local")
    why = parse_remote(f"file://{remote_store.root}").fetch(key, local)
    assert why.startswith("refused") and "not a regular file" in why, why
    assert not local.layout.manifest(key).is_file() and not list(local.blob_files())
