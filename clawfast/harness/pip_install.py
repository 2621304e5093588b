"""Install a Python harness from PyPI into its own virtual environment in the harness cache.

`ensure_pip_harness("mini-swe-agent", "2.4.6")` returns the venv folder; run the harness with
``<venv>/bin/python -m <module>`` (console-script shebangs name the staging folder the venv was built
in, so they are not used). The venv has no access to the host's site-packages: the harness's
dependencies (litellm, pydantic, ...) never clash with clawfast's own.

Same cache root and the same guarantees as `clawfast.harness_install` (npm): the venv is published
by an atomic rename only after ``pip install`` succeeded (a marker file says so); concurrent callers
serialise on a lock file and install once. Not guaranteed: that the index still serves the version.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from clawfast.harness_install import cache_root, install_once, is_installed

# PEP 508 distribution names and exact versions only: the cache key must pin the install.
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!_-]*$")


def pip_install_dir(name: str, version: str) -> Path:
    """Where ``name==version`` is (or would be) installed."""
    if not _NAME.match(name):
        raise ValueError(f"not a Python distribution name: {name!r}")
    if not _VERSION.match(version):
        raise ValueError(f"not an exact version: {version!r} (pin one, e.g. '2.4.6')")
    return cache_root() / f"pypi__{name.lower()}@{version}"


def ensure_pip_harness(name: str, version: str, *, python: str | None = None, timeout: float = 1800.0) -> Path:
    """Create a venv with ``name==version`` in the cache unless already there; return the venv folder.

    python: the interpreter the venv is built on (default: this one). Raises ValueError for a
    malformed name/version and RuntimeError (with pip's output tail) if the install fails.
    """
    prefix = pip_install_dir(name, version)
    if is_installed(prefix):
        return prefix
    python = python or sys.executable

    def build(staging: Path) -> None:
        for argv in (
            [python, "-m", "venv", str(staging)],
            [str(staging / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-input",
             "--disable-pip-version-check", f"{name}=={version}"],
        ):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr)[-4000:]
                raise RuntimeError(f"{' '.join(argv[:4])} ... failed (exit {proc.returncode}):\n{tail}")

    return install_once(prefix, build, f"{name}=={version}")
