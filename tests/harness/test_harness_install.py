"""`clawfast.harness_install` with the real npm, on a tiny package (``is-number``) in a private cache.

Checked: the install lands complete under the cache root, a second call touches neither npm nor the
disk, concurrent callers install once, a failed install leaves nothing behind, and malformed names
are refused before npm runs. Needs npm and its registry; marked ``harness``.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from clawfast import harness_install
from clawfast.harness_install import ensure_npm_harness, npm_bin

pytestmark = pytest.mark.harness


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(harness_install.ENV_CACHE, str(tmp_path / "cache"))
    if shutil.which("npm") is None:
        pytest.fail("npm is required for the harness tests (install Node.js and npm)")
    return tmp_path / "cache"


def test_install_once_then_from_the_cache(cache, monkeypatch):
    prefix = ensure_npm_harness("is-number", "7.0.0")
    assert prefix.parent == cache
    meta = json.loads((prefix / "node_modules" / "is-number" / "package.json").read_text())
    assert meta["version"] == "7.0.0"
    # Second call: no npm at all (PATH emptied), same prefix.
    monkeypatch.setenv("PATH", "")
    assert ensure_npm_harness("is-number", "7.0.0") == prefix
    with pytest.raises(FileNotFoundError, match="no such command"):
        npm_bin(prefix, "is-number")


def test_concurrent_callers_install_once(cache):
    results, errors = [], []

    def install():
        try:
            results.append(ensure_npm_harness("is-number", "6.0.0"))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=install) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    # Only the published install and its lock file remain: no staging folders.
    assert sorted(p.name for p in cache.iterdir()) == sorted([results[0].name, results[0].name + ".lock"])


def test_failed_install_leaves_nothing(cache):
    with pytest.raises(RuntimeError, match="npm install is-number@999.999.999 failed"):
        ensure_npm_harness("is-number", "999.999.999")
    assert [p.name for p in cache.iterdir()] == ["is-number@999.999.999.lock"]


@pytest.mark.parametrize(
    "name, version, extra",
    [
        ("Bad Name", "1.0.0", ()),
        ("is-number", "latest; rm -rf /", ()),
        ("is-number", "", ()),
        ("is-number", "7.0.0", ("no-version",)),
    ],
)
def test_malformed_specs_are_refused(cache, name, version, extra):
    with pytest.raises(ValueError):
        ensure_npm_harness(name, version, extra=extra)
    assert not cache.exists()
