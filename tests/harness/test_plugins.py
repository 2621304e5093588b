"""A harness of one's own, declared by an installed distribution under the entry-point group
``clawfast.harnesses``: registered with the built-in ones, taken by a run's config and checked end to
end through the CLI; a declaration that cannot serve stops the import with the distribution named.

Each case installs a real distribution (its ``dist-info`` with ``entry_points.txt``) into a folder
and runs a fresh interpreter with that folder on its path, as ``pip install`` of such a package would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A harness of its own: mini-swe-agent (installed by scripts/setup.sh) under another name, with a
# shorter first user message than the built-in adapter's default and an option of its own.
MODULE = '''
from clawfast.harness.mini_swe_agent import MiniSweAgent


class MyMini(MiniSweAgent):
    name = "my-mini"

    def __init__(self, *, lead: str = "", **options):
        options.setdefault("instance_template", lead + "{{task}}")
        super().__init__(**options)


class Strict(MiniSweAgent):
    name = "strict"

    def __init__(self, *, level: int, **options):
        super().__init__(**options)
        self.level = level


class NotAHarness:
    name = "not-a-harness"
'''


def install(site: Path, entries: str) -> None:
    """The distribution ``my-harnesses`` 0.1 with its module and `entries` under the group."""
    (site / "my_harnesses").mkdir(parents=True)
    (site / "my_harnesses" / "__init__.py").write_text(MODULE)
    info = site / "my_harnesses-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-harnesses\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[clawfast.harnesses]\n" + textwrap.dedent(entries))


def run(site: Path, argv: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_declared_harness_is_registered_and_a_run_takes_it(tmp_path):
    install(tmp_path / "site", "my-mini = my_harnesses:MyMini\n")
    (tmp_path / "run.toml").write_text('[rollout]\nharnesses = ["my-mini", "codex"]\n')
    code = textwrap.dedent("""
        from clawfast.harness import HARNESSES, get_harness
        from clawfast.train.config_file import load_config
        print(sorted(HARNESSES))
        print(type(get_harness("my-mini")).__module__)
        print(load_config("run.toml").rollout.harnesses)
    """)
    proc = run(tmp_path / "site", [sys.executable, "-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["['claude-code', 'codex', 'mini-swe-agent', 'my-mini', 'openclaw']",
                                        "my_harnesses", "('my-mini', 'codex')"]


def test_a_declared_harness_takes_its_own_options_from_the_run(tmp_path):
    """``[rollout.harness_options.my-mini]``: the plugin's own option and the one it passes on to
    mini-swe-agent's adapter reach the adapter a run builds; a name neither has is refused when the
    config loads, with the options it does have, and so is a run that leaves out an option a harness
    requires."""
    install(tmp_path / "site", "my-mini = my_harnesses:MyMini\nstrict = my_harnesses:Strict\n")
    (tmp_path / "run.toml").write_text('[rollout]\nharnesses = ["my-mini"]\nharness_max_turns = 6\n'
                                       '[rollout.harness_options.my-mini]\nlead = "Do: "\n')
    (tmp_path / "typo.toml").write_text('[rollout]\nharnesses = ["my-mini"]\n'
                                        '[rollout.harness_options.my-mini]\nleed = "Do: "\n')
    (tmp_path / "required.toml").write_text('[rollout]\nharnesses = ["my-mini", "strict"]\n')
    code = textwrap.dedent("""
        from clawfast.harness import get_harness
        from clawfast.train.build import harness_options
        from clawfast.train.config_file import ConfigError, load_config
        options = harness_options(load_config("run.toml"))["my-mini"]
        harness = get_harness("my-mini", **options)
        print(type(harness).own_options(), harness.instance_template, harness.max_turns)
        for path in ("typo.toml", "required.toml"):
            try:
                load_config(path)
            except ConfigError as exc:
                print(exc)
    """)
    proc = run(tmp_path / "site", [sys.executable, "-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "('lead', 'instance_template') Do: {{task}} 6",
        "typo.toml: field 'rollout': Value error, harness 'my-mini' has no option(s) ['leed']; its options: "
        "['lead', 'instance_template'] (its time and turn limits are rollout.timeout_s and rollout.harness_max_turns)",
        "required.toml: field 'rollout': Value error, harness 'strict': Strict.__init__() missing 1 required "
        "keyword-only argument: 'level'"]


def test_a_declared_harness_passes_the_harness_check(tmp_path):
    """`clawfast harness check my-mini`: the real mini-swe-agent under the plugin's name, in a bwrap
    sandbox behind the proxy, replays a task's oracle and scores 1."""
    install(tmp_path / "site", "my-mini = my_harnesses:MyMini\n")
    proc = run(tmp_path / "site", [sys.executable, "-m", "clawfast.cli", "harness", "check", "my-mini",
                                   "--logs", str(tmp_path / "logs")], tmp_path, timeout=600)
    assert proc.returncode == 0 and "check passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("entries, error", [
    ("my-mini = my_harnesses:Missing\n", "ImportError: entry point 'my-mini' = 'my_harnesses:Missing' "
                                          "(group 'clawfast.harnesses', distribution my-harnesses 0.1) does not load"),
    ("not-a-harness = my_harnesses:NotAHarness\n", "not a subclass of clawfast.harness.Harness"),
    ("other-name = my_harnesses:MyMini\n", "the class's name is 'my-mini'; the entry point must be that name"),
    ("mini-swe-agent = my_harnesses:MyMini\n", "the class's name is 'my-mini'"),
])
def test_a_declaration_that_cannot_serve_stops_the_import_and_names_its_distribution(tmp_path, entries, error):
    install(tmp_path / "site", entries)
    proc = run(tmp_path / "site", [sys.executable, "-c", "import clawfast.harness"], tmp_path)
    assert proc.returncode != 0 and error in proc.stderr and "my-harnesses 0.1" in proc.stderr, proc.stderr[-2000:]


def test_a_declared_name_that_is_taken_is_refused(tmp_path):
    """A distribution that declares a built-in harness's name under its own class."""
    install(tmp_path / "site", "codex = my_harnesses:Codex\n")
    (tmp_path / "site" / "my_harnesses" / "__init__.py").write_text(MODULE + textwrap.dedent('''
        from clawfast.harness.codex import Codex as _Codex


        class Codex(_Codex):
            pass
    '''))
    proc = run(tmp_path / "site", [sys.executable, "-c", "import clawfast.harness"], tmp_path)
    assert proc.returncode != 0, proc.stdout
    assert "'codex' is already the harness clawfast.harness.codex.Codex" in proc.stderr, proc.stderr[-2000:]
