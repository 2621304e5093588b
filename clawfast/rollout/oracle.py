"""The scripted engine's oracle: each prompt answered with the next oracle command of its task, as the
harness whose shell tool the prompt declares would call it. The cold start and `clawfast harness
check` run harnesses on it (`RolloutService(engine="oracle", oracle_tasks=...)`).

The engine picks each answer from the prompt alone: the task whose instruction it contains, and turn
n once n tool results are in it (the chat template, `clawfast.chat_template`, wraps each in
``<tool_response>``: counted in the decoded text, so a tokenizer that has no special token for the
marker counts the same). So a side call the harness makes (a title, a quota probe) never shifts the script,
and concurrent rollouts of several tasks and harnesses can share one engine. What is fake is only
the choice of the output text; tokenizer, template, protocol fronts, harness, sandbox and verifier
are the real ones.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from clawfast.harness.base import Harness
from clawfast.tasks.task import Task

FINAL_TEXT = "Done: the task is complete."


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
        done = text.count("<tool_response>")
        return entries[min(done, len(entries) - 1)]
