"""The package at every transformers version it supports, with and without hub kernels (issue #40).

The checkout's kernels/ and proxy/ become clawfast.kernels and clawfast.proxy; as top-level names they
belong to others (`kernels` is the hub-kernels distribution, which transformers probes for and imports).
For the floor in pyproject.toml, 5.17 (the GPU image's) and the latest transformers, each with the
hub-kernels release in its range and without any, a fresh interpreter must import transformers, run
clawfast.kernels' tree attention and log-probs against their references, register tree attention in
transformers and run a tiny Qwen3 forward and backward through `clawfast.train.policy.Policy` on a tree
batch (matching the dense-mask reference), import the proxy, and find no project code under `import
kernels` / `import proxy`:
- started outside the checkout, on a `pip install .` of it (non-editable, into a throw-away directory);
- started at the checkout's root (where ./kernels and ./proxy are on sys.path), on a `pip install -e .`
  of it (the editable wheel installed into a throw-away site directory).
The main environment's own editable install (scripts/setup.sh) is checked too: its .pth adds nothing to
sys.path, and clawfast's packages come live from the checkout's sources.

The interpreters are those of the venv scripts/setup.sh builds under ${CLAWFAST_HOME:-~/.cache/clawfast}/
versions, which does not see the main environment; transformers and hub kernels are directories put
first on PYTHONPATH.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from clawfast.pretrained import home

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = home() / "versions"
VPY = VERSIONS / "venv" / "bin" / "python"
# (transformers, the hub-kernels release in its range): the floor, the GPU image's, the latest
MATRIX = [("4.57.1", "0.9.0"), ("5.17.0", "0.16.2"), ("5.25.0", "0.19.1")]
CASES = [(tv, kv, with_kernels, where) for tv, kv in MATRIX for with_kernels in (False, True)
         for where in ("outside", "root")]

# Run by each fresh interpreter: `python -c PROBE ROOT`; prints one JSON line.
PROBE = r'''
import importlib, importlib.metadata, json, os, sys
ROOT = os.path.realpath(sys.argv[1])
out = {}

def ours(path):
    return path is not None and os.path.realpath(path).startswith(ROOT + os.sep)

# transformers first, as a program using it would: its hub-kernels probe runs at import
import torch
import transformers
from transformers import AttentionInterface
from transformers.utils import import_utils
out["transformers"] = transformers.__version__
out["transformers_sees_kernels"] = bool(import_utils.is_kernels_available())

from clawfast.kernels import TreeMask, tree_attention, tree_attention_ref, tree_logprobs, tree_logprobs_ref
torch.manual_seed(0)
kv_end = torch.tensor([7, 7, 7, 5, 5, 5, 7, 7])  # a 3-row prompt, samples of 3 and 2 rows
q = torch.randn(8, 4, 16, dtype=torch.float64, requires_grad=True)
k = torch.randn(8, 2, 16, dtype=torch.float64, requires_grad=True)
v = torch.randn(8, 2, 16, dtype=torch.float64, requires_grad=True)
o = tree_attention(q, k, v, TreeMask(kv_end), backend="torch")
o_ref = tree_attention_ref(q, k, v, kv_end)
g = torch.autograd.grad(o.square().sum(), (q, k, v))
g_ref = torch.autograd.grad(o_ref.square().sum(), (q, k, v))
out["tree_attention_err"] = max([(o - o_ref).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(g, g_ref)])
hidden = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
rows, ids = torch.tensor([0, 1, 2, 2, 3, 6]), torch.tensor([3, 1, 4, 1, 5, 9])
lp, ent = tree_logprobs(hidden, weight, rows, ids, backend="torch")
lp_ref, ent_ref = tree_logprobs_ref(hidden, weight, rows, ids)
out["tree_logprobs_err"] = max((lp - lp_ref).abs().max().item(), (ent - ent_ref).abs().max().item())

import clawfast.train.attention as attention
from clawfast.train.policy import Policy
out["registered"] = attention.IMPLEMENTATION in AttentionInterface._global_mapping
config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  max_position_embeddings=64, tie_word_embeddings=False)
lm = transformers.Qwen3ForCausalLM(config).double()
input_ids = torch.randint(0, 64, (8,))
position_ids = torch.tensor([0, 1, 2, 3, 4, 5, 3, 4])
target_rows = torch.tensor([0, 1, 2, 2, 3, 4, 6])
target_ids = input_ids[torch.tensor([1, 2, 3, 6, 4, 5, 7])]
runs = {}
for backend in ("auto", "sdpa-dense"):  # tree attention (the torch path on a CPU), the dense-mask reference
    lm.zero_grad()
    res = Policy(lm, attention=backend)(input_ids, position_ids, kv_end, target_rows, target_ids)
    res.logprobs.sum().backward()
    runs[backend] = [res.logprobs.detach()] + [p.grad.clone() for p in lm.parameters()]
out["policy_err"] = max((a - b).abs().max().item() for a, b in zip(runs["auto"], runs["sdpa-dense"]))
out["policy_attention"] = lm.config._attn_implementation

import clawfast.proxy
import clawfast.proxy.grpc_client
out["clawfast"] = os.path.realpath(clawfast.__file__)
out["clawfast.kernels"] = os.path.realpath(sys.modules["clawfast.kernels"].__file__)
out["clawfast.proxy"] = os.path.realpath(clawfast.proxy.__file__)
out["sys.path"] = [os.path.realpath(p) for p in sys.path if p]

for name in ("kernels", "proxy"):  # last: after transformers has probed `kernels` its own way
    try:
        m = importlib.import_module(name)
    except ModuleNotFoundError as e:
        out[name] = "missing" if e.name == name else f"error: {e}"
        continue
    f = getattr(m, "__file__", None)
    if ours(f) or any(ours(p) for p in getattr(m, "__path__", [])):
        out[name] = "project"
    elif f is None and not list(getattr(m, "__path__", [])):
        out[name] = "empty namespace"
    else:
        out[name] = "distribution " + importlib.metadata.version(name)
print(json.dumps(out))
'''


def _run(cmd, cwd, env, timeout=300) -> dict:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not proc.stdout.strip():
        return {"error": f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _pip(*args: str, cwd=None) -> None:
    proc = subprocess.run([str(VPY), "-m", "pip", "-q", *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def installs(tmp_path_factory) -> dict[str, Path]:
    """`pip install .` (into a --target directory) and `pip install -e .` (the editable wheel, unpacked
    into a directory that a sitecustomize adds as a site directory) of the checkout, with the versions
    venv's build tools and a CMake build directory of this checkout's kept in the cache."""
    spec = " ".join(["transformers", *[tv for tv, _ in MATRIX], "kernels", *[kv for _, kv in MATRIX]])
    complete = VERSIONS / ".complete"
    assert VPY.exists() and complete.exists() and spec in complete.read_text(), \
        f"the versions venv for {spec!r} is missing or stale: run scripts/setup.sh"
    tmp = Path(os.path.realpath(tmp_path_factory.mktemp("versions")))
    build_dir = VERSIONS / f"build-{hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]}"
    _pip("install", "--no-deps", "--no-build-isolation", "--target", str(tmp / "site"),
         "-C", f"build-dir={build_dir}", str(ROOT))
    wheels = tmp / "wheels"
    proc = subprocess.run(
        [str(VPY), "-c", "import sys, scikit_build_core.build as b; "
         f"print(b.build_editable(sys.argv[1], {{'build-dir': {str(build_dir)!r}}}))", str(wheels)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with zipfile.ZipFile(wheels / proc.stdout.strip().splitlines()[-1]) as whl:
        whl.extractall(tmp / "editable")
    (tmp / "startup").mkdir()
    (tmp / "startup" / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(tmp / 'editable')!r})\n")
    (tmp / "cwd").mkdir()
    return {"site": tmp / "site", "editable": tmp / "editable", "startup": tmp / "startup", "cwd": tmp / "cwd"}


@pytest.fixture(scope="module")
def results(installs) -> dict:
    """The probe's output for every case, and for the main environment; two interpreters at a time."""
    jobs = {}
    for tv, kv, with_kernels, where in CASES:
        path = [VERSIONS / f"transformers-{tv}", *([VERSIONS / f"kernels-{kv}"] if with_kernels else []),
                installs["site"] if where == "outside" else installs["startup"]]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
               "PYTHONPATH": os.pathsep.join(map(str, path)), "PYTHONDONTWRITEBYTECODE": "1",
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        jobs[(tv, kv, with_kernels, where)] = ([str(VPY), "-c", PROBE, str(ROOT)],
                                               installs["cwd"] if where == "outside" else ROOT, env)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    jobs["main"] = ([sys.executable, "-c", PROBE, str(ROOT)], installs["cwd"], {**env, "HF_HUB_OFFLINE": "1"})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {key: pool.submit(_run, *job) for key, job in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def test_the_floor_is_the_lowest_version_tested():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = [re.fullmatch(r"transformers>=([\d.]+)", d) for d in deps]
    assert [m.group(1) for m in floor if m] == [MATRIX[0][0]]


def test_the_installs_put_only_clawfast_on_sys_path(installs):
    """pip install . adds the package and its metadata only; pip install -e . a .pth whose one line
    imports scikit-build-core's redirecting finder (no path line: the checkout's root stays off sys.path)."""
    assert sorted(p.name for p in installs["site"].iterdir() if p.name != "bin") == \
        ["clawfast", "clawfast-0.1.0.dist-info"]
    assert {p.name for p in (installs["site"] / "clawfast").iterdir()} >= {"kernels", "proxy", "__init__.py"}
    pth = [p.read_text().splitlines() for p in installs["editable"].glob("*.pth")]
    assert pth == [["import _editable_skbc_clawfast"]]


def test_the_main_environments_editable_install(results):
    """scripts/setup.sh's `pip install -e .`: no path line in its .pth, the checkout's root and parent
    off sys.path, clawfast's three packages served live from the checkout's sources (an edited or a
    new module takes effect without a reinstall), and no project code under the top-level names."""
    pth = [p for d in site.getsitepackages() for p in Path(d).glob("_editable_skbc_clawfast.pth")]
    assert len(pth) == 1, f"clawfast is not installed editable here: {pth}"
    assert pth[0].read_text().splitlines() == ["import _editable_skbc_clawfast"]
    out = results["main"]
    assert "error" not in out, out.get("error")
    assert not {str(ROOT), str(ROOT.parent)} & set(out["sys.path"])
    assert out["clawfast"] == str(ROOT / "clawfast" / "__init__.py")
    assert out["clawfast.kernels"] == str(ROOT / "kernels" / "__init__.py")
    assert out["clawfast.proxy"] == str(ROOT / "proxy" / "__init__.py")
    assert out["kernels"] != "project" and out["proxy"] == "missing"
    assert out["tree_attention_err"] < 1e-10 and out["tree_logprobs_err"] < 1e-10 and out["policy_err"] < 1e-10


@pytest.mark.parametrize("tv, kv, with_kernels, where", CASES,
                         ids=[f"transformers-{tv}-{'with-kernels-' + kv if w else 'without-kernels'}-{where}"
                              for tv, kv, w, where in CASES])
def test_version(results, installs, tv, kv, with_kernels, where):
    out = results[(tv, kv, with_kernels, where)]
    assert "error" not in out, out.get("error")
    assert out["transformers"] == tv
    assert out["transformers_sees_kernels"] is with_kernels
    assert out["tree_attention_err"] < 1e-10 and out["tree_logprobs_err"] < 1e-10
    assert out["registered"] and out["policy_attention"] == "clawfast_tree"
    assert out["policy_err"] < 1e-10
    if where == "outside":  # the non-editable install
        assert out["clawfast"] == str(installs["site"] / "clawfast" / "__init__.py")
        assert out["clawfast.kernels"] == str(installs["site"] / "clawfast" / "kernels" / "__init__.py")
    else:  # the editable install, from the root: the sources, live
        assert out["clawfast.kernels"] == str(ROOT / "kernels" / "__init__.py")
        assert out["clawfast.proxy"] == str(ROOT / "proxy" / "__init__.py")
    # the top-level names: the hub distribution, or nothing (at the root, the checkout's kernels/ becomes an
    # empty namespace package, which transformers reads as not installed; see kernels/__init__.py)
    absent = "missing" if where == "outside" else "empty namespace"
    assert out["kernels"] == (f"distribution {kv}" if with_kernels else absent)
    assert out["proxy"] == "missing"
