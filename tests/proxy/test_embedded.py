"""The embedded model: deterministic, idempotent, loadable, with the Qwen3-style specials and template."""

from __future__ import annotations

import json

from transformers import AutoConfig, AutoTokenizer

from clawfast.embedded import SPECIAL_TOKENS, ensure_embedded_model, generate_corpus


def test_build_is_idempotent_and_loads(embedded_dir):
    assert ensure_embedded_model() == embedded_dir
    assert (embedded_dir / "COMPLETE").exists()
    config = AutoConfig.from_pretrained(embedded_dir)
    assert config.model_type == "qwen3" and config.head_dim == 64
    tok = AutoTokenizer.from_pretrained(embedded_dir)
    assert config.vocab_size == len(tok)
    for special in SPECIAL_TOKENS:  # each special is one token, and text never splits into it
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    text = "def f(x):\n    return {'a': 1}  # ünïcode ✓"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_corpus_is_deterministic():
    assert generate_corpus(50) == generate_corpus(50)
    assert any("<tool_call>" in doc for doc in generate_corpus(50))


def test_chat_template_renders_tools_calls_and_results(embedded_dir):
    tok = AutoTokenizer.from_pretrained(embedded_dir)
    tools = [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be useful."},
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
        {"role": "tool", "content": "a.py", "tool_call_id": "1"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe useful.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n' in text
    assert "<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
