"""`clawfast harness ...` through the real CLI dispatcher."""

from __future__ import annotations

import pytest

from clawfast.cli import main
from clawfast.harness import HARNESSES


def test_list_prints_every_harness_with_its_pin(capsys):
    assert main(["harness", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out] == [[n, HARNESSES[n].version] for n in sorted(HARNESSES)]


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
