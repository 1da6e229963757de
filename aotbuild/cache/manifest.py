"""The manifest codec: the one place that turns a manifest into bytes and bytes back into a manifest.

A manifest is read from stores and remotes that other people can write (a shared folder, a Hub
repo, a pull request's CI cache), so decoding treats it as hostile input: the file must be a
regular file of at most ``MAX_BYTES``, its JSON at most ``MAX_DEPTH`` deep (checked *before*
parsing, so a 100,000-deep document costs a scan, not a RecursionError), and every field is
type-checked here, once. Whatever passes is a :class:`Manifest` whose fields every reader (store,
manage, cli, remote, runtime) can use without another check.

A manifest's ``packages`` are its strategy's records: the codec checks what every record holds
(the file it names, its signature, the instances it serves); the rest is the strategy's to check
(``Strategy.check_records``), which a :class:`aotbuild.cache.store.Store` applies when it is given one.

The key binding: ``key`` must be the key of ``factors`` and the name the manifest is stored under.
A manifest copied under another key's name is malformed, never a hit for the wrong job.

A manifest of another ``format`` is :class:`StaleManifest` (written by an older aotbuild, or a
newer one): not malformed, a miss that ``gc --stale`` removes. Its file list is still read (when it
is well formed) so that collecting it frees its blobs and nothing is orphaned.

The store only writes manifests (store.py); codec and files stay apart (STYLE.md #2).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotbuild import constants
from aotbuild.cache.layout import HEX64
from aotbuild.errors import ManifestError, StaleManifest
from aotbuild.keys import AUTO, key_of
from aotbuild.recipe.frozen import thaw
from aotbuild.utils import safeio

#: A manifest file larger than this is refused before it is read.
MAX_BYTES = 16 * 1024 * 1024
#: JSON nesting deeper than this is refused before it is parsed.
MAX_DEPTH = 32
#: Longest string a manifest may hold where a name or signature is expected.
MAX_NAME = 4096

@dataclass(frozen=True)
class FileRecord:
    path: str  # relative, inside the entry (layout.safe_relpath holds)
    sha256: str
    size: int

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class Proof:
    """What the fresh process that served the entry before it was stored saw."""

    load_s: float  # seconds to load the staged entry in that process
    compiles: int  # compiles it caused there: must be 0 (the strategy's own counter)
    max_abs_diff: float  # largest |compiled - eager| over every proof call
    tolerance: float  # the bound it was held to (per dtype, docs/cache.md)
    instances: int  # module instances called (every block instance for regional scope)
    calls: int = 0  # component calls compared
    counter: str = ""  # what "compiles" counted (e.g. "fx graph cache misses")
    swaps: int = 0  # adapters hot-swapped in and served too (lora)
    #: what serving did beyond the verdict (aotbuild/builder/proof.py, ``served``): hits, compiler counts,
    #: dispatcher calls, swaps and rebinds, the strict-shape refusal; {} for entries proven before
    served: Mapping[str, Any] = field(default_factory=dict)
    #: smaller batches padded up to the entry's (aotbuild/pipeline/batch.py, issue 56): {"signatures":
    #: [{signature, batch, inputs}] (the inputs holding the batch), "sizes", "max_rel_diff", "tolerance",
    #: "refused" (why padding to it is refused, "" where exact)}. None: proven before aotbuild proved
    #: padding, so no call is padded to it (the entry serves as before)
    padding: Mapping[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        return {"load_s": self.load_s, "compiles": self.compiles, "max_abs_diff": self.max_abs_diff,
                "tolerance": self.tolerance, "instances": self.instances, "calls": self.calls,
                "counter": self.counter, **({"swaps": self.swaps} if self.swaps else {}),
                **({"served": thaw(self.served)} if self.served else {}),
                **({"padding": thaw(self.padding)} if self.padding is not None else {})}


@dataclass(frozen=True)
class Manifest:
    key: str
    recipe: str
    component: str
    shape: Mapping[str, int]
    target: str
    strategy: str
    factors: Mapping[str, Any]
    files: tuple[FileRecord, ...]
    signatures: tuple[str, ...] = ()
    embeds_weights: bool = False
    packages: tuple[Mapping[str, Any], ...] = ()
    build: Mapping[str, Any] = field(default_factory=dict)
    recipe_data: Mapping[str, Any] = field(default_factory=dict)
    proof: Proof | None = None
    #: the component as the compiler saw it (aotbuild/pipeline/structure.py): checked before a load reports a hit
    structure: Mapping[str, Any] | None = None
    #: Ed25519 signatures over the rest (aotbuild/cache/signing.py): [{"key": name, "sig": base64}]
    signed_by: tuple[Mapping[str, str], ...] = ()
    pack: Mapping[str, Any] | None = None  # a Hub remote's copy only: the tar that holds the blobs
    #: an auto job's entry only (its factors' strategy is ``auto``, ``strategy`` names the one chosen):
    #: {"attempts": [{strategy, outcome, reason, seconds, key}], "factors": what the chosen strategy adds
    #: to the key's compile settings, checked at load}
    auto: Mapping[str, Any] | None = None
    format: int = constants.FORMAT_VERSION

    # -- encoding -----------------------------------------------------------------------------

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": self.format, "key": self.key, "recipe": self.recipe, "component": self.component,
            "shape": dict(self.shape), "target": self.target, "strategy": self.strategy,
            "factors": thaw(self.factors), "files": [f.as_json() for f in self.files],
            "signatures": list(self.signatures), "embeds_weights": self.embeds_weights,
            "build": thaw(self.build), "recipe_data": thaw(self.recipe_data),
        }
        if self.packages:
            data["packages"] = [thaw(p) for p in self.packages]
        if self.proof is not None:
            data["proof"] = self.proof.as_json()
        if self.structure is not None:
            data["structure"] = thaw(self.structure)
        if self.signed_by:
            data["signed_by"] = [dict(s) for s in self.signed_by]
        if self.pack is not None:
            data["pack"] = thaw(self.pack)
        if self.auto is not None:
            data["auto"] = thaw(self.auto)
        return data

    def to_json(self) -> str:
        """Canonical text: sorted keys, one value a line; checked by decoding it again."""
        text = json.dumps(self.as_json(), indent=1, sort_keys=True, allow_nan=False) + "\n"
        from_json(text, self.key)  # never write what no reader would accept
        return text

    # -- reading helpers ----------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Bytes of its distinct blobs."""
        return sum(size for _, size in self.blobs())

    def blobs(self) -> list[tuple[str, int]]:
        """(digest, size) of each distinct blob, in file order."""
        seen: dict[str, int] = {}
        for f in self.files:
            seen.setdefault(f.sha256, f.size)
        return list(seen.items())

    def without_pack(self) -> Manifest:
        from dataclasses import replace

        return replace(self, pack=None)


