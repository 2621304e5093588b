"""The dependency rules of clawfast, as tests.

R1 kernels: ``import clawfast.kernels`` pulls in no clawfast module but ``clawfast`` and ``clawfast.kernels.*``,
   and none of transformers, starlette, uvicorn, grpc, httpx, pydantic, ray, docker.
R2 core: importing clawfast.records, .tree, .pack, .tree_ref, .pack_ref pulls in neither torch nor an HTTP/RPC
   library, and no clawfast module but those five, ``clawfast`` and the compiled extension (clawfast._core).
R3 proxy: importing every module of clawfast.proxy pulls in nothing of clawfast.train, .sandbox, .harness,
   .rollout, .commands.
R4 adapters: importing every module of clawfast.sandbox, and of clawfast.harness, pulls in nothing of
   clawfast.proxy, .rollout, .train, .commands.
R5 train: importing every module of clawfast.train pulls in nothing of clawfast.proxy, .sandbox, .harness,
   .commands, and of clawfast.rollout only the service, its spec and its retry rule (clawfast.rollout, .service, .spec, .retry); statically, no import
   statement in clawfast/train (module level or inside a function) names such a module either.
R6 no import cycle among the module-level imports of clawfast modules (``if TYPE_CHECKING:`` blocks excluded;
   importing a.b.c also runs the __init__ of a.b when the importer is outside a.b); within clawfast.train, none
   even counting function-level imports.
R7 no module under clawfast/, proxy/, kernels/ does ``from <another clawfast module> import _private``
   (a private submodule of the importer's own package, such as ``from clawfast import _core`` in
   clawfast.tree or ``from . import _common`` in a kernel, is that package's own business and allowed).
R8 proxy client: ``import clawfast.proxy.grpc_client`` (the control-plane client, for processes outside the proxy)
   pulls in no HTTP server (starlette, uvicorn, fastapi, h11, httptools), no template engine (jinja2) and no
   pydantic: ``clawfast.proxy`` loads its public names on first access.
R9 contracts: every implementation of a protocol of clawfast.train.protocols (``RolloutSource``, ``Trainer``) is
   one (``issubclass`` of the runtime-checkable protocol) and has each of its methods with a compatible signature:
   the protocol's parameters, in order, of the same kind and default, and any others optional.

Import rules run in a fresh interpreter (``modules_after``), walking every module of a package with pkgutil;
an import error fails the test. No module needs excluding: the optional dependencies (vllm, ray, docker,
tensorboard, matplotlib) are imported inside functions only.

CLAWFAST_DEPS_ROOT=/path/to/checkout checks another checkout: the child drops the editable install's finder and
imports clawfast from <root>/clawfast, clawfast.proxy from <root>/proxy, clawfast.kernels from <root>/kernels
(the compiled extension from the installed package), and the static rules scan that checkout.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("CLAWFAST_DEPS_ROOT") or Path(__file__).resolve().parents[1])
PACKAGE_DIRS = {"clawfast": ROOT / "clawfast", "clawfast.proxy": ROOT / "proxy", "clawfast.kernels": ROOT / "kernels"}
EXTENSIONS = {"clawfast._core"}  # CMakeLists.txt: python_add_library(_core ...), installed into clawfast/
NEEDS_OPTIONAL: dict[str, str] = {}  # module -> the optional dependency it needs that is not installed here
HTTP_RPC = {"httpx", "requests", "urllib3", "aiohttp", "h11", "starlette", "uvicorn", "fastapi", "grpc", "openai",
            "anthropic"}

_REDIRECT = """\
import glob, importlib.util, os, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
_ext = [os.path.join(p, "clawfast") for p in sys.path if glob.glob(os.path.join(p or ".", "clawfast", "_core.*"))]
class _Redirect:
    dirs = {dirs!r}
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in cls.dirs:
            d = [cls.dirs[name], *(_ext if name == "clawfast" else [])]
            return importlib.util.spec_from_file_location(name, d[0] + "/__init__.py", submodule_search_locations=d)
