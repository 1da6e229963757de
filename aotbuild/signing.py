"""Signed entries: serving machines load only what a trusted key signed (as Nix signs its binary caches).

A compiled entry is code; its hashes prove that a blob is the one its manifest names, not who built
it. So a manifest may carry Ed25519 signatures, ``signed_by: [{"key": NAME, "sig": base64}]``, each
over the manifest's canonical JSON without ``signed_by`` (and without a Hub copy's ``pack``): the
key, every blob's hash and size, the call signatures, the proof. A machine that names trusted
public keys (``trusted_keys=``, ``--trusted-keys``, ``AOTBUILD_TRUSTED_KEYS``) accepts only entries
with a valid signature by one of them, checked before any blob is read, installed or unpickled;
anything else is a miss that says unsigned, untrusted key, or bad signature. With no trusted keys,
unsigned stores work as before.

Key files are one line each, ``NAME:base64`` (Nix's format, so a signature names its signer):
``NAME.key`` (the 32-byte private seed, mode 0600) and ``NAME.pub`` (the 32-byte public key).
``cryptography`` is imported only when signing or verifying.
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

from aotbuild import safeio
from aotbuild.errors import UsageError

#: A key's name: what signatures are filed under.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")
MAX_KEY_FILE = 4096

__all__ = ["keygen", "load_private", "load_trusted", "payload", "sign", "check", "merge_signatures",
           "trusted_from_env"]


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise UsageError("signing needs cryptography: pip install cryptography") from None
    return ed25519


def keygen(name: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``NAME.key`` (0600) and ``NAME.pub``; NAME may include a folder. Refuses to overwrite."""
    ed25519 = _crypto()
    from cryptography.hazmat.primitives import serialization

    base = Path(name)
    if not NAME.match(base.name):
        raise UsageError(f"{base.name!r} is not a key name: letters, digits, '.', '_', '-' (at most 64)")
    private, public = base.with_name(base.name + ".key"), base.with_name(base.name + ".pub")
    for path in (private, public):
        if path.exists() or path.is_symlink():
            raise UsageError(f"{path} exists: keygen never overwrites a key")
    key = ed25519.Ed25519PrivateKey.generate()
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())
    raw_public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    base.parent.mkdir(parents=True, exist_ok=True)
    safeio.write_new(private, f"{base.name}:{base64.b64encode(seed).decode()}\n".encode(), mode=0o600)
    safeio.write_new(public, f"{base.name}:{base64.b64encode(raw_public).decode()}\n".encode(), mode=0o644)
    return private, public


def _read_key_file(path: str | os.PathLike) -> tuple[str, bytes]:
    path = Path(path)
    try:  # a regular file, without blocking; a symlink is followed (the operator's choice of key)
        text = safeio.read_bytes(path, MAX_KEY_FILE).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read the key: {exc}") from None
    name, _, data = text.partition(":")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raw = b""
    if not NAME.match(name) or len(raw) != 32:
        raise UsageError(f"{path}: not a key file (one line NAME:base64 of 32 bytes)")
    return name, raw


def load_private(path: str | os.PathLike) -> tuple[str, Any]:
    name, seed = _read_key_file(path)
    return name, _crypto().Ed25519PrivateKey.from_private_bytes(seed)


def load_trusted(paths: Sequence[str | os.PathLike]) -> dict[str, bytes]:
    """name -> public key bytes of each ``.pub`` file."""
    trusted: dict[str, bytes] = {}
    for path in paths:
        name, raw = _read_key_file(path)
        trusted[name] = raw
    return trusted


def trusted_from_env(explicit: Sequence[str | os.PathLike] | None = None) -> dict[str, bytes] | None:
    """The trusted keys: those named explicitly, else ``AOTBUILD_TRUSTED_KEYS`` (comma-separated
    ``.pub`` paths); None when neither names any (unsigned stores work as before)."""
    from aotbuild.constants import env_trusted_keys

    paths = list(explicit) if explicit else [p for p in env_trusted_keys().split(",") if p.strip()]
    return load_trusted([p.strip() if isinstance(p, str) else p for p in paths]) if paths else None


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
    names = []
    for entry in manifest.signed_by:
        names.append(entry["key"])
        public = trusted.get(entry["key"])
        if public is None:
            continue
        try:
            ed25519.Ed25519PublicKey.from_public_bytes(public).verify(base64.b64decode(entry["sig"]), body)
        except (InvalidSignature, ValueError):
            return f"bad signature by {entry['key']}: the manifest changed after it was signed, or the signature did"
        return ""
    return f"signed by an untrusted key ({', '.join(sorted(set(names)))[:200]}); trusted: {', '.join(sorted(trusted))}"
