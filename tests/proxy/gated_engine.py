"""Scripted engines for proxy tests: a slow one, for what happens while a call generates (keep-alives,
disconnects, closes), and one that keeps what reached it."""

from __future__ import annotations

import asyncio
import threading
import time

from clawfast.engines.scripted import ScriptedEngine


class GatedScriptedEngine(ScriptedEngine):
    """The scripted engine, holding each answer until the test opens `gate` (a slow engine)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.cancelled = 0

    async def generate(self, prompt_ids, params):
        self.started.set()
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return await super().generate(prompt_ids, params)


def wait_for(predicate, timeout=10.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


class RecordingEngine(ScriptedEngine):
    """The scripted engine, keeping the `SamplingParams` of every call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.params = []

    async def generate(self, prompt_ids, params):
        self.params.append(params)
        return await super().generate(prompt_ids, params)
