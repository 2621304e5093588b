"""The harness adapter contract: install a pinned harness, configure it, give the command that runs it.

An adapter never patches or wraps the harness: it writes the configuration files and environment
variables the harness documents (base URL, key, model name, headless flags) into the sandbox's HOME and
returns the argv of its own CLI. Running the argv, enforcing the wall-clock limit and scoring the
workspace belong to the sandbox and the rollout scheduler (`clawfast.rollout`).

Paths: an adapter writes files on the host (`RunLayout.home`, `RunLayout.workspace`) but configures the
harness with the paths it will see inside the sandbox (`RunLayout.home_inside`, ...). The install is
mounted read-only at the same path inside as on the host, so argv can name it directly and nothing in
it is ever written to.

Guaranteed: `prepare` only writes below `layout.home` (never into the install or the workspace);
`command` is a pure function of the instruction. Not guaranteed: that a harness honours every knob
(harnesses change between versions; each adapter pins the version it was checked against).
"""

from __future__ import annotations

import abc
import inspect
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

# Every harness reads HOME; these keep the environment small and reproducible inside the sandbox.
BASE_ENV = {
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "NO_COLOR": "1",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
}


@dataclass(frozen=True)
class HarnessInstall:
    """A pinned harness installed in the cache.

    root: the folder to mount read-only into the sandbox (at the same path).
    executable: what argv[0] of `Harness.command` is (inside `root`).
    """

    name: str
    version: str
    root: Path
    executable: Path


@dataclass(frozen=True)
class RunLayout:
    """One rollout's private folders, as the host sees them and as the harness sees them.

    home / workspace: host folders (written by `prepare`, read back by `artifacts`).
    home_inside / workspace_inside: the same folders inside the sandbox (default: the same paths,
    as with the local backend).
    """

    home: Path
    workspace: Path
    home_inside: str = ""
    workspace_inside: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", Path(self.home))
        object.__setattr__(self, "workspace", Path(self.workspace))
        if not self.home_inside:
            object.__setattr__(self, "home_inside", str(self.home))
        if not self.workspace_inside:
            object.__setattr__(self, "workspace_inside", str(self.workspace))


@dataclass
class PreparedRun:
    """What `Harness.prepare` produced: the environment (complete: nothing is inherited from the
    host) and the files it wrote, host paths."""

    env: dict[str, str]
    files: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class ScriptedToolCall:
    """One tool call a scripted assistant turn makes: the tool's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ScriptedTurn:
    """One assistant turn for the scripted engine: text, then tool calls (possibly none)."""

    text: str = ""
    tool_calls: tuple[ScriptedToolCall, ...] = ()

    def to_entry(self) -> dict[str, Any]:
        """The script entry `clawfast.engines.scripted.ScriptedEngine` plays."""
        return {"text": self.text, "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in self.tool_calls]}


# An adapter option by this name is the model's context in tokens (prompt + output), the figure the
# harness compacts against; a rollout service sets it to what its proxy serves.
CONTEXT_OPTION = "context_window"


class Harness(abc.ABC):
    """One real agent harness behind a small interface.

    Class attributes: `name` (the CLI/registry name used by `clawfast harness NAME`), `version`
    (pinned), `protocol` (the API it speaks to the proxy: ``anthropic``, ``openai-chat`` or
    ``openai-responses``).
    """

    name: ClassVar[str]
    version: ClassVar[str]
    protocol: ClassVar[str]

    def __init__(self, *, timeout_s: float = 600.0, max_turns: int = 30, install: HarnessInstall | None = None) -> None:
        """timeout_s: the harness's own run limit where it has one (the sandbox enforces the wall
        clock). max_turns: its turn limit where it has one. install: an existing install to use
        instead of the pinned one in the cache."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.timeout_s = float(timeout_s)
        self.max_turns = int(max_turns)
        self._install = install

    @classmethod
    def own_options(cls) -> tuple[str, ...]:
        """The keyword options this adapter adds to `Harness`'s three, which belong to the run
        (``rollout.timeout_s``, ``rollout.harness_max_turns``, the cached install): the named
        parameters of each constructor from `cls` up, as far as each passes ``**options`` on. A run
        sets them in ``rollout.harness_options.NAME``; construction must stay cheap and free of side
        effects, since the run's config builds each adapter once to check them. An option named
        `CONTEXT_OPTION` is the model's context as the harness is told it: where a run leaves it
        unset, the proxy's limit fills it (`clawfast.rollout.spec.with_context`)."""
        names: list[str] = []
        run_level = set(inspect.signature(Harness.__init__).parameters)
        for klass in cls.__mro__:
            if klass is Harness:
                break
            if "__init__" not in vars(klass):
                continue
            params = list(inspect.signature(vars(klass)["__init__"]).parameters.values())[1:]
            names += [p.name for p in params
                      if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in {*names, *run_level}]
            if not any(p.kind is p.VAR_KEYWORD for p in params):
                break
        return tuple(names)

    # -- install ------------------------------------------------------------------------------

    @abc.abstractmethod
    def install(self) -> HarnessInstall:
        """Install the pinned version into the cache unless it is there (uses the network the first
        time only) and return it."""

    @property
    def installation(self) -> HarnessInstall:
        """The install `command` runs (installs on first use)."""
        if self._install is None:
            self._install = self.install()
        return self._install

    # -- one rollout --------------------------------------------------------------------------

    @abc.abstractmethod
    def prepare(self, layout: RunLayout, base_url: str, key: str, model: str) -> PreparedRun:
        """Write this harness's configuration under `layout.home` and return its environment.

        base_url: the proxy root as seen from inside the sandbox, ``http://127.0.0.1:PORT`` without
        ``/v1`` (adapters of OpenAI-protocol harnesses append it). key: the rollout's API key.
        model: the model name the harness sends (every alias the harness has maps to it).
        """

    @abc.abstractmethod
    def command(self, task_instruction: str, layout: RunLayout) -> list[str]:
        """The argv that runs the harness headless on `task_instruction` in `layout.workspace_inside`.
        The instruction is data: one starting with '-' must still be the prompt (after `--`, or as the
        value of an option, never a bare argument among the options)."""

    def artifacts(self, layout: RunLayout) -> list[Path]:
        """Host paths of the trajectory/session files the run left in HOME (kept with the rollout)."""
        return []

    def transcript(self, layout: RunLayout) -> list[dict] | None:
        """The harness's own session log of the run, as PinchBench transcript events, or None when this
        harness keeps none that clawfast reads (the rollout then builds one from the recorded calls)."""
        return None

    def exit_reason(self, stdout: str) -> str | None:
        """Why a run that exited with an error ended, as the harness reported it in the structured
        output its headless mode writes to stdout (`command`); None where it reported nothing that
        clawfast reads (the rollout keeps its stderr tail either way)."""
        return None

    def unfinished(self, layout: RunLayout) -> str | None:
        """Why a run that exited with status 0 did not finish, as the harness recorded it (a step limit
        it stopped at: another harness exits non-zero there); None where it finished or records
        nothing clawfast reads. The rollout is then a ``harness_error`` saying so."""
        return None

    @abc.abstractmethod
    def scripted_turns(self, oracle_commands: list[str], final_text: str) -> list[ScriptedTurn]:
        """Assistant turns that run `oracle_commands` with this harness's own shell tool, one call per
        turn, then finish with `final_text` the way this harness expects a run to end."""

    # -- helpers shared by adapters -----------------------------------------------------------

    @staticmethod
    def _validate_common(base_url: str, key: str, model: str) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if base_url.rstrip("/").endswith("/v1"):
            raise ValueError(f"base_url must be the proxy root without /v1, got {base_url!r}")
        if not key or any(ch.isspace() for ch in key):
            raise ValueError("key must be a non-empty string without whitespace")
        if not model or any(ch.isspace() for ch in model):
            raise ValueError(f"model must be a non-empty name without whitespace, got {model!r}")

    @staticmethod
    def _write(path: Path, text: str, written: list[Path]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)

    @staticmethod
    def _write_json(path: Path, obj: Any, written: list[Path]) -> None:
        Harness._write(path, json.dumps(obj, indent=2) + "\n", written)

    def _base_env(self, layout: RunLayout) -> dict[str, str]:
        env = dict(BASE_ENV)
        env["HOME"] = layout.home_inside
        env["TMPDIR"] = "/tmp"
        return env


