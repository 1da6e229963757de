"""Is the Hub reachable? One connection attempt with a short timeout, before huggingface_hub's own
calls, which retry a refused or unresolvable host for ~25 s with a warning line per retry.

Offline mode (``HF_HUB_OFFLINE=1``) is huggingface_hub's own: then no probe is made and its
functions read the local Hugging Face cache only.

:func:`repo_id_problem` is the one check of a Hub repo id that a recipe names (``model.id``, a LoRA
adapter's ``path``), made before any fetch; :func:`fetch_problem` says what a failed fetch of a file of
one means and what to do, by the kind of failure.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from urllib.parse import urlsplit

#: Seconds for the one connection attempt (DNS included).
PROBE_TIMEOUT = 3.0

_seen: dict[str, str] = {}

#: One part of a Hub repo id (owner or name): 1 to 96 ASCII letters, digits, "_", "-" and ".", starting
#: and ending with a letter, digit or "_" (huggingface_hub's ``REPO_ID_REGEX``, ASCII as its is).
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
#: A Hub repo id: ``name`` or ``owner/name``; besides, no "--" or ".." and no ".git" at the end.
REPO_ID = re.compile(rf"(?:{_REPO_PART}/)?{_REPO_PART}")
REPO_ID_RULES = ("name or owner/name: ASCII letters, digits, '-', '_', '.', at most 96 each, no '--' or '..', "
                 "no .git end")


def repo_id_problem(repo_id: str) -> str:
    """Why ``repo_id`` cannot name a Hub repo ("" when it can), decided here, before any fetch.

    A malformed id used to reach ``hf_hub_download``, whose ``HFValidationError`` read as "cannot fetch"
    (a Hub failure: plan "unavailable", build exit 1) or, offline, as an unreachable Hub; it is the
    recipe's fault, exit 2 (issue 53). huggingface_hub's own ``validate_repo_id`` has the last word,
    for what a later version refuses."""
    if not REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith(".git"):
        return f"not a Hub repo id ({REPO_ID_RULES})"
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:  # no huggingface_hub: nothing is fetched either
        return ""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        return f"not a Hub repo id ({str(exc).splitlines()[0][:200]})"
    return ""


#: The Hub's answer to a repo it will not show: 401 to a request without a (valid) token, whether the repo
#: is missing, private or gated (it cannot tell them apart for an anonymous caller); 404 with a token.
NOT_FOUND_OR_GATED = "not found, or gated/private: check the id, or accept its terms and set HF_TOKEN"
#: Offline, no network, or the file was never downloaded: what to do without the Hub.
NO_NETWORK = ("no network? pre-download it (hf download), set HF_HUB_OFFLINE=1 to use only the local Hugging "
              "Face cache, or point model.id at a local folder")


def fetch_problem(exc: BaseException) -> str:
    """What a failed fetch from the Hub means, and what to do, by the kind of ``exc`` (huggingface_hub's
    error classes and the HTTP status, never its message's words): one line.

    An unknown repo fetched without a token is a 401 ``RepositoryNotFoundError``: it used to read as
    "a gated or private repo" (the "401" in the message), so a typo in ``model.id`` sent users off to
    accept terms (issue 55). ``GatedRepoError`` is the Hub saying the repo is gated."""
    from huggingface_hub import errors

    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.GatedRepoError):  # before RepositoryNotFoundError, its base class
        return "a gated repo: accept its terms on the Hub, then set HF_TOKEN to a token of that account"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"the Hub answered {status}: {NOT_FOUND_OR_GATED}" if status != 404 else
                "not found, or private and this token cannot read it: check the id (owner/name) and HF_TOKEN")
    if isinstance(exc, errors.RevisionNotFoundError):
        return "no such revision in the repo: check model.revision"
    if isinstance(exc, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)) or \
            "Connect" in type(exc).__name__:
        return f"{type(exc).__name__}; {NO_NETWORK}"
    if isinstance(exc, errors.EntryNotFoundError):
        return "the repo has no such file (a diffusers pipeline has model_index.json and one folder per component)"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    reason = f"{type(exc).__name__}: {reason[:200]}{' ...' if len(reason) > 200 else ''}" if reason \
        else type(exc).__name__
    if status == 401:
        return f"{reason}; the Hub refused the token: check HF_TOKEN"
    if status == 403:
        return (f"{reason}; this token may not read it: accept the repo's terms on the Hub, or use a token with "
                f"read access")
    return reason


def offline_mode() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def unreachable(url: str | None = None, timeout: float = PROBE_TIMEOUT) -> str:
    """Why the Hub at ``url`` (default: HF_ENDPOINT or huggingface.co) cannot be reached, or ""
    when a TCP connection opens. Asked once per endpoint and process."""
    url = url or endpoint()
    if url in _seen:
        return _seen[url]
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[str] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append("")
        except OSError as exc:
            outcome.append(f"{type(exc).__name__}: {exc.strerror or exc}")

    # getaddrinfo has no timeout of its own: the attempt runs in a thread we stop waiting for.
    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(timeout + 0.5)
    why = outcome[0] if outcome else f"no answer within {timeout:g} s"
    _seen[url] = f"cannot reach {host}:{port} ({why})" if why else ""
    return _seen[url]
