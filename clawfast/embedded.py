"""The embedded default model: a byte-level BPE tokenizer and a tiny random Qwen3, built locally.

`ensure_embedded_model()` returns a directory that `transformers` loads with
`AutoTokenizer.from_pretrained` / `AutoModelForCausalLM.from_pretrained` (and vLLM with
`skip_tokenizer_init=True`). Nothing is downloaded: the tokenizer is trained with the `tokenizers`
library on a corpus generated here (English prose, Python, shell, JSON, tool-call markup and
harness-like text), and the model is a randomly initialised `Qwen3ForCausalLM`.

Guaranteed: the build is deterministic (same corpus, same merges, same seeded weights) and
idempotent: the directory is named after a hash of everything that shapes it, built in a temporary
sibling and renamed into place, so concurrent callers never see a half-written model. The chat
template is Qwen3-style (system block with a ``<tools>`` JSON list, ``<tool_call>`` JSON in assistant
turns, ``<tool_response>`` in user turns, ``<think>`` reasoning) and *message-local*: each message
renders to the same text wherever it appears, which is what lets the proxy render incrementally.
Not guaranteed: that the model says anything sensible — its weights are random.

Where: ``$CLAWFAST_HOME/embedded-<hash>`` if that variable is set, else
``~/.cache/clawfast/embedded-<hash>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from clawfast.chat_template import CHAT_TEMPLATE

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
VOCAB_SIZE = 8192
MODEL_CONFIG = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    # vLLM's CPU attention backend refuses head_dim 16; 64 works (docs/ENGINES.md).
    head_dim=64,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    torch_dtype="float32",
)
CORPUS_SEED = 1234
WEIGHT_SEED = 0
_BUILD_VERSION = 1  # bump when the corpus generator or template changes

# ------------------------------------------------------------------------------------------------
# Corpus

_WORDS = (
    "the of and to in is that for it as with was on be by this are or from at which an have not but "
    "file read write edit run test build error fix function return value list string number object "
    "task agent model tool call result output input user assistant system message content please "
    "change update create delete directory path line code python shell command json config install "
    "check status pass fail exit success done next first then when if else while each all some "
    "workspace repository branch commit patch diff search find replace open close import module class "
    "about after again against also always another answer around because before being below between "
    "both called came could different does down during even every example few following found general "
    "given good great group hand help here however important instead just keep know large last later "
    "least less like little long look made make many might more most much must need never new number "
    "only other over own part people place point possible problem program question quite rather really "
    "right same second several should show since small something state still such system take than "
    "their them there these they thing think those though three through time today together under until "
    "upon used using very want well were what where whether while without work world would year your "
    "array buffer bytes cache default dict error exception false float format handler integer iterator "
    "lambda length logger memory method null option parse print process queue raise request response "
    "schema server socket source stream struct template thread token true tuple type variable vector"
).split()
_NAMES = "main utils config parser server client handler model data test app index core io cli".split()
_CMDS = (
    "ls -la", "cat README.md", "git status", "git diff --stat", "python -m pytest -q", "pip install -e .",
    "grep -rn TODO src/", "find . -name '*.py'", "sed -n 1,40p main.py", "echo done", "mkdir -p out",
    "wc -l *.txt", "head -n 20 log.txt", "cd /tmp && ls", "python3 script.py --help", "npm test",
)
_TOOLS = ("bash", "read", "write", "edit", "exec", "ls", "Bash", "Read", "Write", "Edit", "exec_command")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 16))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice((".", ".", ".", "?", "!", ":"))


def _python(rng: random.Random) -> str:
    name, arg = rng.choice(_NAMES), rng.choice(_WORDS)
    n = rng.randint(0, 99)
    return (
        f"def {name}_{arg}({arg}, n={n}):\n"
        f"    \"\"\"{_sentence(rng)}\"\"\"\n"
        f"    result = []\n"
        f"    for i in range(n):\n"
        f"        if i % {rng.randint(2, 9)} == 0:\n"
        f"            result.append({arg}[i])\n"
        f"    return result\n\n"
        f"class {name.capitalize()}{arg.capitalize()}:\n"
        f"    def __init__(self, path: str) -> None:\n"
        f"        self.path = path\n"
        f"        self.count = {n}\n"
    )


def _json_obj(rng: random.Random) -> dict:
    return {
        rng.choice(_WORDS): rng.choice((rng.randint(0, 9999), rng.choice(_WORDS), True, None, [1, 2, 3])),
        "path": f"/{rng.choice(_NAMES)}/{rng.choice(_NAMES)}.py",
        "command": rng.choice(_CMDS),
    }


def _tool_call(rng: random.Random) -> str:
    name = rng.choice(_TOOLS)
    args = {"command": rng.choice(_CMDS)} if rng.random() < 0.5 else _json_obj(rng)
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def _turns(rng: random.Random) -> str:
    parts = ["<|im_start|>system\n" + _sentence(rng) + " " + _sentence(rng) + "<|im_end|>\n"]
    parts.append("<|im_start|>user\n" + _sentence(rng) + "<|im_end|>\n")
    for _ in range(rng.randint(1, 3)):
        think = f"<think>\n{_sentence(rng)}\n</think>\n\n" if rng.random() < 0.3 else ""
        parts.append(f"<|im_start|>assistant\n{think}{_sentence(rng)}\n{_tool_call(rng)}<|im_end|>\n")
        out = "\n".join(f"{rng.choice(_NAMES)}.py" for _ in range(rng.randint(1, 4)))
        parts.append(f"<|im_start|>user\n<tool_response>\n{out}\n</tool_response><|im_end|>\n")
    parts.append(f"<|im_start|>assistant\n{_sentence(rng)}<|im_end|>\n")
    return "".join(parts)


def _harness_text(rng: random.Random) -> str:
    return (
        f"<system-reminder>\n{_sentence(rng)}\n</system-reminder>\n"
        f"$ {rng.choice(_CMDS)}\nexit code {rng.randint(0, 2)}\n"
        f"diff --git a/{rng.choice(_NAMES)}.py b/{rng.choice(_NAMES)}.py\n"
        f"@@ -{rng.randint(1, 90)},7 +{rng.randint(1, 90)},8 @@\n-    return None\n+    return {rng.choice(_WORDS)}\n"
    )


def generate_corpus(num_docs: int = 6000, seed: int = CORPUS_SEED) -> list[str]:
    """Deterministic training text for the tokenizer (about 3 MB, well under a second)."""
    rng = random.Random(seed)
    makers = (
        lambda: " ".join(_sentence(rng) for _ in range(rng.randint(2, 6))),
        lambda: _python(rng),
        lambda: "\n".join(f"$ {rng.choice(_CMDS)}" for _ in range(rng.randint(1, 5))),
        lambda: json.dumps(_json_obj(rng), indent=rng.choice((None, 2))),
        lambda: _turns(rng),
        lambda: _harness_text(rng),
    )
    return [makers[i % len(makers)]() for i in range(num_docs)]


# ------------------------------------------------------------------------------------------------
# Build


def _build_hash() -> str:
    blob = json.dumps(
        [_BUILD_VERSION, SPECIAL_TOKENS, VOCAB_SIZE, MODEL_CONFIG, CORPUS_SEED, WEIGHT_SEED, CHAT_TEMPLATE],
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_path() -> Path:
    home = os.environ.get("CLAWFAST_HOME")
    root = Path(home) if home else Path.home() / ".cache" / "clawfast"
    return root / f"embedded-{_build_hash()}"


def build_tokenizer():
    """Train the byte-level BPE and wrap it as a `PreTrainedTokenizerFast` with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(generate_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, eos_id: int, pad_id: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None, **MODEL_CONFIG)
    torch.manual_seed(WEIGHT_SEED)
    return Qwen3ForCausalLM(config).eval()


def ensure_embedded_model(path: str | os.PathLike | None = None) -> Path:
    """Build the embedded tokenizer and model at `path` (default: `default_path()`) unless a complete
    build is already there; return the directory."""
    target = Path(path) if path is not None else default_path()
    if (target / "COMPLETE").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        tokenizer = build_tokenizer()
        tokenizer.save_pretrained(tmp)
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        model = build_model(len(tokenizer), eos, pad)
        model.generation_config.eos_token_id = [eos, pad]
        model.save_pretrained(tmp)
        (tmp / "COMPLETE").write_text(_build_hash() + "\n")
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (target exists and is complete): keep theirs.
            if not (target / "COMPLETE").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(ensure_embedded_model())