def check_count(option: str, value: Any, *, low: int = 1, high: int | None = None, unset: bool = False) -> None:
    """Raise a `ValueError` naming `option` unless `value` is an integer (not a bool) in [low, high]
    (None as well where `unset`): an adapter's check of a count option, e.g. a token limit."""
    if unset and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"at least {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{option} must be an integer {bound}{' or None' if unset else ''}, got {value!r}")


def json_value(text: str) -> Any:
    """`text` as JSON, or None where it is not JSON (cut short, say) or is nested too deep to parse:
    a harness's output is read for what it says, never trusted to parse."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def json_lines(text: str) -> list[Any]:
    """The values of the lines of `text` that are JSON, in order (a headless harness's event stream)."""
    return [value for value in map(json_value, text.splitlines()) if value is not None]


def reason_text(kind: Any, detail: Any) -> str | None:
    """``kind: detail`` from a harness's failure report, leaving out a part that is not a non-empty
    string; None where neither is."""
    parts = [part for part in (kind, detail) if isinstance(part, str) and part]
    return ": ".join(parts) or None


def reached_without_links(home: Path, path: Path, kind: int = stat.S_IFREG) -> bool:
    """Whether `path` is a file (`kind`: or a folder, ``stat.S_IFDIR``) below `home` that no link on
    the way leads to (each step lstat'ed). What a sandbox left in its HOME is read on the host only so:
    a link it planted there (``~/.claude/projects -> /``, ``~/mini.traj.json -> /root/.ssh/id_ed25519``)
    must not make the host read, walk or copy its own files."""
    try:
        parts = Path(path).relative_to(home).parts
    except ValueError:
        return False
    current, mode = Path(home), None
    for part in parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except OSError:
            return False
        if stat.S_ISLNK(mode):
            return False
    return mode is not None and stat.S_IFMT(mode) == kind


def copy_artifacts(paths: list[Path], root: Path, dest: Path) -> list[Path]:
    """Copy `paths` (files below `root`, reached through no link: `reached_without_links`) to `dest`,
    keeping their path relative to `root`; others are skipped. Checked here, where the host reads,
    though the built-in adapters list only such files (`glob_files`): `Harness.artifacts` may be a
    user's adapter, and the sandbox's processes may still run while its files are listed."""
    copied = []
    for path in paths:
        if not reached_without_links(root, path):
            continue
        target = Path(dest) / Path(path).relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target, follow_symlinks=False)
        copied.append(target)
    return copied


def glob_files(home: Path, folder: str, pattern: str) -> list[Path]:
    """Files under ``home / folder`` matching `pattern`, sorted, each reached through no link
    (`reached_without_links`: a linked folder is neither walked nor read)."""
    root = Path(home) / folder
    if not reached_without_links(home, root, stat.S_IFDIR):
        return []
    return sorted(p for p in root.glob(pattern) if reached_without_links(home, p))
