"""The row stream of a GPU-check section: one JSON object per finished case.

A section of ``bench/gpu_check.py`` runs as a child process given ``--rows PATH``. Every case it
finishes is appended to PATH as one JSON line (flushed at once) and printed as one line, so a
section cut short by its time limit still reports every case that ran; the parent reads the file
as it grows. Without a path (a script run on its own) rows are only printed.

Row keys (all optional but ``op`` and ``case``; see ``bench/gpu_check.py`` COLUMNS): ``op``,
``case``, ``shape``, ``ms``, ``baseline``, ``baseline_ms``, ``ratio``, ``bar``, ``peak_mib``,
``baseline_peak_mib``, ``mem_ratio``, ``err``, ``tol``, ``ok`` (a correctness case: True / False),
``note``.
"""

from __future__ import annotations

import json
from pathlib import Path


def format_row(row: dict) -> str:
    """One line for a terminal: op, case, then the measured fields that are present."""
    parts = [str(row.get("op", "")), str(row.get("case", ""))]
    for key in ("shape", "ms", "baseline", "baseline_ms", "ratio", "peak_mib", "err", "tol", "note"):
        value = row.get(key)
        if value is None or value == "":
            continue
        parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    if "ok" in row:
        parts.append("ok" if row["ok"] else "FAILED")
    return " | ".join(parts)


class Rows:
    """Appends each row to a JSON-lines file as it is added, and prints it."""

    def __init__(self, path: Path | str | None, prefix: str = ""):
        self.path = Path(path) if path is not None else None
        self.prefix = prefix
        self.rows: list[dict] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def add(self, **row) -> dict:
        self.rows.append(row)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
        print(self.prefix + format_row(row), flush=True)
        return row

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if r.get("ok") is False]


def read_rows(path: Path | str) -> list[dict]:
    """The rows written so far (a last line cut off mid-write is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
