"""Where a run's metrics go: a JSONL file (the source of truth) and TensorBoard scalars.

``<run_dir>/metrics.jsonl`` holds one JSON object per line: ``{"kind": "train", "step": N, ...}``
for a training step, ``{"kind": "eval", "step": N, "pass@1": ..., "pass@1/<harness>": ...}`` for an
evaluation, ``{"kind": "coldstart", "epoch": E, ...}`` for the warm-up. Every line is flushed
when written. On resume, `MetricsLogger(run_dir, resume_step=S)` first drops the lines of steps
after S (they belong to work the checkpoint does not hold), so a resumed run's file lists every
step exactly once. The names are `clawfast.train.metrics`'s.

Not guaranteed: TensorBoard output when the `tensorboard` package is missing (the JSONL is always
written; the logger says once that TensorBoard is off).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe: non-finite floats become None (JSON has no NaN)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


class MetricsLogger:
    """Appends metric records to ``metrics.jsonl`` and, when available, TensorBoard (``tb/``)."""

    def __init__(self, run_dir: str | Path, *, resume_step: int | None = None, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            truncate_after(self.path, resume_step)
        elif self.path.exists():
            self.path.unlink()  # a fresh run owns its file
        self._fh = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step drops TensorBoard events of steps after the checkpoint on resume.
                self._tb = SummaryWriter(str(self.run_dir / "tb"),
                                         purge_step=None if resume_step is None else resume_step + 1)
            except ImportError:
                print("clawfast: tensorboard is not installed; metrics go to metrics.jsonl only", file=sys.stderr)

    def log(self, kind: str, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"kind": kind, "step": int(step), "time": time.time(), **_clean(metrics)}
        self._fh.write(json.dumps(record, sort_keys=True) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
            self._tb.flush()
        return record

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(run_dir_or_file: str | Path) -> list[dict[str, Any]]:
    """Every record of a run's metrics.jsonl (a torn last line, from a kill mid-write, is skipped).
    Raises FileNotFoundError without the file, ValueError (naming the file, and the line) for a file
    that is not UTF-8 text or a line that is not a JSON object."""
    path = Path(run_dir_or_file)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file")
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a metrics file (not UTF-8 text: {exc.reason} at byte {exc.start})") from None
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
        # Every reader does record.get(...): a list or a number would crash it with an AttributeError.
        if not isinstance(record, dict):
            raise ValueError(f"{path}: line {i + 1} is not a JSON object")
        records.append(record)
    return records


def truncate_after(path: Path, step: int) -> None:
    """Keep only records with ``step <= step`` (and cold-start records), rewritten atomically."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if r.get("kind") == "coldstart" or r.get("step", 0) <= step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        for r in kept:
            fh.write(json.dumps(r, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
