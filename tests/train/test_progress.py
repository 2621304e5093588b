"""The run's progress view: nested phase counters with an ETA from the pace so far, and one line per
phase and per step when it is not drawn live (a CI log)."""

from __future__ import annotations

import re

from clawfast.train.progress import Phase, ProgressView, clock


def test_counter_eta_follows_the_mean_pace():
    c = Phase("eval", 16, "rollouts")
    assert c.eta_s() is None  # nothing done: no pace yet
    c.started -= 30.0
    c.done = 4
    assert abs(c.eta_s() - 90.0) < 1.0  # 7.5 s each, 12 left
    c.note = "solved 1"
    assert re.fullmatch(r"eval: 4/16 rollouts \[##\.{6}\]  0:3\d elapsed, ETA 1:3\d  solved 1", c.line(bar_width=8))
    c.done = 16
    assert c.eta_s() is None and "ETA" not in c.line()
    assert clock(3725) == "62:05"


def test_not_live_prints_one_line_per_phase_and_step(capsys):
    view = ProgressView(3, live=False).start()
    view.begin("GRPO steps", 3, "steps")
    view.advance(0, note="step 1: rollouts 5/8")
    view.begin("eval at step 1", 4, "rollouts")  # an eval inside the steps
    for _ in range(4):
        view.advance(note="solved 2")
    view.end()
    assert view.counters[-1].name == "GRPO steps"  # back to the outer phase
    view.advance(note="step 1: reward 0.500")
    view.add_step({"step": 1}, "step 1: pass@1 0.500")
    view.end()
    view.stop()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3, out
    assert out[0].startswith("eval at step 1: 4/4 rollouts  0:00 elapsed  solved 2")
    assert out[1] == "step 1: pass@1 0.500"
    assert out[2].startswith("GRPO steps: 1/3 steps  0:00 elapsed, ETA") and out[2].endswith("step 1: reward 0.500")
    assert not view.counters
