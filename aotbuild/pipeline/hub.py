"""Is the Hub reachable? One connection attempt with a short timeout, before huggingface_hub's own
calls, which retry a refused or unresolvable host for ~25 s with a warning line per retry.

Offline mode (``HF_HUB_OFFLINE=1``) is huggingface_hub's own: then no probe is made and its
functions read the local Hugging Face cache only.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlsplit

#: Seconds for the one connection attempt (DNS included).
PROBE_TIMEOUT = 3.0

_seen: dict[str, str] = {}


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
