"""`clawfast tasks list|check`: show a task suite, and prove each task's oracle scores 1 and doing
nothing scores 0.

    clawfast tasks list  [--suite SUITE] [--split train|eval] [--json]
    clawfast tasks check [--suite SUITE] [--split train|eval] [--json] [--sandbox] [--no-oracle]

SUITE: ``clawbench-mini`` (built in), ``clawgym:PATH[?eval=FRACTION]`` (ClawGym-format folders) or a
directory of task.toml folders. `check` exits 1 if any task is unsound (oracle below 1, do-nothing
above 0, or a verifier error). ``--no-oracle`` is for suites without oracles (ClawGym's): it scores
the do-nothing solution of each task only, reports its reward, and exits 1 on any verifier error.
Tasks whose workspace lies at a fixed absolute path are always verified in bwrap sandboxes (a plain
subprocess cannot put it there); the command says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from clawfast.tasks import Task, TaskFormatError, check_task, load_suite
from clawfast.tasks.verify import score_do_nothing
from clawfast.tasks.mini import SUITE_NAME


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, help_text in (("list", "list the tasks of a suite"),
                            ("check", "run each task's oracle and do-nothing solution through its verifier")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--suite", default=SUITE_NAME,
                       help=f"a built-in suite ({SUITE_NAME}), clawgym:PATH[?eval=FRACTION] (ClawGym-format "
                            f"task folders) or a directory of task.toml folders")
        p.add_argument("--split", choices=("train", "eval"), help="only the tasks of this split")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        if name == "check":
            p.add_argument("--sandbox", action="store_true",
                           help="run verifiers in fresh clawfast sandboxes, not plain subprocesses")
            p.add_argument("--no-oracle", action="store_true",
                           help="score only the do-nothing solution (for suites without oracles) and report it")


def _task_json(task: Task) -> dict[str, Any]:
    files = sorted(task.files)
    if task.workspace_dir is not None:
        files = sorted(set(files) | {str(p.relative_to(task.workspace_dir))
                                     for p in task.workspace_dir.rglob("*") if not p.is_dir()})
    return {"id": task.id, "instruction": task.instruction, "timeout": task.timeout, "tags": task.tags,
            "oracle": list(task.oracle), "workspace_files": files, "workdir": task.workdir}


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _list(tasks: list[Task], as_json: bool) -> int:
    if as_json:
        print(json.dumps([_task_json(t) for t in tasks], indent=1))
        return 0
    rows = [[t.id, t.split, t.category, t.tags.get("difficulty", "-"),
             t.instruction if len(t.instruction) <= 70 else t.instruction[:67] + "..."] for t in tasks]
    print(_table(["id", "split", "category", "difficulty", "instruction"], rows))
    print(f"{len(tasks)} tasks")
    return 0


def _check(tasks: list[Task], as_json: bool, use_sandbox: bool, no_oracle: bool) -> int:
    if not no_oracle and not all(t.oracle for t in tasks):
        missing = [t.id for t in tasks if not t.oracle]
        print(f"clawfast tasks: {len(missing)} task(s) have no oracle (first: {missing[0]}); use --no-oracle "
              f"to score their do-nothing solution", file=sys.stderr)
        return 2
    placed = sorted({t.workdir for t in tasks if t.workdir is not None})
    if placed and not use_sandbox:
        print(f"clawfast tasks: verifying in bwrap sandboxes: these tasks put their workspace at "
              f"{', '.join(placed)}", file=sys.stderr)
        use_sandbox = True
    check = _nothing_with if no_oracle else _check_with
    if not use_sandbox:
        return check(tasks, as_json, None)  # check_task's default: SubprocessRunner
    from clawfast.tasks.sandbox_runner import SandboxRunner

    with SandboxRunner() as runner:
        return check(tasks, as_json, runner)


def _nothing_with(tasks: list[Task], as_json: bool, runner) -> int:
    results, rows = [], []
    live = sys.stderr.isatty()
    for i, task in enumerate(tasks):
        if live:
            print(f"\r[{i + 1}/{len(tasks)}] {task.id}", end="", file=sys.stderr, flush=True)
        if task.verifier is None:
            # A judge alone scores it: there is no code to run on the do-nothing workspace.
            results.append({"id": task.id, "reward": None, "error": None, "judge_only": True})
            rows.append([task.id, task.split, task.category, "judged", "-", "-", ""])
            continue
        start = time.monotonic()
        verdict = score_do_nothing(task, runner)
        seconds = time.monotonic() - start
        error = verdict.error if verdict.status != "ok" else None
        results.append({"id": task.id, "reward": verdict.score, "error": error})
        subscores = verdict.details.get("subscores") or verdict.details.get("criteria") or {}
        rows.append([task.id, task.split, task.category, f"{verdict.score:.3f}",
                     " ".join(f"{k}={v:g}" for k, v in subscores.items())[:60] or "-",
                     f"{seconds:.2f}", (error or "")[:80]])
    if live:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    errors = sum(r["error"] is not None for r in results)
    scored = [r["reward"] for r in results if r["error"] is None and r["reward"] is not None]
    summary = {"tasks": len(results), "verifier_errors": errors,
               "mean_reward": sum(scored) / len(scored) if scored else None}
    if as_json:
        print(json.dumps({"tasks": results, "summary": summary}, indent=1))
    else:
        print(_table(["id", "split", "category", "reward", "subscores", "seconds", "error"], rows))
        mean = "-" if summary["mean_reward"] is None else f"{summary['mean_reward']:.3f}"
        judged = sum(r["reward"] is None for r in results)
        print(f"{len(results)} tasks, {errors} verifier errors, mean do-nothing reward {mean}"
              f"{' (over the tasks whose verifier ran)' if errors or judged else ''}"
              f"{f'; {judged} scored by a judge alone' if judged else ''}")
    return 1 if errors else 0


def _check_with(tasks: list[Task], as_json: bool, runner) -> int:
    results, rows = [], []
    for task in tasks:
        start = time.monotonic()
        c = check_task(task, runner)
        seconds = time.monotonic() - start
        problem = ""
        if not c.oracle_run.ok:
            last = c.oracle_run.results[-1]
            problem = "oracle command failed: " + (
                "timed out" if last.timed_out else f"exit {last.returncode}: {last.stderr.strip()[-80:]}")
        elif c.oracle.status != "ok" or c.nothing.status != "ok":
            problem = c.oracle.error or c.nothing.error or ""
        elif not c.sound:
            problem = "oracle below 1" if c.oracle.score < 1.0 else "do-nothing above 0"
        results.append({"id": task.id, "oracle": c.oracle.score, "oracle_status": c.oracle.status,
                        "nothing": c.nothing.score, "nothing_status": c.nothing.status,
                        "sound": c.sound, "problem": problem, "seconds": round(seconds, 3)})
        rows.append([task.id, task.split, f"{c.oracle.score:.2f}", f"{c.nothing.score:.2f}",
                     "ok" if c.sound else "FAIL", f"{seconds:.2f}", problem[:100]])
    failed = sum(not r["sound"] for r in results)
    if as_json:
        print(json.dumps({"tasks": results, "sound": len(results) - failed, "failed": failed}, indent=1))
    else:
        print(_table(["id", "split", "oracle", "nothing", "status", "seconds", "problem"], rows))
        print(f"{len(results) - failed}/{len(results)} tasks sound")
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    try:
        tasks = load_suite(args.suite, args.split)
    except (TaskFormatError, ValueError) as exc:
        print(f"clawfast tasks: {exc}", file=sys.stderr)
        return 2
    if args.action == "list":
        return _list(tasks, args.json)
    return _check(tasks, args.json, args.sandbox, args.no_oracle)
