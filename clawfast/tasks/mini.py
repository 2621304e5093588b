"""clawbench-mini: 64 small procedurally generated agent tasks in four categories.

`clawbench_mini(seed=0)` returns the same tasks for the same seed, on any machine and Python version
(`random.Random` seeded with a string is stable). Each template draws from its own generator
(seeded with ``f"{seed}:{template}"``), so adding a template never changes the others' tasks.

| category | templates (instances)                                                            |
| -------- | -------------------------------------------------------------------------------- |
| files    | create (4), append (3), replace (3), delete-line (2), header (2), lines (2)      |
| code     | eight one-bug Python modules checked by a hidden copy of their unit tests (2 each) |
| data     | count (3), sum (3), csv-json (2), group-sum (2), filter (2), json-field (2), uniq (2) |
| shell    | chmod (3), rename (3), move (2), env (2), json-set (2), symlink (2), script (2)  |

Task ids are ``{category}-{template}-{k}`` and name a template slot, so they are the same for every
seed: a suite is one seed (do not mix seeds in one run). Difficulty tags: ``easy`` tasks are solved by one short
command the instruction nearly spells out (``echo hi > hello.txt``), so a tiny model trained briefly
on CPU can learn them; ``medium`` need one command with the right tool (sed, awk, mv, ln, chmod);
``hard`` need a small program or several steps.

Split: within each category, tasks sorted by (difficulty, sha256 of the id) and every fourth one,
starting with the first, is ``eval``: 16 eval and 48 train tasks, each difficulty represented in
both. It depends only on ids and difficulties, never on the seed's content. Argument values (the level a
count task counts, the column a sum reads) are drawn per instance, never paired with a slot: an eval
slot must not ask for a value that no training slot of any seed shows.

Every verifier is `checks.py` (shipped as a verifier file) with a JSON spec; all or nothing, so the
do-nothing solution scores 0. Every oracle is a list of bash commands (file writes by ``echo``,
``printf`` or heredoc) that a scripted engine can replay as tool calls through any harness.
"""

from __future__ import annotations

import hashlib
import json
import random
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from clawfast.tasks.task import CommandVerifier, Task

SUITE_NAME = "clawbench-mini"
CATEGORIES = ("files", "code", "data", "shell")
DIFFICULTIES = ("easy", "medium", "hard")
# -S: the checker needs only the standard library; skipping site (and its .pth hooks) made a whole
# verify 1.3x faster (median 0.119 s -> 0.091 s over the 64 tasks, bench/bench_tasks.py).
VERIFIER_COMMAND = 'python3 -S "$VERIFIER_DIR/checks.py" "$VERIFIER_DIR/spec.json"'
TASK_TIMEOUT = 300.0
VERIFIER_TIMEOUT = 20.0

WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "pearl", "ocean", "amber",
         "cedar", "delta", "ember", "frost", "grape", "honey", "ivory", "jolly", "koala", "lunar")
FILENAMES = ("hello.txt", "note.txt", "answer.txt", "out.txt", "greeting.txt", "word.txt", "result.txt")
NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy")
MODULES = ("mathx", "utils", "helpers", "calc", "tools", "mylib", "core", "funcs")
# Drawn per instance, never paired with a slot (module docstring); tests read them from here.
LOG_LEVELS = ("ERROR", "WARN", "INFO")
LINE_MARKERS = ("TODO", "FIXME")
SUM_COLUMNS = ("amount", "price", "points")
FILTER_COLUMNS = ("score", "grade")


@lru_cache(maxsize=1)
def _checks_source() -> bytes:
    return (Path(__file__).parent / "checks.py").read_bytes()


def _q(text: str) -> str:
    return shlex.quote(text)


def _write_cmd(path: str, content: str) -> str:
    """A bash command that writes `content` (ending in a newline) to `path` with a quoted heredoc."""
    if not content.endswith("\n") or "\nEOF\n" in "\n" + content:
        raise ValueError(f"cannot write {content!r} with an EOF heredoc")
    return f"cat > {_q(path)} <<'EOF'\n{content}EOF"