sys.meta_path.insert(0, _Redirect)
"""


def modules_after(code: str) -> set[str]:
    """The names in sys.modules after a fresh interpreter has run `code`."""
    if os.environ.get("CLAWFAST_DEPS_ROOT"):  # and every clawfast module but the extension must come from ROOT
        code = _REDIRECT.format(dirs={k: str(v) for k, v in PACKAGE_DIRS.items()}) + code + (
            f"\nstray = [n for n, v in sys.modules.items() if n.startswith('clawfast') and n not in {EXTENSIONS!r}"
            f" and not (getattr(v, '__file__', None) or '').startswith({str(ROOT) + os.sep!r})]"
            "\nassert not stray, f'not imported from CLAWFAST_DEPS_ROOT: {stray}'")
    code += "\nimport json, sys; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"the child interpreter failed:\n{proc.stderr[-6000:]}", pytrace=False)
    return set(json.loads(proc.stdout.splitlines()[-1]))


def every_module_of(package: str) -> str:
    """Child code importing every module of `package` (an import error fails: onerror re-raises)."""
    return (f"import importlib, pkgutil, {package} as P\n"
            "def onerror(name): raise\n"
            "for m in pkgutil.walk_packages(P.__path__, P.__name__ + '.', onerror=onerror):\n"
            f"    if m.name not in {sorted(NEEDS_OPTIONAL)!r}: importlib.import_module(m.name)\n")


def under(mods, packages) -> list[str]:
    return sorted(m for m in mods if any(m == p or m.startswith(p + ".") for p in packages))


def tops(mods) -> list[str]:
    return sorted({m.split(".")[0] for m in mods})


def test_r1_kernels_stand_alone():
    mods = modules_after("import clawfast.kernels")
    ours = sorted(m for m in under(mods, ["clawfast"]) if m != "clawfast" and not under([m], ["clawfast.kernels"]))
    assert ours == [], f"importing clawfast.kernels pulled in {ours}"
    heavy = tops(under(mods, ["transformers", "starlette", "uvicorn", "grpc", "httpx", "pydantic", "ray", "docker"]))
    assert heavy == [], f"importing clawfast.kernels pulled in {heavy}"


def test_r2_core_is_light():
    core = ["clawfast.records", "clawfast.tree", "clawfast.pack", "clawfast.tree_ref", "clawfast.pack_ref"]
    mods = modules_after("".join(f"import {m}\n" for m in core))
    heavy = tops(under(mods, ["torch", *HTTP_RPC]))
    assert heavy == [], f"importing the core pulled in {heavy}"
    ours = sorted(set(under(mods, ["clawfast"])) - {"clawfast", *core, *EXTENSIONS})
    assert ours == [], f"importing the core pulled in {ours}"


def test_r3_proxy_stands_apart():
    bad = under(modules_after(every_module_of("clawfast.proxy")), [
        "clawfast.train", "clawfast.sandbox", "clawfast.harness", "clawfast.rollout", "clawfast.commands"])
    assert bad == [], f"importing clawfast.proxy pulled in {bad}"


@pytest.mark.parametrize("package", ["clawfast.sandbox", "clawfast.harness"])
def test_r4_adapters_stand_apart(package):
    bad = under(modules_after(every_module_of(package)),
                ["clawfast.proxy", "clawfast.rollout", "clawfast.train", "clawfast.commands"])
    assert bad == [], f"importing {package} pulled in {bad}"


TRAIN_FORBIDDEN = ["clawfast.proxy", "clawfast.sandbox", "clawfast.harness", "clawfast.commands", "clawfast.rollout"]
# The service's front, and the retry rule's counting of what a returned rollout's info says (the
# trainer's metrics read it; the module imports the records alone).
TRAIN_MAY_USE = {"clawfast.rollout", "clawfast.rollout.service", "clawfast.rollout.spec", "clawfast.rollout.retry"}


def test_r5_train_reaches_rollouts_only_through_the_service():
    mods = modules_after(every_module_of("clawfast.train"))
    bad = [m for m in under(mods, TRAIN_FORBIDDEN) if m not in TRAIN_MAY_USE]
    assert bad == [], f"importing clawfast.train pulled in {bad}"


def test_r8_proxy_client_is_light():
    heavy = tops(under(modules_after("import clawfast.proxy.grpc_client"),
                       ["starlette", "uvicorn", "fastapi", "h11", "httptools", "jinja2", "pydantic"]))
    assert heavy == [], f"importing clawfast.proxy.grpc_client pulled in {heavy}"


# --- static rules: the import statements of the source files -------------------------------------------------

def module_files() -> dict[str, Path]:
    """Every clawfast module of the checkout: {module name: file}."""
    out = {}
    for prefix, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            out[".".join((prefix, *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return out


MODULES = module_files()


def _known(name: str) -> str:
    """The module an import of `name` names: its longest prefix that is a clawfast module."""
    while name not in MODULES and name not in EXTENSIONS and "." in name:
        name = name.rpartition(".")[0]
    return name


def _module_level(body):
    """The statements of `body` run at import time: not in a function or class, nor under TYPE_CHECKING."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from _module_level(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            yield from _module_level(getattr(node, field, []))


