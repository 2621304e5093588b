"""clawfast.kernels' public names, and the CPU benchmark scripts' quick modes run (that it stands alone:
tests/test_dependencies.py R1); bench/gpu_kernels.py's smoke mode runs in tests/test_gpu_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args, env_extra=None, timeout=600):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_public_names():
    import clawfast.kernels as K

    for name in ("tree_logprobs", "linear_logprobs", "tree_attention", "tree_gae", "importance_weights", "policy_loss"):
        assert callable(getattr(K, name)) and callable(getattr(K, name + "_ref"))


def test_cpu_bench_quick_mode(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["bench/bench_kernels.py", "--quick", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["logprobs"] and data["gae"]
    assert all(r["max_abs_diff"] < 1e-4 for r in data["logprobs"] + data["gae"])


# Run from the checkout's root: what the top-level names `kernels` and `proxy` turn out to be.
_DESCRIBE = """\
import importlib, importlib.metadata, os
for name in ("kernels", "proxy"):
    try:
        m = importlib.import_module(name)
    except ModuleNotFoundError as e:
        print("missing" if e.name == name else e)
        continue
    f = getattr(m, "__file__", None)
    if f is None and not list(m.__path__):
        print("empty namespace")
    elif os.path.basename(os.path.dirname(os.path.dirname(f))) in ("a", "b") or f.startswith(os.getcwd()):
        print("checkout")
    else:
        print("distribution " + importlib.metadata.version(name))
"""


def _installed(name: str, absent: str) -> str:
    import importlib.metadata

    try:
        return "distribution " + importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return absent


def test_checkout_root_does_not_shadow_the_kernels_distribution():
    """Python run from the checkout's root finds kernels/ as the top-level `kernels` too, the name of the
    hub-kernels distribution that transformers imports when it is installed: transformers loads, and the
    import gets the distribution, or without it an empty namespace package (which transformers reads as
    not installed; a ModuleNotFoundError would fail transformers 5.x's probe). `proxy` is missing.
    tests/test_versions.py runs this at each supported transformers version, with and without hub kernels."""
    proc = _run(["-c", "import transformers.modeling_utils\n" + _DESCRIBE])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == [_installed("kernels", "empty namespace"), _installed("proxy", "missing")]


@pytest.mark.parametrize("site_packages", [True, False], ids=["site-packages", "no-site-packages"])
def test_two_checkouts_on_sys_path_hand_the_names_on(tmp_path, site_packages):
    """With two more checkouts' kernels/ and proxy/ on sys.path (and the root's), each shim skips every
    checkout: no recursion from one to the other, the same answer as with one checkout; without
    site-packages (-S) no hub kernels either."""
    for checkout in ("a", "b"):
        for name in ("kernels", "proxy"):
            (tmp_path / checkout / name).mkdir(parents=True)
            (tmp_path / checkout / name / "__init__.py").write_bytes((ROOT / name / "__init__.py").read_bytes())
    proc = _run([*([] if site_packages else ["-S"]), "-c", _DESCRIBE],
                {"PYTHONPATH": os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = _installed("kernels", "empty namespace") if site_packages else "empty namespace"
    proxy = _installed("proxy", "missing") if site_packages else "missing"
    assert proc.stdout.split("\n")[:2] == [kernels, proxy]


def _docs_python_blocks() -> list[str]:
    text = (ROOT / "docs" / "KERNELS.md").read_text()
    return [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]


@pytest.mark.parametrize("index, expected", [(0, "clip_frac"), (1, "row 6 sees rows [0, 1, 2, 6]")],
                         ids=["flat-ppo", "tree-attention"])
def test_docs_examples_run(index, expected):
    """The examples of docs/KERNELS.md are real code: run them as written."""
    blocks = _docs_python_blocks()
    assert len(blocks) == 2
    proc = _run(["-c", blocks[index]])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected in proc.stdout


@pytest.mark.parametrize("window", [None, 64])
def test_tree_attention_bench_quick_mode(tmp_path, window):
    out = tmp_path / "attention.json"
    proc = _run(["bench/bench_tree_attention.py", "--quick", "--out", str(out),
                 *(["--window", str(window)] if window else [])])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["size"] for r in rows] == [1024]
    paths = rows[0]["paths"]
    assert paths["torch"]["fwd_bwd_s"] > 0 and paths["flex"]["fwd_s"] > 0 and paths["dense"]["fwd_bwd_mib"] > 0
    if window:  # the baseline without the window, and fewer block pairs with it
        assert paths["torch-full"]["fwd_bwd_s"] > 0
        assert rows[0]["block_pairs"]["window"] < rows[0]["block_pairs"]["full"]