class _Builder:
    """Collects the tasks of one template."""

    def __init__(self, category: str, template: str, difficulty: str):
        self.category, self.template, self.difficulty = category, template, difficulty
        self.tasks: list[dict[str, Any]] = []

    def add(self, instruction: str, files: dict[str, str], checks: list[dict], oracle: list[str],
            verifier_files: dict[str, str] | None = None) -> None:
        self.tasks.append({
            "id": f"{self.category}-{self.template}-{len(self.tasks)}",
            "instruction": instruction,
            "files": files,
            "checks": checks,
            "oracle": oracle,
            "verifier_files": verifier_files or {},
            "category": self.category,
            "template": self.template,
            "difficulty": self.difficulty,
        })


# ----------------------------------------------------------------------------------------- files

def _files_create(rng: random.Random, b: _Builder) -> None:
    picks = rng.sample([(f, w) for f in FILENAMES for w in WORDS], 4)
    for fname, word in picks:
        b.add(f"Create {fname} containing exactly: {word}", {},
              [{"type": "text", "path": fname, "equals": word + "\n"}],
              [f"echo {word} > {fname}"])


def _files_append(rng: random.Random, b: _Builder) -> None:
    for fname in rng.sample(("notes.txt", "todo.txt", "list.txt", "log.txt"), 3):
        lines = rng.sample(WORDS, rng.randint(2, 4))
        new = f"{rng.choice(NAMES)} {rng.choice(WORDS)}"
        old = "".join(line + "\n" for line in lines)
        b.add(f"Append the line '{new}' to {fname}.", {fname: old},
              [{"type": "text", "path": fname, "equals": old + new + "\n"}],
              [f"echo {_q(new)} >> {fname}"])


def _files_replace(rng: random.Random, b: _Builder) -> None:
    for fname in rng.sample(("story.txt", "poem.txt", "draft.txt", "essay.txt"), 3):
        old_word, new_word, *fill = rng.sample(WORDS, 8)
        lines = []
        for _ in range(3):
            words = rng.sample(fill, 3) + [old_word]
            rng.shuffle(words)
            lines.append("the " + " ".join(words))
        before = "\n".join(lines) + "\n"
        after = before.replace(old_word, new_word)
        b.add(f"In {fname}, replace every '{old_word}' with '{new_word}'.", {fname: before},
              [{"type": "text", "path": fname, "equals": after}],
              [f"sed -i 's/{old_word}/{new_word}/g' {fname}"])


def _files_delete_line(rng: random.Random, b: _Builder) -> None:
    for fname in rng.sample(("items.txt", "tasks.txt", "plan.txt"), 2):
        marker = rng.choice(LINE_MARKERS)
        words = rng.sample(WORDS, 5)
        at = rng.randrange(1, 4)
        lines = words[:at] + [f"{marker} {words[at]}"] + words[at + 1:]
        before = "".join(line + "\n" for line in lines)
        after = "".join(line + "\n" for line in lines if marker not in line)
        b.add(f"Delete the line containing {marker} from {fname}.", {fname: before},
              [{"type": "text", "path": fname, "equals": after}],
              [f"sed -i '/{marker}/d' {fname}"])


def _files_header(rng: random.Random, b: _Builder) -> None:
    for fname in rng.sample(("README.md", "notes.md", "guide.md"), 2):
        header = f"# {rng.choice(WORDS).capitalize()}"
        body = "".join(f"{w}\n" for w in rng.sample(WORDS, 3))
        b.add(f"Add the line '{header}' at the top of {fname}.", {fname: body},
              [{"type": "text", "path": fname, "equals": header + "\n" + body}],
              [f"sed -i '1i {header}' {fname}"])


def _files_lines(rng: random.Random, b: _Builder) -> None:
    for folder in rng.sample(("docs", "data", "notes"), 2):
        fname = rng.choice(("a.txt", "b.txt", "c.txt"))
        words = rng.sample(WORDS, 3)
        content = "".join(w + "\n" for w in words)
        b.add(f"Create {folder}/{fname} with the lines {words[0]}, {words[1]} and {words[2]}, one per line.",
              {}, [{"type": "text", "path": f"{folder}/{fname}", "equals": content}],
              [f"mkdir -p {folder}", _write_cmd(f"{folder}/{fname}", content)])


# ------------------------------------------------------------------------------------------ code

