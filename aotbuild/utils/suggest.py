"""The "did you mean" of every error that names an unknown key, value, class or model."""

from __future__ import annotations

import difflib


def suggest(word: str, allowed: list[str] | tuple[str, ...]) -> str:
    """``"; did you mean 'X'?"`` for the closest of ``allowed``, or "" when none is close."""
    close = difflib.get_close_matches(word, list(allowed), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""
