"""Helpers for tests/harness/test_side_calls.py: run a real harness against the real proxy with a
scripted engine whose responder labels every call it answers (the ground truth), and read that
traffic back per call_index.

The ground truth never comes from a classifier: each scenario's `decide(text)` looks at the decoded
prompt for text the scenario itself planted (its task marker, the subagent prompt it sent, the summary
it wrote) or for the harness's own compaction instruction, and returns ``(label, entry)``: what the
call is and what to answer. Labels are `clawfast.threads` kinds; ``"unexpected"`` marks a call no rule
of the scenario recognised (the tests fail on it, showing the prompt, so a new side call of a new
harness version gets a rule instead of a guess).

Records are appended in the order the proxy *completes* calls, which for concurrent calls need not be
the order the engine was asked; labels are therefore matched to records by their prompt ids, not by
position (`Traffic.engine_order` says how the two orders relate).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from clawfast.records import CallRecord, RolloutResult, write_rollout

SIDE_KINDS = ("subagent", "compaction", "title", "summary", "quota", "other-side")
KINDS = ("main",) + SIDE_KINDS
UNEXPECTED = "unexpected"

# Set to a folder (e.g. /tmp/sidecalls) to also write each scenario's rollout and labels there, as
# <folder>/<harness>-<scenario>/{rollout.cfr,labels.json}; unset, nothing is written outside tmp_path.
DUMP_ENV = "CLAWFAST_SIDECALLS_DIR"

Decide = Callable[[str], tuple[str, Any]]


# -- reading a decoded prompt (the embedded model's Qwen-style template) ---------------------------


def turns(text: str) -> list[tuple[str, str]]:
    """(role, content) of each turn of a decoded prompt, the open generation turn included. A tool
    result is a ``user`` turn whose content starts with ``<tool_response>`` (the template's form)."""
    out = []
    for chunk in text.split("<|im_start|>")[1:]:
        role, _, content = chunk.partition("\n")
        out.append((role, content.removesuffix("\n").removesuffix("<|im_end|>")))
    return out


def user_texts(text: str) -> list[str]:
    """Contents of the user turns that are not tool results, in order."""
    return [c for role, c in turns(text) if role == "user" and not c.startswith("<tool_response>")]


def system_text(text: str) -> str:
    """The leading system turn's own text (before the template's tool block, if any)."""
    ts = turns(text)
    if not ts or ts[0][0] != "system":
        return ""
    return ts[0][1].split("# Tools\n", 1)[0]


def tool_names(text: str) -> list[str]:
    """Names of the tools the template listed in the prompt's header."""
    # The block is "<tools>\n" + one JSON line per tool + "</tools>" (the template's preface also
    # says "<tools></tools>", inline).
    start = text.find("\n<tools>\n")
    end = text.find("\n</tools>\n", start)
    if start < 0 or end < 0:
        return []
    names = []
    for line in text[start:end].split("\n"):
        if line.startswith('{"type": "function"'):
            names.append(json.loads(line)["function"]["name"])
    return names


def tool_results(text: str) -> int:
    return text.count("<tool_response>")


def tool_call(name: str, arguments: dict, text: str = "") -> dict:
    return {"text": text, "tool_calls": [{"name": name, "arguments": arguments}]}


# -- token-level facts of the recorded calls (independent of any classifier) -----------------------


def path_of(call: CallRecord) -> np.ndarray:
    return np.concatenate([call.prompt_ids, call.output_ids])


def continues(earlier: CallRecord, later: CallRecord) -> bool:
    """`later`'s prompt begins with `earlier`'s prompt + output, token for token (and is longer)."""
    path = path_of(earlier)
    return len(path) < len(later.prompt_ids) and np.array_equal(later.prompt_ids[: len(path)], path)


def extends(calls: list[CallRecord], i: int) -> int | None:
    """The latest call j < i whose prompt + output is a prefix of call i's prompt, or None."""
    return next((j for j in range(i - 1, -1, -1) if continues(calls[j], calls[i])), None)


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


# -- one run ---------------------------------------------------------------------------------------


class LabellingResponder:
    """The scripted engine's responder: answers each prompt with `decide(decoded prompt)` and keeps,
    in the order the engine asked, the prompt ids, the label and the decoded text."""

    def __init__(self, renderer, decide: Decide) -> None:
        self.renderer = renderer
        self.decide = decide
        self.asked: list[tuple[np.ndarray, str, str]] = []

    def __call__(self, prompt_ids: np.ndarray):
        text = self.renderer.decode(prompt_ids)
        label, entry = self.decide(text)
        self.asked.append((np.array(prompt_ids, dtype=np.int32), label, text))
        return entry


@dataclass
class Traffic:
    """One rollout of one scenario. Everything is indexed by call_index: `labels` (ground truth),
    `prompts` / `outputs` (decoded), `engine_order` (position of that call among the engine's
    answers), `extends` (token-level: which earlier call's prompt + output this prompt begins with)."""

    harness: str
    scenario: str
    result: RolloutResult
    labels: list[str]
    prompts: list[str]
    outputs: list[str]
    engine_order: list[int]
    extends: list[int | None]
    returncode: int
    stdout: str
    stderr: str
    workspace: Path
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def calls(self) -> list[CallRecord]:
        return self.result.calls

    def indices(self, label: str) -> list[int]:
        return [i for i, lab in enumerate(self.labels) if lab == label]

    def headers(self, i: int) -> dict[str, str]:
        return self.calls[i].metadata.get("headers", {})

    def relabelled(self) -> list[CallRecord]:
        """Copies of the calls tagged with their ground-truth label instead of the proxy's tag."""
        return [dataclasses.replace(c, tags=(label,)) for c, label in zip(self.calls, self.labels)]

    def report(self) -> str:
        """One line per call (for assertion messages), then the harness's exit and output tails."""
        lines = [f"{self.harness} / {self.scenario}: {len(self.calls)} calls, exit {self.returncode}"]
        for i, c in enumerate(self.calls):
            hdr = {k: v for k, v in self.headers(i).items() if k.startswith("x-claude-code")}
            lines.append(
                f"  call {i}: truth {self.labels[i]:<10} proxy tag {'/'.join(c.tags):<10} engine #{self.engine_order[i]} "
                f"prompt {len(c.prompt_ids)} tok extends {self.extends[i]} drift {c.metadata.get('drift')} "
                f"tools {c.metadata.get('tool_calls')} {hdr or ''} out {self.outputs[i][:60]!r}"
            )
        lines.append(f"stdout tail: {self.stdout[-1500:]}")
        lines.append(f"stderr tail: {self.stderr[-1500:]}")
        return "\n".join(lines)

    def dump(self, root: str | os.PathLike) -> Path:
        """Write rollout.cfr and labels.json under root/<harness>-<scenario>/ and return that folder."""
        folder = Path(root) / f"{self.harness}-{self.scenario}"
        folder.mkdir(parents=True, exist_ok=True)
        write_rollout(folder / "rollout.cfr", self.result)
        calls = []
        for i, c in enumerate(self.calls):
            calls.append({
                "call_index": i,
                "label": self.labels[i],
                "engine_order": self.engine_order[i],
                "extends": self.extends[i],  # token-level prefix, computed here, not by a classifier
                "proxy_tag": list(c.tags),
                "proxy_tag_reason": c.metadata.get("tag_reason"),
                "headers": self.headers(i),
                "prompt_tokens": len(c.prompt_ids),
                "output_text": self.outputs[i],
            })  # fmt: skip
        doc = {
            "harness": self.harness,
            "scenario": self.scenario,
            "rollout_id": self.result.rollout_id,
            "labels": {str(i): lab for i, lab in enumerate(self.labels)},
            "calls": calls,
            "notes": self.notes,
        }
        (folder / "labels.json").write_text(json.dumps(doc, indent=2) + "\n")
        return folder


def run_scenario(
    renderer,
    tmp: Path,
    *,
    harness: str,
    scenario: str,
    instruction: str,
    decide: Decide,
    harness_options: dict | None = None,
    workspace_files: dict[str, str] | None = None,
    timeout_s: float = 300.0,
    max_model_len: int | None = None,
    notes: dict[str, Any] | None = None,
) -> Traffic:
    """Run `harness` once on `instruction` through the real proxy (HTTP, in this process) with the
    scripted engine answering by `decide`, and return the labelled traffic.

    The harness is configured by its own adapter (`prepare`, `command`) and run as a plain subprocess
    in `tmp/ws` with HOME `tmp/home` (no sandbox: the traffic, not the isolation, is under test),
    built with `harness_options` (its own options, e.g. compaction thresholds); `max_model_len`: the
    context the proxy serves (None: unchecked)."""
    from clawfast.engines.scripted import ScriptedEngine
    from clawfast.harness import get_harness
    from clawfast.harness.base import RunLayout
    from clawfast.proxy import ProxyApp, ProxyConfig, ProxyCore, ProxyServer, RolloutRegistry

    workspace, home = tmp / "ws", tmp / "home"
    workspace.mkdir(parents=True)
    home.mkdir(parents=True)
    for name, content in (workspace_files or {}).items():
        (workspace / name).write_text(content)
    layout = RunLayout(home, workspace)
    adapter = get_harness(harness, timeout_s=timeout_s, **(harness_options or {}))
    responder = LabellingResponder(renderer, decide)
    engine = ScriptedEngine(renderer.encode, renderer.turn_end_id, responder=responder)
    registry = RolloutRegistry(tmp / "records")
    app = ProxyApp(ProxyCore(engine, renderer, ProxyConfig(keepalive_s=1.0, max_model_len=max_model_len)), registry)
    with ProxyServer(app):
        opened = registry.open(f"{harness}-{scenario}", task_id=scenario, harness=harness)
        prepared = adapter.prepare(layout, opened.base_url, opened.key, "policy")
        # The exit status is part of the traffic (the tests assert on it), so no check=True.
        proc = subprocess.run(adapter.command(instruction, layout), cwd=workspace, env=prepared.env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout_s, check=False)  # fmt: skip
        result = registry.close(opened.rollout_id, reward=1.0 if proc.returncode == 0 else 0.0)

    # Every call the engine answered is recorded, and each record is one of those answers.
    if len(result.calls) != engine.calls or len(responder.asked) != engine.calls:
        raise AssertionError(f"{engine.calls} engine calls, {len(responder.asked)} answers, {len(result.calls)} records")
    unused = list(range(len(responder.asked)))
    labels, engine_order = [], []
    for call in result.calls:
        k = next((k for k in unused if np.array_equal(responder.asked[k][0], call.prompt_ids)), None)
        if k is None:
            raise AssertionError(f"record {call.call_index} has a prompt the engine was never asked")
        unused.remove(k)
        labels.append(responder.asked[k][1])
        engine_order.append(k)
    calls = result.calls
    return Traffic(
        harness=harness,
        scenario=scenario,
        result=result,
        labels=labels,
        prompts=[renderer.decode(c.prompt_ids) for c in calls],
        outputs=[renderer.decode(c.output_ids) for c in calls],
        engine_order=engine_order,
        extends=[extends(calls, i) for i in range(len(calls))],
        returncode=proc.returncode,
        stdout=proc.stdout,
        stderr=proc.stderr,
        workspace=workspace,
        notes=notes or {},
    )


def maybe_dump(traffic: Traffic) -> None:
    """Write the scenario's rollout and labels under $CLAWFAST_SIDECALLS_DIR when it is set."""
    root = os.environ.get(DUMP_ENV)
    if root:
        traffic.dump(root)
