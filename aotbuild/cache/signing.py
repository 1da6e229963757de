"""Signed entries: serving machines load only what a trusted key signed (as Nix signs its binary caches).

A compiled entry is code; its hashes prove that a blob is the one its manifest names, not who built
it. So a manifest may carry Ed25519 signatures, ``signed_by: [{"key": NAME, "sig": base64}]``, each
over the manifest's canonical JSON without ``signed_by`` (and without a Hub copy's ``pack``): the
key, the factors, every blob's hash and size, the call signatures, the toolchain (torch, Python,
host), the build time and the proof. A signature means "built and proven by the holder of this
key": ``build --sign-key`` signs only the entries that build produced and proved, never one it
found; ``aotbuild sign`` (:func:`sign_entries`) is the one way to sign an entry found in a cache,
and says that it vouches for it. A machine that names trusted public keys (``trusted_keys=``,
``--trusted-keys``, ``AOTBUILD_TRUSTED_KEYS``) accepts only entries with a valid signature by one
of them, checked before any blob is read, installed or unpickled; anything else is a miss that says
unsigned, untrusted key, or bad signature. A setting that is present but names no key is an error
(fail closed); ``none`` says "no verification" on purpose; unset means no verification.

Key files are one line each, told apart by content (never by their name):
``aotbuild-ed25519-private-v1 NAME BASE64`` (``NAME.key``, the 32-byte seed, mode 0600) and
``aotbuild-ed25519-public-v1 NAME BASE64`` (``NAME.pub``, the 32-byte public key). The old
``NAME:base64`` files (the same for both kinds) are refused with the command that converts them
(``aotbuild keygen --convert FILE``); signatures already in manifests stay valid. Key files are read
through :mod:`aotbuild.utils.safeio` (a regular file, without blocking, bounded). ``cryptography`` is
imported only when signing or verifying.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from aotbuild.errors import UsageError
from aotbuild.utils import safeio, secrets
from aotbuild.utils.text import printable

#: A key's name: what signatures are filed under.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
MAX_KEY_FILE = 4096
PRIVATE, PUBLIC = "private", "public"
#: The first word of each kind of key file.
HEADER = {PRIVATE: "aotbuild-ed25519-private-v1", PUBLIC: "aotbuild-ed25519-public-v1"}
_OLD = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,63}):([A-Za-z0-9+/=]+)\Z")
#: The value of a trusted-keys setting that turns verification off on purpose.
NO_VERIFICATION = "none"

__all__ = ["keygen", "convert", "load_private", "load_trusted", "payload", "sign", "check", "signer",
           "merge_signatures", "supersedes", "trusted_from_env", "public_of", "NO_VERIFICATION"]


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise UsageError("signing needs cryptography: pip install cryptography") from None
    return ed25519


def _line(kind: str, name: str, raw: bytes) -> bytes:
    return f"{HEADER[kind]} {name} {base64.b64encode(raw).decode()}\n".encode()


def _raw_public(seed: bytes) -> bytes:
    from cryptography.hazmat.primitives import serialization

    key = _crypto().Ed25519PrivateKey.from_private_bytes(seed)
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def keygen(name: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``NAME.key`` (0600) and ``NAME.pub``; NAME may include a folder. Refuses to overwrite."""
    base = Path(name)
    if not NAME.match(base.name):
        raise UsageError(f"{base.name!r} is not a key name: letters, digits, '.', '_', '-' (at most 64)")
    private, public = base.with_name(base.name + ".key"), base.with_name(base.name + ".pub")
    for path in (private, public):
        if path.exists() or path.is_symlink():
            raise UsageError(f"{path} exists: keygen never overwrites a key")
    seed = os.urandom(32)
    raw_public = _raw_public(seed)
    base.parent.mkdir(parents=True, exist_ok=True)
    safeio.write_new(private, _line(PRIVATE, base.name, seed), mode=0o600)
    safeio.write_new(public, _line(PUBLIC, base.name, raw_public), mode=0o644)
    return private, public


def _read(path: Path) -> str:
    try:  # a regular file, without blocking, bounded; a symlink is followed (the operator's choice of key)
        return safeio.read_bytes(path, MAX_KEY_FILE).decode("ascii").strip()
    except safeio.NotRegularFile:
        raise UsageError(f"{path}: not a key file: not a regular file") from None
    except safeio.FileTooLarge:
        raise UsageError(f"{path}: not a key file: more than {MAX_KEY_FILE} bytes") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a key file: not ASCII text") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the key: {exc.strerror or exc}") from None


