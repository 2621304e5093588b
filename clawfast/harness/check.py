"""End-to-end check of one real harness: proxy + sandbox + verifier, with the scripted engine replaying
a task's oracle through the harness's own shell tool.

`check_harness("mini-swe-agent")` installs the harness (cache), builds the embedded tokenizer, starts
the real proxy (HTTP, in this process) on a `ScriptedEngine`, runs one clawbench-mini task through
`RolloutWorker` (a fresh sandbox, the verifier in another) and returns a `CheckReport`: status, reward,
the captured calls and their tags, and whether consecutive main-thread calls share an exact token
prefix (call i+1's prompt starts with call i's prompt and output: what training needs).

The engine picks each answer from the prompt alone (`OracleResponder`): the task whose instruction it
contains, and turn n once n tool results are in it (the embedded template wraps each in one
``<tool_response>`` special token). So a side call the harness makes (a title, a quota probe) never
shifts the script, and concurrent rollouts of several tasks can share one engine.
What is fake here is only the choice of the output text; tokenizer, template, protocol fronts,
harness, sandbox and verifier are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from clawfast.harness import get_harness
from clawfast.harness.base import Harness
from clawfast.records import CallRecord, RolloutResult
from clawfast.rollout.worker import RolloutConfig, RolloutSpec, RolloutWorker
from clawfast.tasks.task import Task

DEFAULT_TASK = "files-lines-0"  # two oracle commands, one a heredoc: newlines through tool-call JSON
FINAL_TEXT = "Done: the task is complete."


@dataclass(frozen=True)
class PairContinuity:
    """Two consecutive main-thread calls a -> b. shared: tokens of a's path (prompt + output) that
    begin b's prompt. path: len(a's path). output_kept: a's sampled tokens appear verbatim in b's
    prompt (token in, token out), even where the harness moved other context around them."""

    first: int
    second: int
    shared: int
    path: int
    output_kept: bool

    @property
    def exact(self) -> bool:
        return self.shared == self.path


@dataclass
class CheckReport:
    """harness / task_id: what ran. result: the rollout (status, reward, calls, info).
    pairs: continuity of consecutive main-thread calls (see `PairContinuity`). turns_scripted: how
    many answers the script had. `ok`: the rollout is ok with reward 1.0 and every sampled output
    reappears verbatim in the next prompt (an exact prefix is reported, not required: OpenClaw, for
    one, moves its runtime-context message behind each new turn, which edits its own history)."""

    harness: str
    task_id: str
    result: RolloutResult
    turns_scripted: int
    pairs: list[PairContinuity] = field(default_factory=list)
    tags: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        r = self.result
        return r.status == "ok" and r.reward == 1.0 and all(p.output_kept for p in self.pairs)

    def lines(self) -> list[str]:
        r = self.result
        out = [
            f"harness   {self.harness}   task {self.task_id}   rollout {r.rollout_id}",
            f"status    {r.status}   reward {r.reward}",
            f"calls     {len(r.calls)} captured ({self.turns_scripted} scripted turns); tags "
            + ", ".join(f"{k} {v}" for k, v in sorted(self.tags.items())),
        ]
        for c in r.calls:
            out.append(
                f"  call {c.call_index}: {'/'.join(c.tags)} {c.metadata.get('protocol', '')} "
                f"prompt {len(c.prompt_ids)} tok, output {len(c.output_ids)} tok, finish {c.finish_reason}"
            )
        exact = sum(p.exact for p in self.pairs)
        kept = sum(p.output_kept for p in self.pairs)
        out.append(f"prefix    {exact}/{len(self.pairs)} consecutive main calls extend the previous prompt + output "
                   f"exactly; {kept}/{len(self.pairs)} keep the previous output tokens verbatim")
        for p in self.pairs:
            if not p.exact:
                out.append(f"  call {p.first} -> {p.second}: shares {p.shared} of {p.path} tokens "
                           f"(the harness changed the last {p.path - p.shared})")
        timings = r.info.get("timings", {})
        out.append("timings   " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
        for key in ("error", "stderr_tail", "logs"):
            if r.info.get(key):
                out.append(f"{key:<9} {str(r.info[key]).strip()[-1500:]}")
        if r.info.get("verifier"):
            v = r.info["verifier"]
            out.append(f"verifier  {v.get('status')} score {v.get('score')} {v.get('error') or ''}".rstrip())
        return out


def _contains(haystack: np.ndarray, needle: np.ndarray) -> bool:
    if len(needle) == 0:
        return True
    data, pattern = haystack.astype("<i4").tobytes(), needle.astype("<i4").tobytes()
    start = data.find(pattern)
    while start != -1 and start % 4:  # only matches aligned on token boundaries count
        start = data.find(pattern, start + 1)
    return start != -1


def continuity(calls: list[CallRecord]) -> list[PairContinuity]:
    """Continuity of each pair of consecutive main-thread (non-excluded) calls, in call order."""
    main = sorted((c for c in calls if not c.excluded), key=lambda c: c.call_index)
    pairs = []
    for a, b in zip(main, main[1:]):
        path = np.concatenate([a.prompt_ids, a.output_ids])
        n = min(len(path), len(b.prompt_ids))
        differ = np.flatnonzero(path[:n] != b.prompt_ids[:n])
        shared = int(differ[0]) if len(differ) else n
        pairs.append(PairContinuity(a.call_index, b.call_index, shared, len(path), _contains(b.prompt_ids, a.output_ids)))
    return pairs


def check_task(task_id: str = DEFAULT_TASK) -> Task:
    from clawfast.tasks import clawbench_mini

    for task in clawbench_mini():
        if task.id == task_id:
            return task
    raise ValueError(f"clawbench-mini has no task {task_id!r}")


class OracleResponder:
    """The scripted engine's answer for each prompt: the oracle turns of the task whose instruction
    the prompt contains (the longest match), as the harness whose shell tool the prompt declares
    would run them, turn n once n tool results are in the prompt. Stateless, so any number of
    concurrent rollouts of several tasks and harnesses can share one engine."""

    def __init__(
        self, renderer, harnesses: Harness | Sequence[Harness], tasks: Sequence[Task], final_text: str = FINAL_TEXT
    ) -> None:
        """harnesses: one adapter, or several sharing the engine; tasks: those whose oracles it plays."""
        if isinstance(harnesses, Harness):
            harnesses = [harnesses]
        if not harnesses:
            raise ValueError("at least one harness is needed")
        self.renderer = renderer
        self.tool_response = renderer.tokenizer.convert_tokens_to_ids("<tool_response>")
        # Each harness is told apart by its shell tool's name in the prompt's tool list (Bash,
        # exec, exec_command, bash: distinct as quoted JSON names).
        self.signatures = {h.name: f'"name": "{h.scripted_turns(["true"], "")[0].tool_calls[0].name}"' for h in harnesses}
        self.entries = {
            (h.name, task.instruction): [t.to_entry() for t in h.scripted_turns(list(task.oracle), final_text)]
            for h in harnesses
            for task in tasks
        }
        # Longest first, so an instruction that is a prefix of another never wins by accident.
        self._instructions = sorted({task.instruction for task in tasks}, key=len, reverse=True)

    def __call__(self, prompt_ids: np.ndarray) -> dict:
        text = self.renderer.decode(prompt_ids)
        names = [name for name, sig in self.signatures.items() if sig in text] or list(self.signatures)
        instruction = next((i for i in self._instructions if i in text), None)
        if len(names) != 1 or instruction is None:
            # A prompt of no known task (a side call) or of no single known harness: a plain answer.
            return {"text": FINAL_TEXT}
        entries = self.entries[(names[0], instruction)]
        done = int(np.count_nonzero(prompt_ids == self.tool_response))
        return entries[min(done, len(entries) - 1)]


@contextlib.contextmanager
def scripted_proxy(
    harnesses: Sequence[Harness], tasks: Sequence[Task], records_dir: Path, config=None
) -> Iterator[tuple[object, object]]:
    """The real proxy (HTTP, on a free loopback port, in this process) on a `ScriptedEngine` that
    plays `tasks`' oracles through each of `harnesses`' tools. `config`: a `ProxyConfig` (default:
    the defaults). Yields (server, registry)."""
    from transformers import AutoTokenizer

    from clawfast.embedded import ensure_embedded_model
    from clawfast.engines.scripted import ScriptedEngine
    from clawfast.proxy.core import ProxyConfig, ProxyCore
    from clawfast.proxy.render import ChatRenderer
    from clawfast.proxy.rollouts import RolloutRegistry
    from clawfast.proxy.server import ProxyApp, ProxyServer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(ensure_embedded_model()))
    engine = ScriptedEngine(renderer.encode, renderer.turn_end_id, responder=OracleResponder(renderer, harnesses, tasks))
    registry = RolloutRegistry(records_dir)
    app = ProxyApp(ProxyCore(engine, renderer, config or ProxyConfig()), registry, model_name="policy")
    with ProxyServer(app) as server:
        yield server, registry


def check_harness(
    name: str,
    *,
    backend: str = "bwrap",
    task: Task | None = None,
    timeout_s: float = 300.0,
    logs_dir: Path | None = None,
) -> CheckReport:
    """Run `task` (default: clawbench-mini's `DEFAULT_TASK`) once through harness `name` with its
    oracle scripted; see the module docstring. `backend`: ``bwrap`` (default) or ``local``."""
    from clawfast.sandbox import create_backend
    from clawfast.tasks.sandbox_runner import SandboxRunner

    task = task or check_task()
    harness = get_harness(name, timeout_s=timeout_s, max_steps=2 * len(task.oracle) + 4)
    harness.installation  # install (or find) the pinned version before any clock starts
    turns = len(harness.scripted_turns(list(task.oracle), FINAL_TEXT))
    with tempfile.TemporaryDirectory(prefix="clawfast-check-") as tmp:
        sandboxes = create_backend(backend, **({"allow_unsafe": True} if backend == "local" else {}))
        try:
            with scripted_proxy([harness], [task], Path(tmp) / "records") as (_, registry), \
                    SandboxRunner(sandboxes) as verifier_runner:
                worker = RolloutWorker(
                    registry, sandboxes, {name: harness},
                    config=RolloutConfig(model="policy", timeout_s=timeout_s, logs_dir=logs_dir or Path(tmp) / "logs"),
                    verifier_runner=verifier_runner,
                )  # fmt: skip
                result = asyncio.run(worker.run(RolloutSpec(task, name, 0)))
        finally:
            sandboxes.close()
    tags = Counter(tag for c in result.calls for tag in c.tags)
    return CheckReport(name, task.id, result, turns, continuity(result.calls), tags)