def _code_cases(rng: random.Random, fn: str) -> tuple[str, str, str, str, list[str]]:
    """One instance of bug `fn`: (buggy source, oracle sed expression, requirement, signature,
    assert lines). Every instance's asserts fail on the buggy source."""
    k = rng.randint(2, 9)
    if fn == "area":
        return ("def area(w, h):\n    return w + h\n", "s/w + h/w * h/",
                "it must return w times h", "area(w, h)",
                ["assert area(3, 4) == 12", f"assert area({k}, {k + 3}) == {k * (k + 3)}"])
    if fn == "total":
        return ("def total(n):\n    return sum(range(n))\n", "s/range(n)/range(1, n + 1)/",
                "it must return 1 + 2 + ... + n", "total(n)",
                ["assert total(1) == 1", f"assert total({k}) == {k * (k + 1) // 2}"])
    if fn == "is_adult":
        limit = rng.randint(16, 21)
        return (f"def is_adult(age):\n    return age > {limit}\n", "s/age > /age >= /",
                f"it must be True when age >= {limit}", "is_adult(age)",
                [f"assert is_adult({limit})", f"assert not is_adult({limit - 1})",
                 f"assert is_adult({limit + k})"])
    if fn == "shout":
        word = rng.choice(WORDS)
        return ('def shout(s):\n    return s.lower() + "!"\n', "s/s.lower()/s.upper()/",
                "it must return s in upper case followed by '!'", "shout(s)",
                [f'assert shout("{word}") == "{word.upper()}!"', 'assert shout("Hi") == "HI!"'])
    if fn == "largest":
        xs = rng.sample(range(1, 50), 4)
        return ("def largest(xs):\n    return min(xs)\n", "s/min(xs)/max(xs)/",
                "it must return the largest element", "largest(xs)",
                [f"assert largest({xs}) == {max(xs)}", "assert largest([7]) == 7"])
    if fn == "scale":
        return (f"def scale(x):\n    x * {k}\n", f"s/    x \\* {k}/    return x * {k}/",
                f"it must return x times {k}", "scale(x)",
                [f"assert scale(3) == {3 * k}", "assert scale(0) == 0"])
    if fn == "first":
        xs = rng.sample(range(1, 50), 3)
        return ("def first(xs):\n    return xs[-1]\n", "s/xs\\[-1\\]/xs[0]/",
                "it must return the first element", "first(xs)",
                [f"assert first({xs}) == {xs[0]}", "assert first(['a', 'b']) == 'a'"])
    if fn == "count_vowels":
        word = rng.choice(WORDS)
        n = sum(c in "aeiou" for c in word)
        return ('def count_vowels(s):\n    return sum(c in "aeiou" for c in s)\n',
                "s/for c in s)/for c in s.lower())/", "it must also count upper-case vowels",
                "count_vowels(s)",
                [f'assert count_vowels("{word.upper()}") == {n}', 'assert count_vowels("bOAt") == 2'])
    raise ValueError(fn)


# Lets the agent run the visible copy with `python3 test_x.py` (the verifier runs its hidden copy).
_TEST_MAIN = """if __name__ == "__main__":
    for _name, _fn in sorted(globals().items()):
        if _name.startswith("test_"):
            _fn()
    print("all tests passed")
"""

CODE_FUNCTIONS = ("area", "total", "is_adult", "shout", "largest", "scale", "first", "count_vowels")


def _code_template(fn: str) -> Callable[[random.Random, _Builder], None]:
    def build(rng: random.Random, b: _Builder) -> None:
        for module in rng.sample(MODULES, 2):
            source, sed, requirement, signature, asserts = _code_cases(rng, fn)
            tests = f"from {module} import {fn}\n\n\n" + "".join(
                f"def test_{i}():\n    {line}\n\n\n" for i, line in enumerate(asserts)) + _TEST_MAIN
            test_file = f"test_{module}.py"
            b.add(f"Fix {signature} in {module}.py: {requirement}.",
                  {f"{module}.py": source, test_file: tests},
                  [{"type": "python_tests", "file": test_file}],
                  [f"sed -i {_q(sed)} {module}.py"],
                  verifier_files={test_file: tests})
    return build


# ------------------------------------------------------------------------------------------ data

def _log_lines(rng: random.Random, n: int) -> list[str]:
    levels = ("INFO", "WARN", "ERROR")
    return [f"{rng.choice(levels)} {rng.choice(WORDS)} {rng.randint(1, 99)}" for _ in range(n)]


