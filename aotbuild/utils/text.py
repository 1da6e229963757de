"""Text for people: tables, and every value from a file made safe to print.

Names, reasons and fields come from recipes, model folders and manifests that other people write
(a pull request, a shared store), so what aotbuild prints of them goes through :func:`printable`:
a newline, a control character or an escape sequence is shown escaped (``\\n``, ``\\x1b``), so a
value cannot end a table row, inject a CI workflow command (``::error::``) or drive the terminal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def printable(text: Any) -> str:
    """``text`` on one line, every character that is not printable shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """Columns padded to their widest cell, a rule under the header; every cell :func:`printable`."""
    cells = [[printable(x) for x in row] for row in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *cells, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in cells]
    return "\n".join(line.rstrip() for line in out)
