"""How every benchmark reports: a JSON file always, and a table (or the JSON) on stdout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def emit_rows(rows: list[dict], out: str, *, as_json: bool, header: str, line: Callable[[dict], str]) -> None:
    """A benchmark's result: always written as JSON to ``out``; printed as JSON or as a table."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(rows, indent=2))
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    print(header)
    for row in rows:
        print(line(row))
    print(f"(JSON written to {out})")