def _data_count(rng: random.Random, b: _Builder) -> None:
    for fname in rng.sample(("app.log", "server.log", "run.log"), 3):
        level = rng.choice(LOG_LEVELS)
        lines = _log_lines(rng, rng.randint(6, 10))
        while not any(line.startswith(level) for line in lines):  # `grep -c` exits 1 on no match
            lines = _log_lines(rng, len(lines))
        count = sum(line.startswith(level) for line in lines)
        b.add(f"Write the number of lines in {fname} containing {level} to count.txt.",
              {fname: "\n".join(lines) + "\n"},
              [{"type": "number", "path": "count.txt", "equals": count}],
              [f"grep -c {level} {fname} > count.txt"])


def _data_sum(rng: random.Random, b: _Builder) -> None:
    for fname in rng.sample(("sales.csv", "costs.csv", "scores.csv"), 3):
        col = rng.choice(SUM_COLUMNS)
        rows = [(w, rng.randint(1, 100)) for w in rng.sample(WORDS, rng.randint(3, 6))]
        text = f"item,{col}\n" + "".join(f"{w},{v}\n" for w, v in rows)
        b.add(f"{fname} has columns item,{col}. Write the sum of {col} to total.txt.", {fname: text},
              [{"type": "number", "path": "total.txt", "equals": sum(v for _, v in rows)}],
              [f"awk -F, 'NR>1{{s+=$2}} END{{print s}}' {fname} > total.txt"])


def _data_csv_json(rng: random.Random, b: _Builder) -> None:
    for stem in rng.sample(("people", "users", "staff"), 2):
        rows = [(n, rng.randint(18, 80)) for n in rng.sample(NAMES, 3)]
        text = "name,age\n" + "".join(f"{n},{a}\n" for n, a in rows)
        want = [{"name": n, "age": a} for n, a in rows]
        script = (f'import csv, json; rows = list(csv.DictReader(open("{stem}.csv"))); '
                  f'json.dump([{{"name": r["name"], "age": int(r["age"])}} for r in rows], open("{stem}.json", "w"))')
        b.add(f"Convert {stem}.csv to {stem}.json: a JSON list of {{name, age}} objects (age a number), "
              "same order.", {f"{stem}.csv": text},
              [{"type": "json", "path": f"{stem}.json", "equals": want}],
              [f"python3 -c {_q(script)}"])


def _data_group_sum(rng: random.Random, b: _Builder) -> None:
    for out in rng.sample(("totals.json", "by_customer.json", "sums.json"), 2):
        customers = rng.sample(NAMES, 3)
        rows = [(rng.choice(customers), rng.randint(1, 50)) for _ in range(rng.randint(5, 8))]
        want: dict[str, int] = {}
        for c, a in rows:
            want[c] = want.get(c, 0) + a
        text = "customer,amount\n" + "".join(f"{c},{a}\n" for c, a in rows)
        script = ("import csv, json\nt = {}\n"
                  'for r in csv.DictReader(open("orders.csv")):\n'
                  '    t[r["customer"]] = t.get(r["customer"], 0) + int(r["amount"])\n'
                  f'json.dump(t, open("{out}", "w"))\n')
        b.add(f"Write {out}: a JSON object mapping each customer in orders.csv to the sum of their amounts.",
              {"orders.csv": text}, [{"type": "json", "path": out, "equals": want}],
              [f"python3 - <<'EOF'\n{script}EOF"])


def _data_filter(rng: random.Random, b: _Builder) -> None:
    for src in rng.sample(("scores.csv", "grades.csv", "marks.csv"), 2):
        col = rng.choice(FILTER_COLUMNS)
        rows = [(n, rng.randint(0, 100)) for n in rng.sample(NAMES, 6)]
        threshold = sorted(v for _, v in rows)[2] + 1  # strictly between: some rows in, some out
        text = f"name,{col}\n" + "".join(f"{n},{v}\n" for n, v in rows)
        want = [["name", col]] + [[n, str(v)] for n, v in rows if v >= threshold]
        b.add(f"Write to passed.csv the header and the rows of {src} whose {col} is at least {threshold}.",
              {src: text}, [{"type": "csv", "path": "passed.csv", "rows": want}],
              [f"awk -F, 'NR==1 || $2 >= {threshold}' {src} > passed.csv"])