# -- decoding ---------------------------------------------------------------------------------

def read(path: Path, key: str) -> Manifest | None:
    """The manifest stored at ``path`` for ``key``; None when there is no such file.

    Raises OSError when it cannot be read (permissions), ManifestError when it is malformed (not a
    regular file, a symbolic link, too big, too deep, a wrong field) and StaleManifest when it is of
    another format. Read through aotbuild.utils.safeio: without blocking (a FIFO planted under a
    manifest's name cannot hang a reader), never through a link."""
    try:
        raw = safeio.read_bytes(path, MAX_BYTES, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except safeio.LinkRefused:
        raise ManifestError("a symbolic link, not a manifest file") from None
    except safeio.NotRegularFile:  # a FIFO, a device, a folder
        raise ManifestError("not a regular file") from None
    except safeio.FileTooLarge as exc:
        if exc.size is None:  # grew while we read
            raise ManifestError(f"more than {MAX_BYTES} bytes") from None
        raise ManifestError(f"{exc.size} bytes, more than a manifest may have ({MAX_BYTES})") from None
    return from_json(raw, key)


def from_json(text: str | bytes, key: str) -> Manifest:
    """Decode and check a manifest that must be the one for ``key``."""
    if isinstance(text, bytes):
        if len(text) > MAX_BYTES:
            raise ManifestError(f"{len(text)} bytes, more than a manifest may have ({MAX_BYTES})")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ManifestError("not UTF-8 text") from None
    if len(text) > MAX_BYTES:
        raise ManifestError(f"more than {MAX_BYTES} characters")
    try:
        data = safeio.loads_json(text, max_bytes=MAX_BYTES, max_depth=MAX_DEPTH)
    except safeio.TooDeep as exc:
        raise ManifestError(f"JSON nested {exc.depth} deep, more than a manifest may be ({MAX_DEPTH})") from None
    except safeio.BadData as exc:
        raise ManifestError(str(exc)) from None
    return from_dict(data, key)


#: Deepest nesting of ``[`` and ``{`` in JSON text (strings skipped), without parsing it.
json_depth = safeio.json_depth


def from_dict(data: Any, key: str) -> Manifest:
    """Check a decoded manifest field by field; see the module docstring for what is refused."""
    c = _Checker()
    if not isinstance(data, dict):
        raise ManifestError("not a JSON object")
    fmt = data.get("format")
    files = c.files(data.get("files"))
    if fmt != constants.FORMAT_VERSION:
        shown = fmt if isinstance(fmt, (int, str)) and len(str(fmt)) < 20 else "unknown"
        raise StaleManifest(f"format {shown}, this aotbuild reads {constants.FORMAT_VERSION}", shown, files)
    if data.get("key") != key:
        raise ManifestError("its key is not the name it is stored under")
    factors = c.factors(data.get("factors"))
    try:
        bound = key_of(factors)
    except ValueError:  # NaN or infinity in a factor
        raise ManifestError("factors are not canonical JSON") from None
    if bound != key:
        raise ManifestError("its key is not the key of its factors (copied under another key's name?)")
    paths = {f.path for f in files}
    manifest = Manifest(
        format=fmt, key=key,
        recipe=c.name(data.get("recipe"), "recipe"),
        component=c.name(data.get("component"), "component"),
        shape=c.shape(data.get("shape"), "shape"),
        target=c.name(data.get("target"), "target"),
        strategy=c.name(data.get("strategy"), "strategy"),
        factors=factors, files=files,
        signatures=tuple(c.name(s, "signatures[]", printed=False)
                         for s in c.list_of(data.get("signatures", []), "signatures")),
        embeds_weights=c.boolean(data.get("embeds_weights", False), "embeds_weights"),
        packages=tuple(c.package(p, paths) for p in c.list_of(data.get("packages", []), "packages")),
        build=c.build(data.get("build", {})),
        recipe_data=c.obj(data.get("recipe_data", {}), "recipe_data"),
        proof=c.proof(data["proof"]) if data.get("proof") is not None else None,
        structure=c.structure(data["structure"]) if data.get("structure") is not None else None,
        signed_by=c.signed_by(data.get("signed_by", [])),
        pack=c.pack(data["pack"]) if data.get("pack") is not None else None,
        auto=c.auto(data["auto"]) if data.get("auto") is not None else None,
    )
    keyed = factors["target"]["strategy"]
    # An auto job's entry names the strategy chosen (never auto itself) and says what it tried.
    chosen = manifest.strategy != AUTO and manifest.auto is not None if keyed == AUTO else \
        manifest.strategy == keyed and manifest.auto is None
    if (manifest.component != factors["component"]["name"] or dict(manifest.shape) != factors["shape"]
            or manifest.target != factors["target"]["name"] or not chosen):
        raise ManifestError("its component, shape, target or strategy differ from its factors")
    return manifest


class _Checker:
    def fail(self, where: str, what: str) -> ManifestError:
        return ManifestError(f"{where}: {what}")

    def name(self, value: Any, where: str, printed: bool = True) -> str:
        """A non-empty string of at most MAX_NAME characters; ``printed`` (all but a call signature, which is
        JSON and never printed raw): no control character either."""
        if not isinstance(value, str) or not value or len(value) > MAX_NAME:
            raise self.fail(where, "not a non-empty string of at most 4096 characters")
        if printed:
            self.printable(value, where)
        return value

    def printable(self, value: str, where: str) -> str:
        """Text printed into messages (a refusal, a warning): no newline, no escape sequence."""
        if not value.isprintable():
            raise self.fail(where, "holds control characters")
        return value

    def integer(self, value: Any, where: str, low: int = 0) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise self.fail(where, f"not an integer >= {low}")
        return value

    def number(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(where, "not a finite number")
        return float(value)

    def boolean(self, value: Any, where: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(where, "not true or false")
        return value

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, "not an object")
        return value

    def build(self, value: Any) -> dict[str, Any]:
        """``build``: what the build recorded; its timestep proof, which a load converts timesteps by
        (aotbuild/pipeline/timesteps.py, issue 56), checked here once."""
        from aotbuild.pipeline.timesteps import check_record

        value = self.obj(value, "build")
        if value.get("timestep") is not None and (why := check_record(value["timestep"])):
            raise self.fail("build.timestep", why)
        return value

    def list_of(self, value: Any, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, "not a list")
        return value

    def files(self, value: Any) -> tuple[FileRecord, ...]:
        from aotbuild.cache.layout import safe_relpath
        from aotbuild.constants import LIMITS, limit
        from aotbuild.errors import StoreError

        items = self.list_of(value, "files")
        if len(items) > limit("entry_files"):
            raise self.fail("files", f"{len(items)} files, more than an entry may have ({limit('entry_files')}; "
                                     f"{LIMITS['entry_files'][0]} raises it)")
        out, seen, total = [], set(), 0
        for item in items:
            item = self.obj(item, "files[]")
            path = self.name(item.get("path"), "files[].path")
            try:
                safe_relpath(path)
            except StoreError as exc:
                raise self.fail("files[].path", str(exc)) from None
            if path in seen:
                raise self.fail("files[].path", f"{path!r} listed twice")
            seen.add(path)
            digest = item.get("sha256")
            if not isinstance(digest, str) or not HEX64.match(digest):
                raise self.fail(f"file {path!r}", "no valid sha256")
            out.append(FileRecord(path, digest, self.integer(item.get("size"), f"file {path!r} size")))
            total += out[-1].size
        if total > limit("entry_bytes"):
            raise self.fail("files", f"{total} bytes declared, more than an entry may have ({limit('entry_bytes')}; "
                                     f"{LIMITS['entry_bytes'][0]} raises it)")
        return tuple(out)

    def shape(self, value: Any, where: str) -> dict[str, int]:
        value = self.obj(value, where)
        if set(value) - {"num_frames"} != {"height", "width", "batch_size"}:
            raise self.fail(where, "not {height, width, batch_size[, num_frames]}")
        return {k: self.integer(v, f"{where}.{k}", 1) for k, v in value.items()}

    def factors(self, value: Any) -> dict[str, Any]:
        value = self.obj(value, "factors")
        for section in ("model", "component", "target", "compile", "warmup", "env", "device"):
            self.obj(value.get(section), f"factors.{section}")
        if value.get("format") != constants.FORMAT_VERSION:
            raise self.fail("factors.format", "differs from the manifest's format")
        self.shape(value.get("shape"), "factors.shape")
        component = value["component"]
        for name in ("name", "class", "dtype"):
            self.name(component.get(name), f"factors.component.{name}")
        self.obj(component.get("config"), "factors.component.config")
        for name in ("name", "strategy"):
            self.name(value["target"].get(name), f"factors.target.{name}")
        return value

    def package(self, value: Any, paths: set[str]) -> dict[str, Any]:
        """What every strategy's record holds: the entry's file it names, the call signature it serves,
        and (optionally) the module instances it serves. Whatever else a record holds is its
        strategy's, checked by ``Strategy.check_records`` before the strategy uses it."""
        value = self.obj(value, "packages[]")
        path = self.name(value.get("path"), "packages[].path")
        if path not in paths:
            raise self.fail("packages[].path", f"names {path!r}, a file the entry does not have")
        self.name(value.get("signature"), "packages[].signature")
        for instance in self.list_of(value.get("instances", [""]), "packages[].instances"):
            if not isinstance(instance, str) or len(instance) > MAX_NAME:
                raise self.fail("packages[].instances", "not a list of names")
        return value

    def structure(self, value: Any) -> dict[str, Any]:
        value = self.obj(value, "structure")
        digest = value.get("digest")
        if not isinstance(digest, str) or not HEX64.match(digest):
            raise self.fail("structure.digest", "not a sha256")
        lines = self.list_of(value.get("lines"), "structure.lines")
        if not all(isinstance(line, str) and len(line) <= MAX_NAME for line in lines):
            raise self.fail("structure.lines", "not a list of lines")
        self.obj(value.get("compiler", {}), "structure.compiler")
        if value.get("dependencies") is not None:  # what the graphs depend on (aotbuild/pipeline/dependencies.py)
            self.dependencies(value["dependencies"])
        return value

    def dependencies(self, value: Any) -> None:
        value = self.obj(value, "structure.dependencies")
        items = self.obj(value.get("items", {}), "structure.dependencies.items")
        if not all(isinstance(v, str) and len(k) <= MAX_NAME and len(v) <= MAX_NAME for k, v in items.items()):
            raise self.fail("structure.dependencies.items", "not {path: text}")
        for state in self.list_of(value.get("globals", []), "structure.dependencies.globals"):
            if (not isinstance(state, list) or len(state) != 3 or not isinstance(state[0], bool)
                    or not isinstance(state[1], str) or not isinstance(state[2], list)
                    or not all(isinstance(a, str) for a in state[2])):
                raise self.fail("structure.dependencies.globals", "not [grad, dtype, [autocast]]")
        if value.get("calls") is not None:  # what the modules held at their first call, where it differs
            calls = self.obj(value["calls"], "structure.dependencies.calls")
            changed = self.obj(calls.get("changed", {}), "structure.dependencies.calls.changed")
            removed = self.list_of(calls.get("removed", []), "structure.dependencies.calls.removed")
            if not all(isinstance(v, str) and len(k) <= MAX_NAME and len(v) <= MAX_NAME for k, v in changed.items()) \
                    or not all(isinstance(k, str) and len(k) <= MAX_NAME for k in removed):
                raise self.fail("structure.dependencies.calls", "not {changed: {path: text}, removed: [path]}")

    def signed_by(self, value: Any) -> tuple[dict[str, str], ...]:
        items = self.list_of(value, "signed_by")
        if len(items) > 16:
            raise self.fail("signed_by", "more than 16 signatures")
        out = []
        for item in items:
            item = self.obj(item, "signed_by[]")
            if set(item) != {"key", "sig"} or not all(isinstance(v, str) and 0 < len(v) <= 256 for v in item.values()):
                raise self.fail("signed_by[]", "not {key, sig}")
            out.append({"key": item["key"], "sig": item["sig"]})
        return tuple(out)

    def proof(self, value: Any) -> Proof:
        value = self.obj(value, "proof")
        return Proof(load_s=self.number(value.get("load_s"), "proof.load_s"),
                     compiles=self.integer(value.get("compiles"), "proof.compiles"),
                     max_abs_diff=self.number(value.get("max_abs_diff"), "proof.max_abs_diff"),
                     tolerance=self.number(value.get("tolerance"), "proof.tolerance"),
                     instances=self.integer(value.get("instances"), "proof.instances"),
                     calls=self.integer(value.get("calls", 0), "proof.calls"),
                     counter=str(value.get("counter", ""))[:200],
                     swaps=self.integer(value.get("swaps", 0), "proof.swaps"),
                     served=self.obj(value.get("served", {}), "proof.served"),
                     padding=self.padding(value["padding"]) if value.get("padding") is not None else None)

    def padding(self, value: Any) -> dict[str, Any]:
        """``proof.padding``: what padding reads of it is checked here, once."""
        where = "proof.padding"
        value = self.obj(value, where)
        for item in self.list_of(value.get("signatures", []), f"{where}.signatures"):
            item = self.obj(item, f"{where}.signatures[]")
            self.name(item.get("signature"), f"{where}.signatures[].signature", printed=False)
            self.integer(item.get("batch"), f"{where}.signatures[].batch", 2)
            inputs = self.list_of(item.get("inputs"), f"{where}.signatures[].inputs")
            for path in inputs:
                steps = self.list_of(path, f"{where}.signatures[].inputs[]")
                if (not 2 <= len(steps) <= 16 or steps[0] not in ("args", "kwargs")
                        or not all(isinstance(s, str) and len(s) <= MAX_NAME or isinstance(s, int)
                                   and not isinstance(s, bool) and s >= 0 for s in steps)):
                    raise self.fail(f"{where}.signatures[].inputs[]", "not a path of names and indices")
        for size in self.list_of(value.get("sizes", []), f"{where}.sizes"):
            self.integer(size, f"{where}.sizes[]", 1)
        self.number(value.get("max_rel_diff", 0.0), f"{where}.max_rel_diff")
        self.number(value.get("tolerance", 0.0), f"{where}.tolerance")
        refused = value.get("refused", "")
        if not isinstance(refused, str) or len(refused) > MAX_NAME:
            raise self.fail(f"{where}.refused", "not a string of at most 4096 characters")
        self.printable(refused, f"{where}.refused")  # printed into ShapeNotBuilt and the load's notes
        return value

    def auto(self, value: Any) -> dict[str, Any]:
        value = self.obj(value, "auto")
        for item in self.list_of(value.get("attempts", []), "auto.attempts"):
            item = self.obj(item, "auto.attempts[]")
            self.name(item.get("strategy"), "auto.attempts[].strategy")
            self.name(item.get("outcome"), "auto.attempts[].outcome")
            if not isinstance(item.get("reason", ""), str):
                raise self.fail("auto.attempts[].reason", "not a string")
            self.number(item.get("seconds", 0), "auto.attempts[].seconds")
        self.obj(value.get("factors", {}), "auto.factors")
        return value

    def pack(self, value: Any) -> dict[str, Any]:
        value = self.obj(value, "pack")
        digest = value.get("sha256")
        if not isinstance(digest, str) or not HEX64.match(digest):
            raise self.fail("pack.sha256", "not a sha256")
        self.integer(value.get("size"), "pack.size")
        return value


