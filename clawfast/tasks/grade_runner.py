"""Runs a PinchBench ``grade(transcript, workspace_path)`` function and prints clawfast's verifier
score line (`clawfast.tasks.verify`). Not imported by clawfast: it is copied into a fresh sandbox's
``$VERIFIER_DIR`` beside ``grade.py`` (the task's code) and ``transcript.json``, and run there with
``python3`` in a copy of the final workspace, so it uses the standard library only.

What ``grade`` (or the agent's code it runs) prints is discarded: the score line alone reaches stdout.
The score is the mean of the criteria ``grade`` returns (0 when it returns none, as PinchBench
scores it); ``details["criteria"]`` keeps them. A criterion that is not a number in [0, 1] (booleans
count as 0 / 1), a return value that is not a dict, or an exception is reported on stderr with exit
status 1, which the verifier turns into a ``verifier_error``: never a silent score.
"""

import json
import math
import os
import sys


def main() -> int:
    # Graders run the agent's code in this process (PinchBench's import the workspace's modules), which
    # could print a score line of its own: fd 1 points at /dev/null for good, and the one score line
    # goes to a private duplicate of it, written with functions bound before any of that code runs.
    dumps, write = json.dumps, os.write
    report_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    here = os.environ["VERIFIER_DIR"]
    with open(os.path.join(here, "transcript.json"), encoding="utf-8") as f:
        transcript = json.load(f)
    with open(os.path.join(here, "grade.py"), encoding="utf-8") as f:
        source = f.read()
    # The task's code runs as a module of its own, as PinchBench's runner executes it.
    namespace = {"__name__": "pinchbench_grade"}
    exec(compile(source, "grade.py", "exec"), namespace)
    grade = namespace.get("grade")
    if not callable(grade):
        print("grade.py defines no function grade(transcript, workspace_path)", file=sys.stderr)
        return 1
    scores = grade(transcript, os.getcwd())
    if not isinstance(scores, dict):
        print(f"grade returned {type(scores).__name__}, not a dict of criterion -> score", file=sys.stderr)
        return 1
    criteria = {}
    for name, value in scores.items():
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
            print(f"criterion {name!r}: {value!r} is not a score in [0, 1]", file=sys.stderr)
            return 1
        criteria[str(name)] = float(value)
    score = min(1.0, sum(criteria.values()) / len(criteria)) if criteria else 0.0
    write(report_fd, (dumps({"score": score, "details": {"criteria": criteria}}) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