def _b64(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:
        return b""


def _read_key_file(path: str | os.PathLike, kind: str) -> tuple[str, bytes]:
    """(name, 32 raw bytes) of a key file of ``kind`` (PRIVATE or PUBLIC); UsageError naming why not."""
    path = Path(path)
    text = _read(path)
    if not text.startswith(HEADER[PUBLIC]):  # a private seed (or what may be one): never printed (issue 53)
        for word in text.replace(":", " ").split():
            if len(word) >= 16 and word not in HEADER.values():
                secrets.register(word)
    if _OLD.match(text) and len(_b64(_OLD.match(text)[2])) == 32:
        raise UsageError(f"{path}: an old-format key (NAME:base64, the same for private and public keys): "
                         f"convert it with `aotbuild keygen --convert {path}`")
    words = text.split()
    other = PUBLIC if kind == PRIVATE else PRIVATE
    if len(words) == 3 and words[0] == HEADER[other]:
        if kind == PRIVATE:
            raise UsageError(f"{path}: a public key: signing needs the private key (NAME.key)")
        raise UsageError(f"{path}: a private key given as trusted: trust the public key (NAME.pub); a private "
                         f"key never belongs on a serving machine")
    raw = _b64(words[2]) if len(words) == 3 else b""
    if len(words) != 3 or words[0] != HEADER[kind] or not NAME.match(words[1]) or len(raw) != 32:
        raise UsageError(f"{path}: not a {kind} key file (one line: {HEADER[kind]} NAME BASE64 of 32 bytes)")
    return words[1], raw


def convert(path: str | os.PathLike) -> Path:
    """Rewrite an old ``NAME:base64`` key file in the new format, in place. The old format is the
    same for both kinds, so the file's suffix says which it is: ``.key`` private, ``.pub`` public."""
    path = Path(path)
    text = _read(path)
    old = _OLD.match(text)
    raw = _b64(old[2]) if old else b""
    if old is None or len(raw) != 32:
        raise UsageError(f"{path}: not an old-format key file (one line NAME:base64 of 32 bytes)")
    if path.suffix not in (".key", ".pub"):
        raise UsageError(f"{path}: name it NAME.key (a private seed) or NAME.pub (a public key): the old "
                         f"format does not say which it is")
    kind = PRIVATE if path.suffix == ".key" else PUBLIC
    if kind == PRIVATE:
        _raw_public(raw)  # a valid seed (any 32 bytes are; this also checks cryptography is there)
    with safeio.atomic_write(path, mode=0o600 if kind == PRIVATE else 0o644) as out:
        out.file.write(_line(kind, old[1], raw))
    return path


def load_private(path: str | os.PathLike) -> tuple[str, Any]:
    name, seed = _read_key_file(path, PRIVATE)
    return name, _crypto().Ed25519PrivateKey.from_private_bytes(seed)


def public_of(path: str | os.PathLike) -> dict[str, bytes]:
    """{name: public key} of a private key file: whom a signer's own signatures are checked against."""
    name, seed = _read_key_file(path, PRIVATE)
    return {name: _raw_public(seed)}


def load_trusted(paths: Sequence[str | os.PathLike]) -> dict[str, bytes]:
    """name -> public key bytes of each ``.pub`` file; two keys under one name, or one key under two
    names, are an error (a signature names its signer: either would make that name ambiguous)."""
    trusted: dict[str, bytes] = {}
    origin: dict[str, Path] = {}
    for path in paths:
        name, raw = _read_key_file(path, PUBLIC)
        same = next((n for n, r in trusted.items() if r == raw and n != name), None)
        if name in trusted and trusted[name] != raw:
            raise UsageError(f"{path}: two trusted keys are named {name!r} (the other is {origin[name]}): "
                             f"a signature names its signer, so each name must be one key")
        if same is not None:
            raise UsageError(f"{path}: the key named {name!r} is also trusted as {same!r} ({origin[same]}): "
                             f"one key, one name")
        trusted[name], origin[name] = raw, Path(path)
    return trusted


def trusted_from_env(explicit: Sequence[str | os.PathLike] | str | os.PathLike | None = None
                     ) -> dict[str, bytes] | None:
    """The trusted keys: those named explicitly (``--trusted-keys``, ``trusted_keys=``), else
    ``AOTBUILD_TRUSTED_KEYS`` (comma-separated ``.pub`` paths). None means no verification: when
    neither is set, or when the setting is ``none``. A setting that is present but names no key (an
    empty string, an empty list, only commas) is an error: verification never turns off by accident."""
    from aotbuild.constants import ENV_TRUSTED_KEYS

    if explicit is not None:
        where = "the trusted keys given (--trusted-keys, trusted_keys=)"
        items = [explicit] if isinstance(explicit, (str, os.PathLike)) else list(explicit)
    else:
        value = os.environ.get(ENV_TRUSTED_KEYS)
        if value is None:
            return None
        where, items = ENV_TRUSTED_KEYS, [value]
    paths: list[str | os.PathLike] = []
    for item in items:
        if isinstance(item, str):
            paths += [p.strip() for p in item.split(",") if p.strip()]
        elif isinstance(item, os.PathLike):
            paths.append(item)
        else:
            raise UsageError(f"{where}: {type(item).__name__} is not a path to a .pub file")
    if [str(p) for p in paths] == [NO_VERIFICATION]:
        return None
    if not paths:
        raise UsageError(f"{where} is set but names no key: verification would be off. Name the public keys "
                         f"(A.pub,B.pub), or say `{NO_VERIFICATION}` to verify nothing on purpose")
    if NO_VERIFICATION in map(str, paths):
        raise UsageError(f"{where}: `{NO_VERIFICATION}` (no verification) together with keys: say one or the other")
    return load_trusted(paths)


def payload(data: Mapping[str, Any]) -> bytes:
    """What a signature covers: the manifest's JSON without ``signed_by`` and ``pack``, canonical."""
    body = {k: v for k, v in data.items() if k not in ("signed_by", "pack")}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def sign(manifest: Any, key_file: str | os.PathLike) -> Any:
    """The manifest with one more signature (or its signer's renewed)."""
    name, key = load_private(key_file)
    signature = base64.b64encode(key.sign(payload(manifest.as_json()))).decode()
    kept = [s for s in manifest.signed_by if s["key"] != name]
    return replace(manifest, signed_by=(*kept, {"key": name, "sig": signature}))


def merge_signatures(there: Any, pushed: Any) -> Any:
    """``there`` (a remote's copy) with ``pushed``'s signatures added, where both are the same manifest
    and that adds or renews one; else None. Signatures over another manifest are never copied."""
    if not pushed.signed_by or payload(there.as_json()) != payload(pushed.as_json()):
        return None
    have = {s["key"]: s for s in there.signed_by}
    merged = have | {s["key"]: s for s in pushed.signed_by}
    return replace(there, signed_by=tuple(merged.values())) if merged != have else None


def check(manifest: Any, trusted: Mapping[str, bytes]) -> str:
    """"" when a trusted key's signature verifies, else why not: unsigned, untrusted key, bad signature."""
    from cryptography.exceptions import InvalidSignature

    ed25519 = _crypto()
    if not manifest.signed_by:
        return "unsigned: this machine trusts only signed entries (AOTBUILD_TRUSTED_KEYS)"
    body = payload(manifest.as_json())
    names, bad = [], ""
    for entry in manifest.signed_by:  # any trusted signature that verifies: signed_by is not itself signed, so
        names.append(entry["key"])     # a junk entry under a trusted name must not hide a good one (review)
        public = trusted.get(entry["key"])
        if public is None:
            continue
        try:
            ed25519.Ed25519PublicKey.from_public_bytes(public).verify(base64.b64decode(entry["sig"]), body)
        except (InvalidSignature, ValueError):
            bad = bad or (f"bad signature by {printable(entry['key'])[:200]}: the manifest changed after it was "
                          "signed, or the signature did")
            continue
        return ""
    if bad:
        return bad
    # a manifest's signer names are anyone's text: escaped (no newline, no workflow command), bounded
    shown = printable(", ".join(sorted(set(names))))[:200]
    return f"signed by an untrusted key ({shown}); trusted: {', '.join(sorted(trusted))}"


def signer(manifest: Any, trusted: Mapping[str, bytes]) -> str:
    """The name of the trusted key whose signature on ``manifest`` verifies ("" when none does)."""
    for entry in manifest.signed_by:
        if entry["key"] in trusted and not check(replace(manifest, signed_by=(entry,)), trusted):
            return entry["key"]
    return ""


def supersedes(new: Any, old: Any | None, trusted: Mapping[str, bytes]) -> bool:
    """Whether ``new`` may replace ``old`` (the manifest already stored for the same key): a manifest
    a trusted key signed is never overwritten; one it did not sign gives way to one it did. Without
    trusted keys nothing is superseded (the first manifest stays, as before)."""
    if old is None:
        return True
    if not trusted or not check(old, trusted):
        return False
    return not check(new, trusted)
