"""Torch engine against Hugging Face `generate` on the quickstart's model, in one process.

Setup: SmolLM2-135M-Instruct (`clawfast model prepare smollm2-135m`, fp32, CPU), ``--requests``
concurrent calls shaped like one turn of a quickstart eval: the same mini-swe-agent system prompt and
bash tool schema rendered by the model's chat template, then each task's own instruction (the 16
held-out clawbench-mini tasks, cycled), greedy, ``--max-tokens`` new tokens each (no stop token, so
every row decodes the same number of tokens on both sides).

- ``engine``: `TorchEngine.generate` called concurrently: one batch, the shared system prompt run
  once (prefix cache), KV-cached decoding.
- ``engine, no prefix cache``: the same with ``prefix_cache_tokens=0`` (each row runs its whole prompt).
- ``engine, bfloat16``: the engine on a bfloat16 copy of the weights (``engine.dtype = "bfloat16"``;
  its greedy tokens may differ from float32's, counted and printed).
- ``HF generate`` (baseline): `model.generate` on the same prompts as one left-padded batch, greedy,
  with its own KV cache.
- ``HF generate, one call at a time`` (baseline): what a server without batching does.

The first three produce the same tokens (greedy; checked: a mismatch is printed, not hidden).
Repetitions are interleaved and the median reported. Writes bench/results/bench_engine_generate.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from clawfast.engines.base import SamplingParams
from clawfast.engines.torch_engine import TorchEngine
from clawfast.pretrained import prepare_model
from clawfast.train.build import build_engine
from clawfast.train.config import EngineConfig

SYSTEM = "You are a helpful assistant that can interact with a computer."
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Execute a bash command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "The bash command to execute"}},
                   "required": ["command"]}}}]


def prompts_of(tokenizer, n: int) -> list[np.ndarray]:
    from clawfast.tasks import load_suite

    tasks = load_suite("clawbench-mini", "eval", seed=0)
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Please solve this issue: {tasks[i % len(tasks)].instruction}\n\n"
                                                "Run one bash command per response with the bash tool."}]
        out.append(np.asarray(tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                                            tokenize=True, return_dict=False), dtype=np.int64))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_engine_generate.json"))
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = prepare_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_of(tokenizer, args.requests)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, seed=0)
    cached = TorchEngine(lm, seed=0, max_batch=args.requests)
    plain = TorchEngine(lm, seed=0, max_batch=args.requests, prefix_cache_tokens=0)
    half = build_engine(EngineConfig(dtype="bfloat16", max_batch=args.requests), model_dir, lm=lm)  # as `engine.dtype` builds it

    def engine_run(engine):
        async def go():
            return await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        engine._prefixes.clear()  # every repetition starts cold: the system prompt runs once in it
        return [g.output_ids.tolist() for g in asyncio.run(go())]

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @torch.inference_mode()
    def hf_batch():
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.from_numpy(p)
            mask[i, width - len(p):] = 1
        out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                          do_sample=False, pad_token_id=pad)
        return [row[width:].tolist() for row in out]

    @torch.inference_mode()
    def hf_one_at_a_time():
        return [lm.generate(input_ids=torch.from_numpy(p)[None], attention_mask=torch.ones((1, len(p)), dtype=torch.long),
                            max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                            pad_token_id=pad)[0, len(p):].tolist() for p in prompts]

    cases = {"engine": lambda: engine_run(cached), "engine, no prefix cache": lambda: engine_run(plain),
             "engine, bfloat16": lambda: engine_run(half),
             "HF generate": hf_batch, "HF generate, one call at a time": hf_one_at_a_time}
    times: dict[str, list[float]] = {name: [] for name in cases}
    outputs: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    reference = outputs["HF generate"]
    for name in ("engine", "engine, no prefix cache", "engine, bfloat16"):
        same = sum(a == b for a, b in zip(outputs[name], reference))
        if same != len(reference):
            why = "bfloat16 weights" if "bfloat16" in name else "greedy ties under float rounding"
            print(f"note: {name} differs from HF generate on {len(reference) - same} of {len(reference)} rows ({why})")
    tokens = args.requests * args.max_tokens
    base = statistics.median(times["HF generate"])
    rows = []
    print(f"{args.requests} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.max_tokens} new tokens each, torch threads {torch.get_num_threads()}")
    for name, ts in times.items():
        t = statistics.median(ts)
        rows.append({"case": name, "seconds": t, "tokens_per_s": tokens / t, "speedup_vs_hf_generate": base / t})
        print(f"  {name:<32} {t:7.2f} s  {tokens / t:7.1f} tokens/s  {base / t:5.2f}x HF generate")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.machine(), "processor": platform.processor(), "torch": torch.__version__,
                               "threads": torch.get_num_threads(), "requests": args.requests,
                               "max_tokens": args.max_tokens, "prompt_tokens": [len(p) for p in prompts],
                               "prefill_tokens_engine": cached.prefill_tokens, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