def _data_json_field(rng: random.Random, b: _Builder) -> None:
    for key in rng.sample(("port", "host", "user"), 2):
        config = {"port": rng.randint(1024, 9999), "host": f"{rng.choice(WORDS)}.local",
                  "user": rng.choice(NAMES)}
        script = f'import json; print(json.load(open("config.json"))["{key}"])'
        b.add(f"Write the value of {key} in config.json to {key}.txt.",
              {"config.json": json.dumps(config, indent=2) + "\n"},
              [{"type": "text", "path": f"{key}.txt", "equals": f"{config[key]}\n"}],
              [f"python3 -c {_q(script)} > {key}.txt"])


def _data_uniq(rng: random.Random, b: _Builder) -> None:
    for src in rng.sample(("words.txt", "tags.txt", "names.txt"), 2):
        distinct = rng.sample(WORDS, 4)
        items = distinct + rng.choices(distinct, k=4)
        rng.shuffle(items)
        b.add(f"Write the distinct lines of {src}, sorted, one per line, to unique.txt.",
              {src: "".join(w + "\n" for w in items)},
              [{"type": "text", "path": "unique.txt", "equals": "".join(w + "\n" for w in sorted(distinct))}],
              [f"sort -u {src} > unique.txt"])


# ----------------------------------------------------------------------------------------- shell

def _shell_chmod(rng: random.Random, b: _Builder) -> None:
    for script in rng.sample(("run.sh", "build.sh", "start.sh", "deploy.sh"), 3):
        body = f"#!/bin/sh\necho {rng.choice(WORDS)}\n"
        b.add(f"Make {script} executable.", {script: body},
              [{"type": "executable", "path": script}, {"type": "text", "path": script, "equals": body}],
              [f"chmod +x {script}"])


def _shell_rename(rng: random.Random, b: _Builder) -> None:
    pairs = rng.sample([("draft.txt", "final.txt"), ("old.md", "new.md"), ("a.txt", "b.txt"),
                        ("temp.csv", "data.csv"), ("v1.txt", "v2.txt")], 3)
    for src, dst in pairs:
        body = f"{rng.choice(WORDS)} {rng.choice(WORDS)}\n"
        b.add(f"Rename {src} to {dst}.", {src: body},
              [{"type": "text", "path": dst, "equals": body}, {"type": "absent", "path": src}],
              [f"mv {src} {dst}"])


def _shell_move(rng: random.Random, b: _Builder) -> None:
    for ext, folder in zip(rng.sample(("log", "csv", "bak"), 2), rng.sample(("archive", "old", "store"), 2)):
        moved = [f"{w}.{ext}" for w in rng.sample(WORDS, 3)]
        kept = [f"{w}.txt" for w in rng.sample(WORDS, 2)]
        files = {name: f"{rng.choice(WORDS)}\n" for name in moved + kept}
        checks = ([{"type": "text", "path": f"{folder}/{m}", "equals": files[m]} for m in moved]
                  + [{"type": "absent", "path": m} for m in moved]
                  + [{"type": "text", "path": k, "equals": files[k]} for k in kept])
        b.add(f"Move every .{ext} file into a new directory {folder}/.", files, checks,
              [f"mkdir -p {folder} && mv *.{ext} {folder}/"])


def _shell_env(rng: random.Random, b: _Builder) -> None:
    for fname in rng.sample((".env", "app.env", "settings.env"), 2):
        port, debug = str(rng.randint(1024, 9999)), rng.choice(("true", "false"))
        b.add(f"Create {fname} with the lines PORT={port} and DEBUG={debug}.", {},
              [{"type": "env", "path": fname, "equals": {"PORT": port, "DEBUG": debug}}],
              [f"printf 'PORT={port}\\nDEBUG={debug}\\n' > {fname}"])


def _shell_json_set(rng: random.Random, b: _Builder) -> None:
    for key in rng.sample(("retries", "workers", "timeout"), 2):
        config = {"name": rng.choice(WORDS), "retries": rng.randint(1, 5), "workers": rng.randint(1, 8),
                  "timeout": rng.randint(10, 60)}
        value = config[key] + rng.randint(1, 9)
        want = dict(config, **{key: value})
        script = (f'import json; c = json.load(open("config.json")); c["{key}"] = {value}; '
                  'json.dump(c, open("config.json", "w"), indent=2)')
        b.add(f"In config.json, set {key} to {value} and leave the other keys unchanged.",
              {"config.json": json.dumps(config, indent=2) + "\n"},
              [{"type": "json", "path": "config.json", "equals": want}],
              [f"python3 -c {_q(script)}"])


