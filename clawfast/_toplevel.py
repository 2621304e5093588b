"""The top-level names ``kernels`` and ``proxy``, for Python started at a clawfast checkout's root.

The source directories kernels/ and proxy/ sit at the checkout's root and are installed as
``clawfast.kernels`` and ``clawfast.proxy``. With the root on sys.path (``python -m pytest`` or
``python -c`` run there), they are also found by their directory names, where they shadow other
distributions' top-level modules: the hub-kernels package that transformers imports (and requires
from 5.25 on), the proxy.py package. Their ``__init__`` then calls `hand_off`, which resolves the
name as the import system would without any clawfast checkout on sys.path (skipping every one, so
two checkouts cannot hand the name to each other in a loop) and puts what it finds in sys.modules.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _is_checkout_source(origin, marker: bytes) -> bool:
    """Whether ``origin`` is this package's __init__ in some clawfast checkout (its docstring starts
    with ``marker``)."""
    try:
        with open(origin, "rb") as f:
            return marker in f.read(4096)
    except (OSError, TypeError):
        return False


def _find_elsewhere(name: str, marker: bytes):
    paths = [p for p in sys.path
             if not (isinstance(p, str) and _is_checkout_source(os.path.join(p or os.curdir, name, "__init__.py"), marker))]
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = finder.find_spec(name, paths)
        elif hasattr(finder, "find_spec"):
            spec = finder.find_spec(name, None)
        else:
            continue
        if spec is not None and not _is_checkout_source(spec.origin, marker):
            return spec
    return None


def hand_off(name: str, marker: bytes, *, empty_when_missing: bool) -> None:
    """Make ``import name`` give what the name is without any checkout. When nothing else has it:
    an empty namespace package (no __file__, no version, no submodules) if ``empty_when_missing``,
    else ModuleNotFoundError, as without this directory."""
    spec = _find_elsewhere(name, marker)
    if spec is None:
        if not empty_when_missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # what the import statement returns once the caller's __init__ has run
    if spec.loader is not None:
        spec.loader.exec_module(module)
