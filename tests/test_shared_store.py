"""A store shared by several accounts: what it holds is readable by all of them whatever the umask
(entries, the built-in model), and a manifest another user's permissions hide is never taken for
garbage (faked: this suite runs as root).
"""

from __future__ import annotations

import os

from aotbuild.cache.manage import verify
from aotbuild.cache.store import Store
from tests.standins import add_entry


def test_manifests_are_readable_by_the_other_users_of_a_shared_store(tmp_path):
    store = Store(tmp_path / "c")
    key = add_entry(store, tmp_path, "a", {"x.so": b"kernel"})
    assert store.layout.manifest(key).stat().st_mode & 0o777 == 0o644
    blob = store.layout.blob(store.read_manifest(key).files[0].sha256)
    assert blob.stat().st_mode & 0o777 == 0o444


def test_a_store_written_under_umask_077_is_readable_by_other_users(tmp_path):
    import stat

    old = os.umask(0o077)
    try:
        store = Store(tmp_path / "c")
        key = add_entry(store, tmp_path, "a", {"x.so": b"kernel"})
    finally:
        os.umask(old)
    for path in (store.root / "blobs", store.layout.blob(store.read_manifest(key).files[0].sha256).parent,
                 store.layout.manifest(key).parent, store.layout.locks):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755, path
    assert stat.S_IMODE(store.layout.manifest(key).stat().st_mode) == 0o644


def test_a_builtin_model_is_shared_readable_and_a_killed_creation_is_reclaimed(tmp_path):
    """mkdtemp made the model folder 0700: another account could not load from a shared store.
    A creation killed midway left models/.tiny-sd-v1.* that nothing reported."""
    import stat

    from aotbuild import builtin
    from aotbuild.cache.locks import flocked

    store = Store(tmp_path / "c")
    models = store.layout.models
    models.mkdir(parents=True)
    dead = models / ".tiny-sd-v1.killed"
    dead.mkdir()
    (dead / builtin.STAGING_LOCK).write_text("")
    (dead / "unet").mkdir()
    alive = models / ".tiny-sd-v1.alive"  # another process creating it right now
    alive.mkdir()
    with flocked(alive / builtin.STAGING_LOCK, exclusive=True, timeout=0):
        problems = verify(store)
        assert [(p.kind, p.path) for p in problems] == [("temp", dead)]
        old = os.umask(0o077)
        try:
            folder = builtin.ensure("builtin:tiny-sd", models)
        finally:
            os.umask(old)
        assert not dead.exists() and alive.exists()  # the dead writer's folder reclaimed, the live one kept
    modes = {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in (folder, *folder.rglob("*"))}
    assert modes["."] == 0o755 and modes["unet"] == 0o755 and modes["unet/config.json"] == 0o644
    assert not (folder / builtin.STAGING_LOCK).exists()


def test_verify_fix_never_deletes_what_an_unreadable_manifest_names(tmp_path, monkeypatch):
    """Another user's manifest we may not read (faked: this suite runs as root, which reads all)."""
    store = Store(tmp_path / "c")
    mine = add_entry(store, tmp_path, "mine", {"x.so": b"mine"})
    theirs = add_entry(store, tmp_path, "theirs", {"y.so": b"theirs"})
    real = Store.load_manifest

    def load(self, key):
        if key == theirs:
            raise PermissionError(13, "Permission denied")
        return real(self, key)

    monkeypatch.setattr(Store, "load_manifest", load)
    assert [(p.kind, p.key) for p in verify(store, fix=True)] == [("unreadable", theirs)]
    monkeypatch.undo()
    assert store.open_entry(theirs)[0] is not None and store.open_entry(mine)[0] is not None