def _shell_symlink(rng: random.Random, b: _Builder) -> None:
    for link in rng.sample(("latest", "current", "stable"), 2):
        target = f"{rng.choice(WORDS)}-{rng.randint(1, 9)}.txt"
        b.add(f"Create a symbolic link named {link} pointing to {target}.", {target: "data\n"},
              [{"type": "symlink", "path": link, "target": target}],
              [f"ln -s {target} {link}"])


def _shell_script(rng: random.Random, b: _Builder) -> None:
    for name in rng.sample(("greet.sh", "hello.sh", "say.sh"), 2):
        word = rng.choice(WORDS)
        b.add(f"Write a script {name} that prints {word}, and make it executable.", {},
              [{"type": "executable", "path": name},
               {"type": "command_output", "command": f"./{name}", "equals": word + "\n"}],
              [_write_cmd(name, f"#!/bin/sh\necho {word}\n"), f"chmod +x {name}"])


TEMPLATES: tuple[tuple[str, str, str, Callable[[random.Random, _Builder], None]], ...] = (
    ("files", "create", "easy", _files_create),
    ("files", "append", "easy", _files_append),
    ("files", "replace", "medium", _files_replace),
    ("files", "delete-line", "medium", _files_delete_line),
    ("files", "header", "medium", _files_header),
    ("files", "lines", "medium", _files_lines),
    *(("code", fn.replace("_", "-"), "medium", _code_template(fn)) for fn in CODE_FUNCTIONS),
    ("data", "count", "easy", _data_count),
    ("data", "sum", "medium", _data_sum),
    ("data", "csv-json", "hard", _data_csv_json),
    ("data", "group-sum", "hard", _data_group_sum),
    ("data", "filter", "medium", _data_filter),
    ("data", "json-field", "medium", _data_json_field),
    ("data", "uniq", "easy", _data_uniq),
    ("shell", "chmod", "easy", _shell_chmod),
    ("shell", "rename", "easy", _shell_rename),
    ("shell", "move", "medium", _shell_move),
    ("shell", "env", "medium", _shell_env),
    ("shell", "json-set", "hard", _shell_json_set),
    ("shell", "symlink", "medium", _shell_symlink),
    ("shell", "script", "hard", _shell_script),
)


def _stable_hash(task_id: str) -> str:
    return hashlib.sha256(f"{SUITE_NAME}:{task_id}".encode()).hexdigest()


def _assign_splits(specs: list[dict[str, Any]]) -> dict[str, str]:
    split: dict[str, str] = {}
    for category in CATEGORIES:
        members = sorted((s for s in specs if s["category"] == category),
                         key=lambda s: (DIFFICULTIES.index(s["difficulty"]), _stable_hash(s["id"])))
        for i, s in enumerate(members):
            split[s["id"]] = "eval" if i % 4 == 0 else "train"
    return split


def clawbench_mini(seed: int = 0) -> list[Task]:
    """The clawbench-mini tasks for `seed` (the published suite is seed 0), in template order."""
    specs: list[dict[str, Any]] = []
    for category, template, difficulty, build in TEMPLATES:
        b = _Builder(category, template, difficulty)
        build(random.Random(f"{seed}:{category}-{template}"), b)
        specs.extend(b.tasks)
    split = _assign_splits(specs)
    tasks = []
    for s in specs:
        verifier_files = {"checks.py": _checks_source(),
                          "spec.json": json.dumps({"checks": s["checks"]}, indent=1).encode(),
                          **{k: v.encode() for k, v in s["verifier_files"].items()}}
        tasks.append(Task(
            id=s["id"],
            instruction=s["instruction"],
            files=s["files"],
            verifier=CommandVerifier(VERIFIER_COMMAND, files=verifier_files, timeout=VERIFIER_TIMEOUT),
            oracle=tuple(s["oracle"]),
            tags={"category": s["category"], "split": split[s["id"]], "difficulty": s["difficulty"],
                  "template": s["template"], "suite": SUITE_NAME},
            timeout=TASK_TIMEOUT,
        ))
    return tasks
