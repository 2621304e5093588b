"""`clawfast harness ...` through the real CLI dispatcher."""

from __future__ import annotations

import json

import pytest

from clawfast.cli import main
from clawfast.harness import HARNESSES


def test_list_prints_every_harness_with_its_pin_and_options(capsys):
    assert main(["harness", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out] == [[n, HARNESSES[n].version] for n in sorted(HARNESSES)]
    assert [line.split("options: ")[1] for line in out] == [", ".join(HARNESSES[n].own_options()) or "-"
                                                            for n in sorted(HARNESSES)]


def test_check_option_reaches_the_harness(tmp_path, capsys):
    """``--option`` sets one of the harness's own options, its value read as TOML: mini-swe-agent's
    first user message is the template given."""
    code = main(["harness", "check", "mini-swe-agent", "--backend", "local", "--task", "files-create-0",
                 "--logs", str(tmp_path), "--option", "instance_template = 'Do this: {{task}}'"])
    assert code == 0, capsys.readouterr().out
    [trajectory] = tmp_path.glob("*/home/mini.traj.json")
    first_user = next(m for m in json.loads(trajectory.read_text())["messages"] if m["role"] == "user")
    assert first_user["content"].startswith("Do this: ")


@pytest.mark.parametrize("option, error", [
    ("foo=1", "harness 'mini-swe-agent' has no option(s) ['foo']; its options: ['instance_template']"),
    ("instance_template=3", "instance_template must be a string, got int"),
    ("instance_template=no task", "instance_template must contain {{task}}"),
    ("instance_template", "--option 'instance_template': expected KEY=VALUE"),
])  # fmt: skip
def test_check_refuses_a_bad_option_before_running(option, error, capsys):
    assert main(["harness", "check", "mini-swe-agent", "--option", option]) == 2
    assert error in capsys.readouterr().err


def test_check_rejects_unknown_task_and_harness(capsys):
    assert main(["harness", "check", "mini-swe-agent", "--task", "no-such-task"]) == 2
    assert "no task 'no-such-task'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        main(["harness", "check", "aider"])


def test_check_local_backend_prints_the_rollout(tmp_path, capsys):
    # --backend local: harness and verifier run without isolation (debugging).
    code = main(["harness", "check", "mini-swe-agent", "--backend", "local", "--task", "files-create-0",
                 "--logs", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "status    ok   reward 1.0" in out and "check passed" in out
    assert "calls     2 captured (2 scripted turns); tags main 2" in out
    assert "prefix    1/1 consecutive main calls extend the previous prompt + output exactly" in out
