"""Suite lookup: a built-in suite by name, a ClawGym-format folder (``clawgym:PATH``), a PinchBench
suite (``pinchbench:PATH``), or a directory of the user's own task.toml folders."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from clawfast.tasks.clawgym import PREFIX as CLAWGYM, load_clawgym
from clawfast.tasks.mini import SUITE_NAME as MINI, clawbench_mini
from clawfast.tasks.pinchbench import PREFIX as PINCHBENCH, load_pinchbench
from clawfast.tasks.task import SPLITS, Task
from clawfast.tasks.taskdir import load_task_dir

BUILTIN_SUITES: dict[str, Callable[[int], list[Task]]] = {MINI: clawbench_mini}


def load_suite(name_or_path: str | Path, split: str | None = None, *, seed: int = 0) -> list[Task]:
    """The tasks of a built-in suite (``clawbench-mini``, generated from `seed`), of a ClawGym-format
    folder (``clawgym:PATH[?eval=FRACTION]``, see `clawfast.tasks.clawgym`), of a PinchBench suite
    (``pinchbench:PATH[?eval=FRACTION][&exclude=ID,ID]``, see `clawfast.tasks.pinchbench`) or of a
    task.toml directory (see `load_task_dir`); the last three have no seed. Only those of `split` (``train`` or
    ``eval``) when it is given.

    A name that is both a built-in suite and an existing path means the built-in suite; write
    ``./clawbench-mini`` for the directory."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if str(name_or_path) in BUILTIN_SUITES:
        tasks = BUILTIN_SUITES[str(name_or_path)](seed)
    elif str(name_or_path).startswith(CLAWGYM):
        return load_clawgym(str(name_or_path), split)
    elif str(name_or_path).startswith(PINCHBENCH):
        return load_pinchbench(str(name_or_path), split)
    elif Path(name_or_path).is_dir():
        tasks = load_task_dir(name_or_path)
    else:
        raise ValueError(f"unknown suite {str(name_or_path)!r}: not one of {sorted(BUILTIN_SUITES)}, "
                         f"not {CLAWGYM}PATH, not {PINCHBENCH}PATH and not a directory")
    return [t for t in tasks if split is None or t.split == split]
