"""Every error aotbuild raises on purpose, in one place.

Each class carries the CLI exit code it maps to, so the CLI turns any of them into one line and a
code without a traceback (click's ``ClickException.exit_code``). Where a stdlib type fits, the error
inherits it too, so callers can catch either (huggingface_hub's ``LocalEntryNotFoundError``).
"""

from __future__ import annotations

from aotbuild.utils.text import printable


class AotbuildError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class RecipeError(AotbuildError, ValueError):
    """A recipe that cannot be used: names the file, the key and what is allowed."""

    exit_code = 2

    def __init__(self, source: str, key: str | None, message: str):
        self.source = source
        self.key = key
        self.message = message
        # One line whatever a recipe holds: a newline or control character is shown escaped.
        where = f"{printable(source)}: {printable(key)}: " if key else f"{printable(source)}: "
        super().__init__(where + printable(message))




class UsageError(AotbuildError, ValueError):
    """A bad argument to a command or API call."""

    exit_code = 2


class CacheMiss(AotbuildError, LookupError):
    """A compiled artifact the caller required is not in the cache."""

    exit_code = 3


class ShapeNotBuilt(CacheMiss):
    """A call at a shape that was not built, under ``strict_shapes=True``."""


class StaleGraph(CacheMiss):
    """A call whose compiled graph no longer computes what the changed module does (an attribute, a
    processor, a weight's layout or dtype, grad mode: aotbuild/pipeline/dependencies.py), under ``on_miss="error"``."""


class TargetUnavailable(AotbuildError, RuntimeError):
    """The recipe's target cannot run in this environment; the message says why."""


class StoreError(AotbuildError, OSError):
    """The cache store could not be read or written."""


class LockUnavailable(StoreError):
    """The store's lock file cannot be opened or created (a read-only store, a folder its user cannot
    write): raised instead of waiting, so a reader of a read-only store can go on unlocked."""


class ModelUnavailable(AotbuildError):
    """The model's files cannot be read or are refused: a folder's file that is not a bounded JSON
    object (NaN, nested too deep, too big), a link out of the folder, a component name that is not a
    plain name. The input is at fault, as with a bad recipe (exit 2)."""

    exit_code = 2


class ModelUnreachable(ModelUnavailable):
    """A Hub model's files cannot be fetched (offline and not in the local Hugging Face cache, no
    network, no such repo, gated): a failure of the model, not of the host (exit 1)."""

    exit_code = 1


class PackageMismatch(AotbuildError, RuntimeError):
    """A component's weights no longer fit the AOT package it was built with."""


class WeightsDiscarded(AotbuildError, RuntimeError):
    """A use of a weight dropped after load (``load_compiled(..., discard_weights=True)``): only its
    prepacked copy is kept; ``aotbuild.refit`` changes it (docs/prepack.md)."""


class RemoteError(AotbuildError, OSError):
    """A remote cache could not be reached, read or written; the message names it and the next step."""


class ManifestError(AotbuildError, ValueError):
    """A manifest that is malformed: it is no entry, for any reader (aotbuild/cache/manifest.py)."""


class StaleManifest(AotbuildError, ValueError):
    """A manifest of another format: a miss that ``gc --stale`` removes, not damage. ``format`` is what
    it says it is; ``files`` its file records where they could be read (so collecting it frees its
    blobs)."""

    def __init__(self, message: str, format: object, files: tuple = ()):
        super().__init__(message)
        self.format = format
        self.files = files


class ProofFailed(AotbuildError):
    """A build's fresh process did not serve the entry with 0 compiles and output equal to eager
    (aotbuild/builder/proof.py): the job fails and nothing is stored."""
