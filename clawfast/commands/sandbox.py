"""`clawfast sandbox run [options] -- CMD...`: run one command in a fresh sandbox, by hand.

The command's stdout/stderr are passed through and its exit code is returned (124 when it timed out,
the `timeout` utility's convention; 125 when the sandbox itself failed); when it ran into one of the
sandbox's limits (memory, processes, file size, disk), stderr says which. The workspace starts as a copy
of `--workspace` (empty without it) and is discarded afterwards unless `--keep DIR` copies it out.

    clawfast sandbox run --allow-port 8000 -- curl -s http://127.0.0.1:8000/v1/models   # reaches the proxy
    clawfast sandbox run -- curl -s http://127.0.0.1:22                                  # refused
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

EXIT_TIMEOUT = 124
EXIT_SANDBOX_ERROR = 125


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    run_p = sub.add_parser("run", help="run CMD in a fresh sandbox and return its exit code")
    run_p.add_argument("--workspace", metavar="DIR", help="directory copied into the sandbox's workspace")
    run_p.add_argument(
        "--allow-port", metavar="PORT", type=int, action="append", default=[],
        help="host loopback TCP port reachable inside at the same port (repeatable)",
    )
    run_p.add_argument("--backend", choices=("bwrap", "docker", "local"), default="bwrap")
    run_p.add_argument("--timeout", metavar="S", type=float, default=600.0, help="wall-time limit (default 600)")
    run_p.add_argument(
        "--ro-bind", metavar="HOST:INSIDE", action="append", default=[],
        help="bind a host path read-only at an absolute path inside (repeatable)",
    )
    run_p.add_argument("--env", metavar="KEY=VALUE", action="append", default=[], help="set a variable (repeatable)")
    run_p.add_argument("--memory-mb", type=int, default=None, help="memory limit in MiB (default 4096)")
    run_p.add_argument("--disk-mb", type=int, default=None,
                       help="size of the workspace+home, and of /tmp, in MiB (default 4096)")
    run_p.add_argument("--cpus", type=float, default=None, help="CPU quota in cores (default: none)")
    run_p.add_argument("--image", default=None, help="docker backend: the image to run")
    run_p.add_argument("--keep", metavar="DIR", help="copy the final workspace to DIR (must not exist)")
    run_p.add_argument("--unsafe", action="store_true", help="required with --backend local (no isolation)")
    run_p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")


def _parse_pairs(items: list[str], sep: str, what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, found, value = item.partition(sep)
        if not found or not key:
            raise ValueError(f"{what} {item!r} must look like A{sep}B")
        out[key] = value
    return out


def run(args: argparse.Namespace) -> int:
    from clawfast.sandbox import Limits, SandboxError, SandboxSpec, create_backend
    from clawfast.sandbox.result import limit_message

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("clawfast sandbox run: give a command after --", file=sys.stderr)
        return 2
    if args.keep and os.path.exists(args.keep):
        print(f"clawfast sandbox run: --keep {args.keep} already exists", file=sys.stderr)
        return 2
    try:
        given = {"memory_bytes": None if args.memory_mb is None else args.memory_mb << 20,
                 "disk_bytes": None if args.disk_mb is None else args.disk_mb << 20, "cpus": args.cpus}
        limits = Limits(**{k: v for k, v in given.items() if v is not None})
        spec = SandboxSpec(
            source_dir=args.workspace,
            allow_ports=tuple(args.allow_port),
            ro_binds=_parse_pairs(args.ro_bind, ":", "--ro-bind"),
            env=_parse_pairs(args.env, "=", "--env"),
            limits=limits,
            default_timeout=args.timeout,
            name="cli",
        )
        spec.validate()
        options = {}
        if args.backend == "local":
            if not args.unsafe:
                raise ValueError("--backend local does not isolate anything; add --unsafe to use it")
            options["allow_unsafe"] = True
        if args.backend == "docker" and args.image:
            options["image"] = args.image
        backend = create_backend(args.backend, **options)
    except (ValueError, SandboxError) as exc:
        print(f"clawfast sandbox run: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else EXIT_SANDBOX_ERROR
    try:
        with backend, backend.create(spec) as sandbox:
            result = sandbox.run(cmd)
            if args.keep:
                shutil.copytree(sandbox.host_workdir, args.keep, symlinks=True)
    except SandboxError as exc:
        print(f"clawfast sandbox run: sandbox error: {exc}", file=sys.stderr)
        return EXIT_SANDBOX_ERROR
    sys.stdout.buffer.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.buffer.write(result.stderr)
    for stream, truncated in (("stdout", result.stdout_truncated), ("stderr", result.stderr_truncated)):
        if truncated:
            print(f"clawfast sandbox run: {stream} truncated", file=sys.stderr)
    if result.timed_out:
        print(f"clawfast sandbox run: timed out after {args.timeout:g}s", file=sys.stderr)
        return EXIT_TIMEOUT
    limit = limit_message(result, limits)
    if limit is not None:
        print(f"clawfast sandbox run: the command {limit}", file=sys.stderr)
    return result.exit_code
