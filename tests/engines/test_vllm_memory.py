"""vLLM's memory share: a share vLLM's start-up check would refuse is refused here first, with the
setting's name and the numbers, instead of vLLM's "Engine core initialization failed" from its engine
process half a minute later. The rule (`memory_refusal`) is checked on numbers for both of vLLM's
workers, and against vLLM's own check on this machine's CPU worker."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from clawfast.engines.vllm_engine import memory_refusal

from .vllm_marks import VLLM_ERROR

GIB = 1 << 30


def test_the_rule_is_vllms_for_each_worker():
    """A GPU worker needs share x total free whatever the KV cache size; the CPU worker checks the
    share against free RAM only when no KV cache size is set."""
    assert memory_refusal(0.5, None, free=40 * GIB, total=80 * GIB, device="cuda:0") is None
    refused = memory_refusal(0.5, 1 << 30, free=39 * GIB, total=80 * GIB, device="cuda:0")
    assert "gpu_memory_utilization = 0.5 reserves 40.00 GiB of cuda:0 (80.00 GiB), and 39.00 GiB is free" in refused
    assert "engine.gpu_memory_utilization" in refused and "kv_cache_memory_bytes" not in refused
    assert memory_refusal(0.92, 64 << 20, free=1 * GIB, total=24 * GIB, device="cpu") is None
    refused = memory_refusal(0.92, None, free=20 * GIB, total=24 * GIB, device="cpu")
    assert "of RAM (24.00 GiB)" in refused and "set kv_cache_memory_bytes" in refused


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(VLLM_ERROR is not None, reason=f"vllm does not import: {VLLM_ERROR}")
def test_a_share_vllm_refuses_is_refused_before_it_starts_and_a_kv_cache_size_lifts_it_on_the_cpu(model_dir,
                                                                                                   monkeypatch):
    """On this machine's CPU worker: a share just above the RAM free is a ValueError here at once;
    with this check off, vLLM's own check refuses the same share once its engine process runs; with a
    KV cache size set, vLLM starts with that share and serves."""
    from clawfast.engines import vllm_engine
    from clawfast.engines.base import SamplingParams

    from .tiny_qwen3 import MAX_LEN

    free, total, device = vllm_engine._device_memory()  # vLLM's own measure, on its memory node
    assert device == "cpu"
    share = round(min(1.0, free / total + 0.02), 3)
    build = dict(dtype="float32", max_model_len=MAX_LEN, gpu_memory_utilization=share)
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"gpu_memory_utilization = {share} reserves .* set kv_cache_memory_bytes"):
        vllm_engine.VLLMEngine(str(model_dir), **build)
    assert time.monotonic() - start < 5  # before vLLM started anything

    with monkeypatch.context() as unchecked:
        unchecked.setattr(vllm_engine, "_device_memory", lambda: None)
        with pytest.raises(RuntimeError, match="initialization failed"):
            vllm_engine.VLLMEngine(str(model_dir), **build)

    engine = vllm_engine.VLLMEngine(str(model_dir), kv_cache_memory_bytes=64 << 20, **build)
    try:
        cache = engine._llm.vllm_config.cache_config
        assert (cache.gpu_memory_utilization, cache.kv_cache_memory_bytes) == (share, 64 << 20)
        out = asyncio.run(engine.generate(np.array([5, 6, 7], dtype=np.int32),
                                          SamplingParams(max_tokens=3, temperature=0.0)))
        assert len(out.output_ids) == 3
    finally:
        asyncio.run(engine.close())
