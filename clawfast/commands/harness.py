"""`clawfast harness`: install and check real agent harnesses.

    clawfast harness list
    clawfast harness install NAME [NAME ...]
    clawfast harness check NAME [--backend bwrap|local] [--task ID] [--timeout S] [--logs DIR] [--model M]
                               [--option KEY=VALUE ...]

`install` puts the pinned version into the harness cache (npm or a venv; network only the first
time). `check` runs one clawbench-mini task end to end through the proxy, a sandbox and the verifier,
with the scripted engine replaying the task's oracle through the harness's own shell tool, and prints
the calls captured, their tags, the reward and whether consecutive calls share a token prefix.
``--model`` renders with another model's tokenizer and chat template: a model directory or a
packaged model's name (`clawfast model list`); default the embedded model. ``--option`` sets one of
the harness's own options (what a run's ``[rollout.harness_options.NAME]`` sets; `list` names them),
the value read as TOML (``auto_compact_pct=30``, ``mid_turn_compaction=true``,
``instance_template='Do: {{task}}'``) or else taken as a string.
Exit status: 0 when the check passed, 1 when it ran but failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path
from typing import Any

from clawfast.harness import HARNESSES, get_harness


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="harness_command", required=True)
    sub.add_parser("list", help="the harnesses and their pinned versions")
    install = sub.add_parser("install", help="install pinned harness versions into the cache")
    install.add_argument("names", nargs="+", metavar="NAME", choices=sorted(HARNESSES))
    check = sub.add_parser("check", help="run one task end to end with the scripted engine")
    check.add_argument("name", metavar="NAME", choices=sorted(HARNESSES))
    check.add_argument("--backend", default="bwrap", choices=("bwrap", "local"),
                       help="sandbox backend (local: no isolation, for debugging)")
    check.add_argument("--task", default=None, metavar="ID", help="clawbench-mini task id (default: files-lines-0)")
    check.add_argument("--timeout", type=float, default=300.0, help="seconds the harness gets")
    check.add_argument("--logs", type=Path, default=Path("runs/harness-check"),
                       help="where the harness's stdout/stderr and trajectory files are kept")
    check.add_argument("--model", default=None, metavar="M",
                       help="tokenizer and chat template: a model directory or a packaged model's name")
    check.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                       help="one of the harness's own options (repeatable; the value is read as TOML)")


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as a harness's options: each value read as a TOML value, else the string."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option {pair!r}: expected KEY=VALUE")
        try:
            value = tomllib.loads(f"value = {text}")["value"]
        except tomllib.TOMLDecodeError:
            value = text
        options[key.strip()] = value
    return options


def run(args: argparse.Namespace) -> int:
    if args.harness_command == "list":
        for name, cls in sorted(HARNESSES.items()):
            options = ", ".join(cls.own_options()) or "-"
            print(f"{name:<16} {cls.version:<12} {cls.protocol:<18} options: {options}")
        return 0
    if args.harness_command == "install":
        for name in args.names:
            harness = get_harness(name)
            print(f"installing {name} {harness.version} ...", flush=True)
            try:
                install = harness.install()
            except (FileNotFoundError, RuntimeError) as exc:  # npm missing, or the install failed
                print(f"clawfast harness install {name}: {exc}", file=sys.stderr)
                return 1
            print(f"{name} {install.version}: {install.executable}")
        return 0
    from clawfast.rollout.check import check_harness, check_task
    from clawfast.rollout.spec import check_harness_options

    from clawfast.pretrained import MODELS, ModelPrepareError, prepare_model

    try:
        options = parse_options(args.option)
        check_harness_options(args.name, options, timeout_s=args.timeout, max_turns=1)
        task = check_task(args.task) if args.task else None
        model_dir = None
        if args.model in MODELS:
            model_dir = prepare_model(args.model, log=lambda line: print(line, file=sys.stderr, flush=True))
        elif args.model is not None:
            model_dir = Path(args.model)
            if not (model_dir / "config.json").is_file():
                raise ValueError(f"--model {args.model}: neither a packaged model ({', '.join(sorted(MODELS))}) "
                                 f"nor a model directory (no config.json)")
    except (ValueError, ModelPrepareError) as exc:
        print(f"clawfast harness check: {exc}", file=sys.stderr)
        return 2
    report = check_harness(args.name, backend=args.backend, task=task, timeout_s=args.timeout, logs_dir=args.logs,
                           model_dir=model_dir, options=options)
    print("\n".join(report.lines()))
    print("check passed" if report.ok else "check FAILED")
    return 0 if report.ok else 1