def imports(module: str, everywhere: bool):
    """(line, clawfast module imported, ImportFrom base, ImportFrom name) of each import statement of `module`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree) if everywhere else _module_level(tree.body):
        if isinstance(node, ast.Import):
            found = [(_known(a.name), a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = ".".join(package.split(".")[: package.count(".") + 2 - node.level])
                base = f"{anchor}.{base}" if node.module else anchor
            found = [(_known(f"{base}.{a.name}"), base, a.name) for a in node.names]
        else:
            continue
        for target, base, name in found:
            if under([target], ["clawfast"]):
                yield node.lineno, target, base, name


def test_r5_train_imports_no_forbidden_module_even_inside_functions():
    bad = sorted({(str(MODULES[m].relative_to(ROOT)), line, target)
                  for m in MODULES if under([m], ["clawfast.train"])
                  for line, target, _, _ in imports(m, everywhere=True)
                  if under([target], TRAIN_FORBIDDEN) and target not in TRAIN_MAY_USE})
    bad = [f"{path}:{line} imports {target}" for path, line, target in bad]
    assert bad == [], "clawfast.train imports what it must not:\n" + "\n".join(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A cycle (as its modules, first = last) for each back edge a depth-first search meets: none iff acyclic."""
    found, state, stack = [], {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return found


def runs(importer: str, target: str) -> set[str]:
    """What importing `target` runs: it and the packages above it that `importer` is not already inside."""
    parts = target.split(".")
    return {p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if not under([importer], [p])}


def test_r6_no_import_cycle_at_module_level():
    graph = {m: {r for _, t, _, _ in imports(m, everywhere=False) for r in runs(m, t)} for m in MODULES}
    assert cycles(graph) == [], f"module-level import cycles: {cycles(graph)}"


def test_r6_no_import_cycle_within_train_even_inside_functions():
    train = [m for m in MODULES if under([m], ["clawfast.train"])]
    graph = {m: {r for _, t, _, _ in imports(m, everywhere=True) for r in runs(m, t) if r in train} for m in train}
    assert cycles(graph) == [], f"import cycles within clawfast.train: {cycles(graph)}"


def test_r7_no_private_name_imported_from_another_module():
    bad = []
    for m, path in MODULES.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for line, target, base, name in imports(m, everywhere=True):
            private = name is not None and name.startswith("_") and not name.startswith("__")
            own_submodule = target == f"{base}.{name}" and base == package
            if private and base != m and not own_submodule:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} from {base}")
    assert bad == [], "private names imported from another clawfast module:\n" + "\n".join(sorted(bad))


# --- R9: the protocol types and their implementations ---------------------------------------------------------

IMPLEMENTATIONS = {
    "clawfast.train.protocols.RolloutSource": ["clawfast.train.data.RecordedRollouts",
                                               "clawfast.train.data.HarnessRollouts",
                                               "clawfast.train.sampled.EngineRollouts"],
    "clawfast.train.protocols.Trainer": ["clawfast.train.distributed.LocalTrainer",
                                         "clawfast.train.distributed.ShardedTrainer"],
}

# Run in the child (so CLAWFAST_DEPS_ROOT checks that checkout); PROTOCOL and IMPLEMENTATION are prepended.
_CONFORMS = """
import importlib, inspect
def load(path):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)
proto, impl = load(PROTOCOL), load(IMPLEMENTATION)
assert issubclass(impl, proto), f"{impl.__name__} lacks a method of {proto.__name__}"
for name, method in vars(proto).items():
    if name.startswith("_") or not inspect.isfunction(method):  # typing's own hooks
        continue
    want, have = inspect.signature(method).parameters, inspect.signature(getattr(impl, name)).parameters
    where = (f"{impl.__name__}.{name}{inspect.signature(getattr(impl, name))}"
             f" vs {proto.__name__}.{name}{inspect.signature(method)}")
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    order = [p.name for p in want.values() if p.kind in positional]
    assert [p.name for p in have.values() if p.kind in positional][:len(order)] == order, f"positions: {where}"
    for p in want.values():
        q = have.get(p.name)
        assert q is not None and (q.kind, q.default) == (p.kind, p.default), f"parameter {p.name!r}: {where}"
    extra = [q.name for q in have.values() if q.name not in want and q.default is q.empty
             and q.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    assert not extra, f"required parameters {extra} the protocol does not pass: {where}"
"""


@pytest.mark.parametrize(("protocol", "implementation"),
                         [(p, i) for p, impls in IMPLEMENTATIONS.items() for i in impls])
def test_r9_implementations_satisfy_the_protocols(protocol, implementation):
    modules_after(f"PROTOCOL, IMPLEMENTATION = {protocol!r}, {implementation!r}\n" + _CONFORMS)
