"""bench/bench_peers.py --quick in the peers' venv (bench/peers/setup.sh, run by scripts/setup.sh):
every section imports its peer, agrees with it on the same inputs, and times both sides."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS_PYTHON = Path(os.environ.get("CLAWFAST_HOME", Path.home() / ".cache" / "clawfast")) / "venv-peers" / "bin" / "python"


def test_every_section_agrees_with_its_peer_then_times_both(tmp_path):
    assert PEERS_PYTHON.is_file(), f"{PEERS_PYTHON} is missing: run bash bench/peers/setup.sh (scripts/setup.sh does)"
    out = tmp_path / "peers.json"
    proc = subprocess.run([str(PEERS_PYTHON), "bench/bench_peers.py", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    # each section's status line first (a failed one carries its reason), then the tails
    status = "\n".join(line for line in proc.stdout.splitlines() if line.startswith("  "))
    assert proc.returncode == 0, status + "\n" + proc.stdout[-3000:] + proc.stderr[-4000:]
    sections = json.loads(out.read_text())["sections"]
    assert set(sections) == {"packing", "attention", "logprobs", "gae", "importance"}
    for name, section in sections.items():
        assert section["status"] == "ok" and section["rows"], name
        for row in section["rows"]:
            assert row["max_diff"] <= row["tol"], (name, row)
            assert row["ours_s"] > 0, (name, row)
            # a row with no peer timing (FlexAttention's backward on a CPU) must say why
            assert (row["peer_s"] or 0) > 0 or "no CPU backward" in row["note"], (name, row)


def test_a_missing_peer_is_reported_not_run(tmp_path):
    """The main environment has no peers: each section says which module is missing and the run fails."""
    import sys

    out = tmp_path / "peers.json"
    proc = subprocess.run([sys.executable, "bench/bench_peers.py", "--quick", "--sections", "logprobs", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    section = json.loads(out.read_text())["sections"]["logprobs"]
    assert proc.returncode == 1 and section["status"] == "missing"
    assert "cut_cross_entropy is not importable" in section["note"]
