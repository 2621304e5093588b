"""`EngineJudge`: the embedded torch engine on a model directory answers a judge prompt with the model's
greedy answer to it under the model's chat template (against transformers' own greedy `generate`), and
an answer that is no verdict is a verdict with its error."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawfast.embedded import ensure_embedded_model
from clawfast.tasks.judge import EngineJudge, ask

PROMPT = 'Grade the run. Answer {"total": 0.5}'


def test_engine_judge_answers_greedily_under_the_chat_template():
    model_dir = ensure_embedded_model()
    judge = EngineJudge(model_dir, max_tokens=24)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert judge(PROMPT) == expected
    verdict = ask(judge, PROMPT)
    assert verdict.response == expected and verdict.prompt == PROMPT and verdict.judge == str(model_dir)
    # The embedded model is no judge: its answer holds no verdict, and that is said, not scored.
    assert verdict.total is None and "no JSON object" in verdict.error
