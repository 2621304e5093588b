"""ClawGym-format task folders written for the tests (the format of ClawGym-Bench; none of its tasks).

Each writer makes one folder under `root`: data_entry.json, optional input_files/, and reward/ with
reward.sh (its last stdout line is the reward) and, where it says so, a check.py printing named
sub-scores that reward.sh averages.
"""

from __future__ import annotations

import json
from pathlib import Path

MOUNT = "/root/.openclaw/workspace"

# reward.sh in the usual shape: check.py prints {name: score}, the mean of the values is the reward.
AVERAGING_REWARD_SH = f"""#!/usr/bin/env bash
set -euo pipefail
python3 {MOUNT}/reward/check.py {MOUNT} | python3 -c '
import json, sys
scores = json.loads(sys.stdin.read())
print(sum(float(v) for v in scores.values()) / len(scores))'
"""

# Sum task: input/numbers.txt holds numbers; output/answer.txt must hold their sum. Two sub-scores.
SUM_CHECK_PY = """import json, sys
from pathlib import Path

ws = Path(sys.argv[1])
answer = ws / "output" / "answer.txt"
total = sum(int(x) for x in (ws / "input" / "numbers.txt").read_text().split())
print(json.dumps({
    "file_exists": 1.0 if answer.is_file() else 0.0,
    "content_correct": 1.0 if answer.is_file() and answer.read_text().strip() == str(total) else 0.0,
}))
"""

# Notes task (no input files): notes.md must exist and mention "clawfast". Three sub-scores, one of
# which (the workspace is where the task expects it) the do-nothing solution already earns.
NOTES_CHECK_PY = """import json, os, sys
from pathlib import Path

ws = Path(sys.argv[1])
notes = ws / "notes.md"
print(json.dumps({
    "at_mount_dir": 1.0 if os.getcwd() == str(ws) else 0.0,
    "notes_exist": 1.0 if notes.is_file() else 0.0,
    "mentions_clawfast": 1.0 if notes.is_file() and "clawfast" in notes.read_text() else 0.0,
}))
"""


def write_task(root: Path, task_id: str, query: str, *, reward_sh: str, check_py: str | None = None,
               inputs: dict[str, str] | None = None, category: str = "", grading_type: str = "automated",
               mount: bool = True, folder: str | None = None, extra: dict | None = None) -> Path:
    """One task folder (named `folder`, default the id). `inputs`: input_files/ content (None: none,
    and no input_mount_dir)."""
    path = root / (folder or task_id)
    (path / "reward").mkdir(parents=True)
    entry = {"task_id": task_id, "user_query": query,
             "metadata": {"category": category, "grading_type": grading_type}, **(extra or {})}
    if inputs is not None:
        if mount:
            entry["input_mount_dir"] = MOUNT
        for rel, content in inputs.items():
            (path / "input_files" / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / "input_files" / rel).write_text(content)
    (path / "data_entry.json").write_text(json.dumps(entry, indent=2))
    (path / "reward" / "reward.sh").write_text(reward_sh)
    (path / "reward" / "reward.sh").chmod(0o755)
    if check_py is not None:
        (path / "reward" / "check.py").write_text(check_py)
    return path


def write_sum_task(root: Path, task_id: str = "sum_0000", numbers: str = "1 2 3 4") -> Path:
    return write_task(root, task_id, "Add the numbers in input/numbers.txt and write the sum to output/answer.txt.",
                      reward_sh=AVERAGING_REWARD_SH, check_py=SUM_CHECK_PY, inputs={"input/numbers.txt": numbers},
                      category="data")


def write_notes_task(root: Path, task_id: str = "notes_0000") -> Path:
    return write_task(root, task_id, "Write notes.md with one line about clawfast.",
                      reward_sh=AVERAGING_REWARD_SH, check_py=NOTES_CHECK_PY, category="writing")


def write_suite(root: Path) -> Path:
    """A small suite: two graded tasks with inputs, one without input files."""
    root.mkdir(parents=True, exist_ok=True)
    write_sum_task(root, "sum_0000", "1 2 3 4")
    write_sum_task(root, "sum_0001", "10 20")
    write_notes_task(root, "notes_0000")
    return root
