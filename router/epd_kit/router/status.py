"""`epd-router status --url URL`: the router's /pools as a table."""

from __future__ import annotations

from typing import Any

COLUMNS = ("id", "role", "state", "healthy", "inflight", "served", "failures", "url")


def pools_table(doc: dict[str, Any]) -> str:
    rows = [[str(e.get(c, "")) for c in COLUMNS] for e in doc.get("engines", [])]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(
        f"ready={str(doc.get('ready')).lower()} draining={str(doc.get('draining')).lower()} "
        f"active_requests={doc.get('active_requests')}"
    )
    return "\n".join(line.rstrip() for line in lines)
