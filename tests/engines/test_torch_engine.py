"""The in-process torch engine on the embedded model: exact sampling log-probs against a plain
single-sequence forward, batching, weight updates."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from clawfast.engines import torch_engine
from clawfast.engines.base import SamplingParams
from clawfast.engines.torch_engine import TorchEngine, sampling_logprobs

from tiny_moe import MOE_FAMILIES, tiny_moe


@pytest.fixture(scope="module")
def engine(embedded_dir):
    return TorchEngine.from_pretrained(embedded_dir, seed=0, max_batch=4)


def reference_logprobs(model, prompt, output, params):
    """One forward over prompt + output, no cache, no padding: the log-prob of each sampled token
    under the same sampling transform."""
    ids = torch.tensor(np.concatenate([prompt, output]), dtype=torch.long)[None]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    logp = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
    return logp.gather(-1, torch.as_tensor(output, dtype=torch.long)[:, None])[:, 0].numpy()


PARAMS = [
    SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=11, stop_token_ids=(2,)),
    SamplingParams(max_tokens=7, temperature=0.7, top_k=40, seed=12, stop_token_ids=(2,)),
    SamplingParams(max_tokens=5, temperature=0.0, seed=13),
]


def test_batched_sampling_matches_reference_and_solo(engine):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 3000, size=n) for n in (5, 13, 3)]  # odd lengths: left padding in the batch

    async def run():
        batched = await asyncio.gather(*[engine.generate(p, q) for p, q in zip(prompts, PARAMS)])
        solo = [await engine.generate(p, q) for p, q in zip(prompts, PARAMS)]
        return batched, solo

    before = engine.batches_run
    batched, solo = asyncio.run(run())
    assert engine.batches_run - before == 1 + len(prompts)  # the concurrent calls shared one batch
    for prompt, params, b, s in zip(prompts, PARAMS, batched, solo):
        np.testing.assert_array_equal(b.output_ids, s.output_ids)  # same seed, same tokens alone or batched
        assert len(b.output_ids) == len(b.infer_logprobs) <= params.max_tokens
        assert b.finish_reason in ("stop", "length")
        # fp32 on CPU: padded batched matmuls differ from the unpadded forward by float rounding only.
        np.testing.assert_allclose(b.infer_logprobs, reference_logprobs(engine.model, prompt, b.output_ids, params), atol=1e-4)
        assert (b.infer_logprobs <= 0).all()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_moe_model_samples_with_the_log_probs_of_a_plain_forward(family):
    # A mixture-of-experts decoder served in process: batched with left padding and a KV cache, each
    # token's experts are chosen from its own hidden state, so the sampling log-probs are a plain
    # forward's (the prompt's rows route alike padded or not).
    engine = TorchEngine(tiny_moe(family, vocab_size=512, seed=2), seed=0, max_batch=4)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(10, 500, size=n) for n in (5, 13, 3)]

    async def run():
        return await asyncio.gather(*[engine.generate(p, q) for p, q in zip(prompts, PARAMS)])

    for prompt, params, got in zip(prompts, PARAMS, asyncio.run(run())):
        assert 0 < len(got.output_ids) <= params.max_tokens
        np.testing.assert_allclose(got.infer_logprobs, reference_logprobs(engine.model, prompt, got.output_ids, params),
                                   atol=1e-4)


@pytest.mark.parametrize("bad, name", [(dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                                       (dict(top_k=-1), "top_k"), (dict(temperature=-0.1), "temperature"),
                                       (dict(temperature=float("nan")), "temperature"),
                                       (dict(max_tokens=0), "max_tokens")])
def test_sampling_params_out_of_bounds_are_refused(bad, name):
    # top_p 0 keeps no token (the sampler would draw from NaN); a negative top_k fails torch.topk.
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_a_call_with_ids_outside_the_vocabulary_fails_alone(engine):
    """Token ids the embedding does not hold are a ValueError for that call, before it joins a batch:
    the calls made with it are answered as they would be alone."""
    vocab = engine.model.get_input_embeddings().num_embeddings
    prompts = [np.arange(20, 32), np.arange(40, 47)]
    params = SamplingParams(max_tokens=5, seed=3)

    async def run():
        return await asyncio.gather(*[engine.generate(p, params) for p in prompts],
                                    engine.generate(np.array([5, vocab]), params),
                                    engine.generate(np.array([-1, 5]), params), return_exceptions=True)

    *good, too_big, negative = asyncio.run(run())
    for bad in (too_big, negative):
        assert isinstance(bad, ValueError) and "prompt_ids outside" in str(bad)
    for prompt, got in zip(prompts, good):
        alone = asyncio.run(engine.generate(prompt, params))
        np.testing.assert_array_equal(got.output_ids, alone.output_ids)


def test_sampling_logprobs_truncation():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    top1 = sampling_logprobs(logits, 1.0, 1, 1.0)
    assert top1[0] == 0 and torch.isinf(top1[1:]).all()
    nucleus = sampling_logprobs(logits, 1.0, 0, 0.7)
    probs = torch.softmax(logits, -1)
    kept = int(torch.isfinite(nucleus).sum())
    assert probs[: kept - 1].sum() < 0.7 <= probs[:kept].sum()
    torch.testing.assert_close(nucleus[:kept].exp().sum(), torch.tensor(1.0))
    torch.testing.assert_close(sampling_logprobs(logits, 0.0, 0, 1.0), torch.log_softmax(logits, -1))


def test_update_weights_changes_outputs_and_version(embedded_dir):
    engine = TorchEngine.from_pretrained(embedded_dir)
    prompt = np.arange(20, 40)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    first = asyncio.run(engine.generate(prompt, params))
    assert first.weight_version == 0
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    torch.manual_seed(5)
    state["model.norm.weight"] = torch.randn_like(state["model.norm.weight"])
    engine.update_weights(state, 3)
    second = asyncio.run(engine.generate(prompt, params))
    assert second.weight_version == 3
    assert not np.array_equal(first.output_ids, second.output_ids) or not np.allclose(first.infer_logprobs, second.infer_logprobs)
    with pytest.raises(ValueError, match="state_dict lacks"):
        engine.update_weights({"nope": torch.zeros(1)}, 4)
    assert engine.weight_version == 3


def test_an_update_that_does_not_fit_changes_nothing(embedded_dir):
    """Missing, unknown or misshapen tensors are a ValueError before any tensor is copied (strict
    load_state_dict copies every tensor it can, then raises); the old weights serve on."""
    engine = TorchEngine.from_pretrained(embedded_dir)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v + 1.0 for k, v in old.items()}
    name = "model.layers.0.mlp.down_proj.weight"
    bad = [({k: v for k, v in new.items() if k != name}, "lacks 1"),
           ({**new, "extra.weight": torch.zeros(1)}, "has 1 it does not"),
           ({**new, name: new[name][:, :1]}, "down_proj"),
           ({**new, name: new[name].numpy()}, "ndarray")]
    for state, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.update_weights(state, 1)
        assert engine.weight_version == 0 and engine._broken is None
        assert all(torch.equal(v, old[k]) for k, v in engine.model.state_dict().items())


def test_a_load_that_fails_midway_stops_serving_until_a_full_update(embedded_dir, monkeypatch):
    """A load that fails once copying began leaves weights of no version: the engine serves nothing
    (RuntimeError) until a full update succeeds."""
    engine = TorchEngine.from_pretrained(embedded_dir)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    real_load = engine.model.load_state_dict

    def load_then_fail(state_dict, strict=True):
        next(iter(engine.model.parameters())).data.add_(1.0)  # copied part of the update
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.model, "load_state_dict", load_then_fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.update_weights(state, 1)
    assert engine.weight_version == 0
    params = SamplingParams(max_tokens=2)
    with pytest.raises(RuntimeError, match="serves no weights"):
        asyncio.run(engine.generate(np.arange(3, 9), params))
    monkeypatch.setattr(engine.model, "load_state_dict", real_load)
    engine.update_weights(state, 2)
    assert len(asyncio.run(engine.generate(np.arange(3, 9), params)).output_ids) == 2


def test_a_second_update_keeps_calls_paused_until_it_is_done(embedded_dir):
    """Two updates at once: the first to end must not reopen the engine while the second still waits
    for the weights, or calls would join (and decode) in between."""
    import threading

    engine = TorchEngine.from_pretrained(embedded_dir)
    loading = [threading.Event(), threading.Event()]
    release = [threading.Event(), threading.Event()]

    def load(i: int) -> None:
        loading[i].set()
        release[i].wait()

    updates = [threading.Thread(target=engine._paused_load, args=(lambda i=i: load(i), i + 1),
                                kwargs={"what": "an update"}) for i in range(2)]
    updates[0].start()
    loading[0].wait()
    updates[1].start()
    while engine._updates_waiting < 2:  # the second has paused the engine too, and waits for the weights
        time.sleep(0.001)
    release[0].set()
    updates[0].join()
    assert not engine._no_update.is_set()  # the second is loading or about to: nothing may join
    loading[1].wait()
    release[1].set()
    updates[1].join()
    assert engine._no_update.is_set() and not engine._interrupt.is_set() and engine.weight_version == 2


def test_calls_set_aside_by_a_failed_delta_fail_with_it(embedded_dir):
    """``on_update="continue"``: a delta that fails after it began writing (a checksum mismatch) leaves
    weights of no version, so the call it set aside mid-answer fails too rather than decoding on
    them under the old version."""
    from clawfast.engines.weight_delta import DeltaMismatch, TensorDelta, WeightDelta

    engine = TorchEngine.from_pretrained(embedded_dir, seed=0, on_update="continue")
    name = "model.embed_tokens.weight"
    weight = engine.model.state_dict()[name]
    written = (weight + 0.5).reshape(-1)
    delta = WeightDelta(0, 1, [TensorDelta(name, tuple(weight.shape), weight.dtype, "dense", written, checksum=1)])

    async def run():
        call = asyncio.ensure_future(engine.generate(np.arange(20, 36), SamplingParams(max_tokens=400, seed=5)))
        start = engine.decode_steps
        while engine.decode_steps < start + 3:  # decoding now
            await asyncio.sleep(0.001)
        with pytest.raises(DeltaMismatch):
            await asyncio.to_thread(engine.apply_delta, delta)
        return (await asyncio.gather(call, return_exceptions=True))[0]

    got = asyncio.run(run())
    assert engine.continued_calls == 1  # it was set aside, then failed
    assert isinstance(got, RuntimeError) and "serves no weights" in str(got)


def test_torch_engine_behind_the_proxy(embedded_dir, renderer, tmp_path):
    """The real in-process engine serving concurrent Chat Completions calls: batched, recorded with
    the sampler's log-probs, each record's prompt exactly what the renderer built."""
    import concurrent.futures

    import openai

    from clawfast.proxy import ProxyApp, ProxyConfig, ProxyCore, ProxyServer, RolloutRegistry

    engine = TorchEngine.from_pretrained(embedded_dir, seed=0)
    registry = RolloutRegistry(tmp_path / "records")
    with ProxyServer(ProxyApp(ProxyCore(engine, renderer, ProxyConfig(keepalive_s=0.5)), registry)) as server:
        key = registry.open("t").key
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)

        def ask(i: int):
            return client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=6, temperature=0.8, stream=bool(i % 2)
            )

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(ask, range(4)))
    result = registry.close("t")
    assert len(result.calls) == 4 and engine.max_batch_seen >= 2
    for call in result.calls:
        assert 1 <= len(call.output_ids) <= 6 and (call.infer_logprobs <= 0).all()
        assert call.finish_reason in ("stop", "length")
        question = renderer.decode(call.prompt_ids)
        assert question.startswith("<|im_start|>user\nquestion ") and question.endswith("<|im_start|>assistant\n")


def test_a_call_behind_the_proxy_goes_on_across_a_push(embedded_dir, renderer, tmp_path):
    """A harness's call (the official OpenAI client, through the proxy) in flight when the weights
    are pushed: the client gets one answer, and the record holds every token with the version that
    sampled it, older first."""
    import concurrent.futures

    import openai

    from clawfast.proxy import ProxyApp, ProxyConfig, ProxyCore, ProxyServer, RolloutRegistry

    engine = TorchEngine.from_pretrained(embedded_dir, seed=0)
    torch.manual_seed(1)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    registry = RolloutRegistry(tmp_path / "records")
    with ProxyServer(ProxyApp(ProxyCore(engine, renderer, ProxyConfig(keepalive_s=0.5)), registry)) as server:
        key = registry.open("t").key
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.chat.completions.create, model="m", max_tokens=120, temperature=1.0, seed=3,
                                 messages=[{"role": "user", "content": "tell a long story"}])
            while engine.decode_steps < 5:
                time.sleep(0.001)
            engine.update_weights(new, 1)
            reply = answer.result()
    (call,) = registry.close("t").calls
    versions = call.token_versions
    assert call.weight_version == 0 and versions[0] == 0 and versions[-1] == 1  # spans the push
    assert reply.usage.completion_tokens == len(call.output_ids) and engine.continued_calls == 1


def generate_all(engine, params, prompts):
    """Every prompt's answer, the calls made together (so they are prefilled as one group)."""
    async def go():
        return await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    return asyncio.run(go())


def test_batches_group_prompts_of_similar_length(engine):
    """Rows are padded to the longest prompt, so a long prompt is not batched with short ones; the
    oldest request always goes first and nothing is lost or reordered within a length group."""
    rng = np.random.default_rng(2)
    lengths = (40, 2000, 60, 2100, 50)
    prompts = [rng.integers(10, 3000, size=n) for n in lengths]
    params = SamplingParams(max_tokens=2, temperature=0.0, seed=0)

    before = engine.batches_run
    out = generate_all(engine, params, prompts)
    assert engine.batches_run - before == 2
    sizes = sorted(o.timings["batch_size"] for o in out)
    assert sizes == [2.0, 2.0, 3.0, 3.0, 3.0]
    for prompt, o in zip(prompts, out):
        expected = 3.0 if len(prompt) < 100 else 2.0
        assert o.timings["batch_size"] == expected
        np.testing.assert_allclose(o.infer_logprobs, reference_logprobs(engine.model, prompt, o.output_ids, params), atol=1e-4)


def test_cancelled_requests_leave_the_queue_without_running(engine):
    """What a closed rollout's cancelled calls rely on: a queued request whose caller was cancelled is
    never generated, and the others in its batch are unaffected."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 3000, size=n) for n in (30, 31, 32, 33)]
    params = SamplingParams(max_tokens=3, temperature=0.0, seed=0)

    async def run():
        tasks = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts]
        await asyncio.sleep(0)  # every request is queued; the worker has not taken a batch yet
        tasks[1].cancel()
        tasks[3].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    before = engine.batches_run
    out = asyncio.run(run())
    assert engine.batches_run - before == 1
    assert isinstance(out[1], asyncio.CancelledError) and isinstance(out[3], asyncio.CancelledError)
    for i in (0, 2):
        assert out[i].timings["batch_size"] == 2.0
        np.testing.assert_allclose(out[i].infer_logprobs, reference_logprobs(engine.model, prompts[i], out[i].output_ids, params), atol=1e-4)


def test_a_batch_whose_callers_are_all_cancelled_stops_early(engine):
    """A rollout closed mid-generation must not hold the engine (and the weight lock, which a weight
    update waits for) until max_tokens; a batch keeps running while any caller still waits."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(10, 3000, size=20) for _ in range(2)]
    long = SamplingParams(max_tokens=600, temperature=1.0, seed=5)  # no stop tokens: runs to max_tokens
    short = SamplingParams(max_tokens=600, temperature=1.0, seed=6)

    async def run(cancel_both: bool):
        before = engine.batches_run
        tasks = [asyncio.ensure_future(engine.generate(p, q)) for p, q in zip(prompts, (long, short))]
        while engine.batches_run == before:  # the batch is running on the worker thread
            await asyncio.sleep(0.001)
        steps = engine.decode_steps
        tasks[0].cancel()
        if cancel_both:
            tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(engine.update_weights, engine.model.state_dict(), engine.weight_version)  # batch over
        return done, engine.decode_steps - steps

    done, steps = asyncio.run(run(cancel_both=True))
    assert all(isinstance(d, asyncio.CancelledError) for d in done)
    assert steps < 50  # stopped at the cancellation, not after 600 steps
    done, steps = asyncio.run(run(cancel_both=False))
    assert isinstance(done[0], asyncio.CancelledError)
    assert len(done[1].output_ids) == 600 and steps >= 599  # the other caller got its whole answer


@pytest.mark.parametrize("on_update", ["finish", "abort"])
def test_a_call_in_flight_at_an_update_runs_on_one_version(embedded_dir, on_update):
    """An update while a call decodes: "finish" lets it end on the old weights, "abort" stops it and
    runs it again on the new ones; either way all its tokens come from the version it reports."""
    engine = TorchEngine.from_pretrained(embedded_dir, seed=0, max_batch=2, on_update=on_update)
    torch.manual_seed(3)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    prompt = np.arange(20, 36)
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=5)  # no stop token: all 48 decode

    async def in_flight_update():
        call = asyncio.ensure_future(engine.generate(prompt, params))
        start = engine.decode_steps
        while engine.decode_steps < start + 3:  # decoding now
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.update_weights, new, 1)
        return await call

    got = asyncio.run(in_flight_update())
    fresh_new = asyncio.run(engine.generate(prompt, params))
    engine.update_weights(old, 0)
    fresh_old = asyncio.run(engine.generate(prompt, params))
    assert not np.array_equal(fresh_new.output_ids, fresh_old.output_ids)  # the update matters
    expected = fresh_old if on_update == "finish" else fresh_new
    assert got.weight_version == expected.weight_version == (0 if on_update == "finish" else 1)
    np.testing.assert_array_equal(got.output_ids, expected.output_ids)
    np.testing.assert_allclose(got.infer_logprobs, expected.infer_logprobs, atol=1e-6)
    assert engine.aborted_calls == (1 if on_update == "abort" else 0)


def plain_sampling(model, weights_by_version, switch_at, prompt, params):
    """What a call should get when its first `switch_at` tokens come from version 0 and the rest from
    version 1: one uncached forward per token over prompt + tokens so far, the next token drawn with
    the call's own seeded generator from the log-softmax (temperature 1, no truncation), stopping
    at a stop token or the budget."""
    generator = torch.Generator().manual_seed(params.seed)
    out, logprobs, versions = [], [], []
    finish = "length"
    while len(out) < params.max_tokens:
        version = 0 if len(out) < switch_at else 1
        model.load_state_dict(weights_by_version[version])
        ids = torch.tensor(np.concatenate([prompt, np.asarray(out, dtype=np.int64)]), dtype=torch.long)[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
        out.append(token)
        logprobs.append(float(logp[token]))
        versions.append(version)
        if token in params.stop_token_ids:
            finish = "stop"
            break
    return np.asarray(out), np.asarray(logprobs), np.asarray(versions), finish


def continued_call(engine, prompt, params, new, *, decoded_before=3):
    """Start a call, push `new` as version 1 once it has decoded `decoded_before` steps, return it."""

    async def run():
        call = asyncio.ensure_future(engine.generate(prompt, params))
        start = engine.decode_steps
        while engine.decode_steps < start + decoded_before:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.update_weights, new, 1)
        return await call

    return asyncio.run(run())


def test_a_call_continued_across_an_update_is_what_each_version_sampled(embedded_dir):
    """``on_update="continue"``: the call in flight keeps its tokens, goes on decoding on the new
    weights from where it stopped, and comes back as one answer whose every token, log-prob and
    version is what a plain uncached sampler gives when the weights change at that token; a stop
    token in the second piece ends it exactly there, and a budget that runs out there too."""
    engine = TorchEngine.from_pretrained(embedded_dir, seed=0, max_batch=2, on_update="continue")
    torch.manual_seed(3)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in old.items()}
    prompt = np.arange(20, 36)
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=5)
    got = continued_call(engine, prompt, params, new)
    switch = int((got.output_versions == 0).sum())
    assert 0 < switch < len(got.output_ids) == 48  # the answer spans the push
    assert got.weight_version == 0 and set(got.output_versions[switch:]) == {1}
    assert engine.continued_calls == 1 and engine.aborted_calls == engine.discarded_tokens == 0
    assert engine.replayed_tokens == len(prompt) + switch  # its KV rebuilt on the new weights
    reference = engine.model  # the engine is idle now: its model serves as the plain sampler's
    want_ids, want_lp, want_versions, finish = plain_sampling(reference, {0: old, 1: new}, switch, prompt, params)
    np.testing.assert_array_equal(got.output_ids, want_ids)
    np.testing.assert_allclose(got.infer_logprobs, want_lp, atol=2e-5)
    np.testing.assert_array_equal(got.output_versions, want_versions)
    assert got.finish_reason == finish == "length"

    # A stop token sampled after the push ends the call there; so does a budget that ends there.
    stop_at = switch + 4
    for cut in (dict(stop_token_ids=(int(want_ids[stop_at]),)), dict(max_tokens=stop_at + 1)):
        engine.update_weights(old, 0)
        p = SamplingParams(**{"max_tokens": 48, "temperature": 1.0, "seed": 5, **cut})
        got = continued_call(engine, prompt, p, new, decoded_before=switch - 1)
        assert len(got.output_ids) <= stop_at + 1
        n_old = int((got.output_versions == 0).sum())
        ids, lp, versions, finish = plain_sampling(reference, {0: old, 1: new}, n_old, prompt, p)
        np.testing.assert_array_equal(got.output_ids, ids)
        np.testing.assert_allclose(got.infer_logprobs, lp, atol=2e-5)
        np.testing.assert_array_equal(got.output_versions, versions)
        assert got.finish_reason == finish == ("stop" if "stop_token_ids" in cut else "length")


def test_on_update_is_validated(embedded_dir):
    with pytest.raises(ValueError, match="on_update must be one of"):
        TorchEngine(torch.nn.Linear(1, 1), on_update="later")


def test_shared_and_cached_prefixes_sample_what_a_plain_forward_gives(embedded_dir):
    """Rows sharing a system prompt run it once; a later call extending an earlier call's prompt and
    answer runs only its new tokens (the answer's KV was kept); the log-probs are still those of one
    plain forward, and the tokens those the same seeds sample with the prefix cache off."""
    rng = np.random.default_rng(2)
    system = rng.integers(10, 3000, size=40)
    prompts = [np.concatenate([system, rng.integers(10, 3000, size=n)]) for n in (3, 9, 6)]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5)

    cached = TorchEngine.from_pretrained(embedded_dir, seed=0, max_batch=4)
    plain = TorchEngine.from_pretrained(embedded_dir, seed=0, max_batch=4, prefix_cache_tokens=0)
    first = generate_all(cached, params, prompts)
    assert cached.prefill_tokens == 40 + 3 + 9 + 6  # the shared 40 tokens ran once
    # The next turn of the second row: its prompt extends its first prompt and output.
    follow = np.concatenate([prompts[1], first[1].output_ids, rng.integers(10, 3000, size=5)])
    before = cached.prefill_tokens
    [second] = generate_all(cached, params, [follow])
    # Only what the first turn did not run: its last sampled token (no forward read it) and the new ones.
    assert cached.prefill_tokens - before == 1 + 5
    for engine_out, prompt in zip(first + [second], prompts + [follow]):
        np.testing.assert_allclose(engine_out.infer_logprobs,
                                   reference_logprobs(cached.model, prompt, engine_out.output_ids, params), atol=1e-4)
    for a, b in zip(first + [second], generate_all(plain, params, prompts) + generate_all(plain, params, [follow])):
        np.testing.assert_array_equal(a.output_ids, b.output_ids)


def test_a_padded_row_of_a_shared_prefix_group_is_cached_without_its_padding(embedded_dir):
    """Two calls sharing a system prompt, with suffixes of different lengths, prefilled together: the
    short one's cache row is [shared prefix | left padding | suffix | decoded]. Its next turn runs on
    the KV kept from that row, which must be its own columns only: the follow-up's greedy tokens and
    log-probs are a plain forward's."""
    rng = np.random.default_rng(5)
    system = rng.integers(10, 3000, size=40)
    long_, short = (np.concatenate([system, rng.integers(10, 3000, size=n)]) for n in (30, 3))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    engine = TorchEngine.from_pretrained(embedded_dir, seed=0, max_batch=4)
    _, first = generate_all(engine, params, [long_, short])
    follow = np.concatenate([short, first.output_ids, rng.integers(10, 3000, size=5)])
    before = engine.prefill_tokens
    [second] = generate_all(engine, params, [follow])
    assert engine.prefill_tokens - before == 1 + 5  # it ran on the kept KV
    ids = list(follow)
    with torch.no_grad():  # greedy by plain uncached forwards
        for _ in range(params.max_tokens):
            ids.append(int(engine.model(torch.tensor([ids])).logits[0, -1].argmax()))
    np.testing.assert_array_equal(second.output_ids, ids[len(follow):])
    # fp32 on CPU: a cached, padded forward differs from the plain one by float rounding only.
    np.testing.assert_allclose(second.infer_logprobs,
                               reference_logprobs(engine.model, follow, second.output_ids, params), atol=1e-4)


def test_calls_prefilled_together_each_start_from_their_own_cached_prefix(embedded_dir):
    """Two next turns, each extending a different earlier call's prompt and answer, prefilled in one
    batch: each runs only its new tokens (its own cached KV, though the two share nothing), with the
    log-probs of one plain forward and the tokens the same seeds sample with the prefix cache off."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(10, 3000, size=n) for n in (30, 45)]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5)

    cached = TorchEngine.from_pretrained(embedded_dir, seed=0, max_batch=4)
    plain = TorchEngine.from_pretrained(embedded_dir, seed=0, max_batch=4, prefix_cache_tokens=0)
    first = generate_all(cached, params, prompts)
    follows = [np.concatenate([p, out.output_ids, rng.integers(10, 3000, size=k)])
               for p, out, k in zip(prompts, first, (4, 7))]
    before = cached.prefill_tokens
    second = generate_all(cached, params, follows)
    assert [out.timings["batch_size"] for out in second] == [2.0, 2.0]  # one prefill, one batch
    # Each ran its first turn's last sampled token (no forward read it) and its new tokens.
    assert cached.prefill_tokens - before == (1 + 4) + (1 + 7)
    for engine_out, prompt in zip(first + second, prompts + follows):
        np.testing.assert_allclose(engine_out.infer_logprobs,
                                   reference_logprobs(cached.model, prompt, engine_out.output_ids, params), atol=1e-4)
    for a, b in zip(first + second, generate_all(plain, params, prompts) + generate_all(plain, params, follows)):
        np.testing.assert_array_equal(a.output_ids, b.output_ids)


def test_the_prefix_cache_serves_many_prompts_in_turn(embedded_dir):
    """Several cached prefixes at once: each new call starts from the one it shares most with."""
    rng = np.random.default_rng(3)
    engine = TorchEngine.from_pretrained(embedded_dir, seed=0, max_batch=1)
    systems = [rng.integers(10, 3000, size=30) for _ in range(3)]
    params = SamplingParams(max_tokens=2, temperature=0.0, seed=1)

    async def go(prompt):
        return await engine.generate(prompt, params)

    for turn in range(2):
        for system in systems:
            asyncio.run(go(np.concatenate([system, rng.integers(10, 3000, size=4)])))
    assert len(engine._prefixes) >= 3
    assert engine.prefill_tokens < engine.prompt_tokens  # the second round reused the systems' KV


@pytest.mark.parametrize("continuous", [True, False])
def test_calls_join_a_running_batch_and_leave_it_when_done(embedded_dir, continuous):
    """Continuous batching: calls arriving while a batch decodes join it at the next step (a longer
    prompt pads the running rows' caches, a shorter one is padded to them), a row that ends leaves
    and is answered while the others decode, and every call still samples what it samples alone,
    with the log-probs of one plain forward. Static batching (the baseline) makes them wait."""
    engine = TorchEngine.from_pretrained(embedded_dir, seed=0, max_batch=4, continuous=continuous)
    rng = np.random.default_rng(7)
    first, longer, shorter = (rng.integers(10, 3000, size=n) for n in (20, 50, 5))
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=21),  # no stop token: all 40 decode
              SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=22),
              SamplingParams(max_tokens=9, temperature=0.0, seed=23)]
    prompts = [first, longer, shorter]

    async def arrive_while_decoding():
        running = asyncio.ensure_future(engine.generate(first, params[0]))
        start = engine.decode_steps
        while engine.decode_steps < start + 3:  # the first call is decoding
            await asyncio.sleep(0.001)
        batches = engine.batches_run
        late = [asyncio.ensure_future(engine.generate(p, q)) for p, q in zip(prompts[1:], params[1:])]
        await late[0]
        answered_first = running.done()
        return [await running] + [await t for t in late], answered_first, engine.batches_run - batches

    out, answered_first, joins = asyncio.run(arrive_while_decoding())
    sizes = [o.timings["batch_size"] for o in out]
    if continuous:
        assert not answered_first  # the short call left the batch before the long one ended
        # Prefilled together, or the second at the step after the first (the worker thread may look
        # at the queue between the two arrivals).
        assert (joins, sizes) in ((1, [1.0, 3.0, 3.0]), (2, [1.0, 2.0, 3.0]))
    else:
        assert answered_first and joins == 1 and sizes == [1.0, 2.0, 2.0]
    solo = [asyncio.run(engine.generate(p, q)) for p, q in zip(prompts, params)]
    for prompt, q, o, s in zip(prompts, params, out, solo):
        assert len(o.output_ids) == q.max_tokens
        np.testing.assert_array_equal(o.output_ids, s.output_ids)
        np.testing.assert_allclose(o.infer_logprobs, reference_logprobs(engine.model, prompt, o.output_ids, q), atol=1e-4)


def test_a_join_that_cannot_be_stacked_fails_alone(embedded_dir, monkeypatch):
    """Calls whose caches cannot be stacked onto the running batch's (out of memory midway through the
    layers) get the error; the running call goes on with its own cache untouched and samples what it
    samples alone."""
    engine = TorchEngine.from_pretrained(embedded_dir, seed=0, max_batch=4)
    rng = np.random.default_rng(9)
    first, late = rng.integers(10, 3000, size=20), rng.integers(10, 3000, size=30)
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=5)
    pads = [0]
    left_pad = torch_engine._left_pad

    def out_of_memory_at_the_second_layer(*args):
        pads[0] += 1
        if pads[0] > 4:  # the first layer's keys and values are padded
            raise MemoryError("out of memory")
        return left_pad(*args)

    monkeypatch.setattr(torch_engine, "_left_pad", out_of_memory_at_the_second_layer)

    async def run():
        running = asyncio.ensure_future(engine.generate(first, params))
        start = engine.decode_steps
        while engine.decode_steps < start + 3:
            await asyncio.sleep(0.001)
        joining = asyncio.ensure_future(engine.generate(late, params))
        return await running, await asyncio.gather(joining, return_exceptions=True)

    out, (error,) = asyncio.run(run())
    assert isinstance(error, MemoryError) and pads[0] == 5
    assert out.timings["batch_size"] == 1.0
    solo = asyncio.run(engine.generate(first, params))
    np.testing.assert_array_equal(out.output_ids, solo.output_ids)
    np.testing.assert_allclose(out.infer_logprobs, solo.infer_logprobs, atol=1e-5)


def test_a_call_that_does_not_fit_is_not_overtaken(engine):
    """A running batch takes queued calls in order and stops at the first whose padding would not
    fit: that call waits only for the batch to drain, then goes first; later short calls wait with it."""
    rng = np.random.default_rng(8)
    short = [rng.integers(10, 3000, size=30) for _ in range(3)]
    long = rng.integers(10, 3000, size=2500)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=4)

    async def run():
        first = asyncio.ensure_future(engine.generate(short[0], params))
        start = engine.decode_steps
        while engine.decode_steps < start + 2:
            await asyncio.sleep(0.001)
        waiting = asyncio.ensure_future(engine.generate(long, params))
        later = [asyncio.ensure_future(engine.generate(p, params)) for p in short[1:]]
        return await first, await waiting, await asyncio.gather(*later)

    first, waiting, later = asyncio.run(run())
    assert first.timings["batch_size"] == 1.0  # nobody joined the first call
    assert waiting.timings["batch_size"] == 1.0  # the long call started a batch of its own, first
    assert [o.timings["batch_size"] for o in later] == [2.0, 2.0]  # the short ones then started theirs


def test_an_engine_serves_in_its_own_dtype(embedded_dir):
    """``engine.dtype``: a float32 policy served from a bfloat16 copy; a float32 push is cast into
    it, and the log-probs are those of the bfloat16 model (what the importance-sampling correction
    then compares with the trainer's)."""
    from transformers import AutoModelForCausalLM

    from clawfast.train.build import build_engine
    from clawfast.train.config import EngineConfig

    lm = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    engine = build_engine(EngineConfig(dtype="bfloat16"), embedded_dir, dtype="float32", lm=lm, weight_version=2)
    assert next(engine.model.parameters()).dtype == torch.bfloat16 and next(lm.parameters()).dtype == torch.float32
    torch.manual_seed(0)
    with torch.no_grad():  # the trainer's step, in place (tied weights stay one tensor)
        for p in lm.parameters():
            p.add_(0.01 * torch.randn_like(p))
    pushed = lm.state_dict()
    engine.update_weights(pushed, 3)
    served = engine.model.state_dict()
    for name, value in pushed.items():
        assert torch.equal(served[name], value.to(torch.bfloat16))
    prompt = np.arange(20, 36)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=9)
    out = asyncio.run(engine.generate(prompt, params))
    assert out.weight_version == 3
    np.testing.assert_allclose(out.infer_logprobs, reference_logprobs(engine.model, prompt, out.output_ids, params), atol=2e-2)


def _tiny_qwen3(**config):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, initializer_range=0.2,
                                   **config)
    return transformers.Qwen3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("full_layers", [0, 1])
def test_a_sliding_window_model_serves_prompts_that_leave_a_cached_prefix(full_layers):
    """A sliding window of 8 (every layer, or one of two): a prompt that shares 25 tokens with a cached
    40-token one, and two batched prompts that share 30, leave the cached prefix; cropping a cache past
    its window raised and failed those calls for as long as the entry lived (every GRPO sample's
    second turn but one). Each is served, its log-probs the model's."""
    lm = _tiny_qwen3(use_sliding_window=True, sliding_window=8, max_window_layers=full_layers)
    engine = TorchEngine(lm, max_batch=4, seed=0)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    first = np.arange(1, 41) % 90 + 1
    prompts = [first, np.concatenate([first[:25], [50, 51, 52, 53, 54]])]
    for prompt in prompts:
        gen = asyncio.run(engine.generate(prompt, params))
        np.testing.assert_allclose(gen.infer_logprobs, reference_logprobs(lm, prompt, gen.output_ids, params), atol=1e-5)
    pair = [np.concatenate([first[:30], [70, 71]]), np.concatenate([first[:30], [72, 73, 74, 75]])]

    async def both():
        return await asyncio.gather(*(engine.generate(p, params) for p in pair))

    for prompt, gen in zip(pair, asyncio.run(both())):
        np.testing.assert_allclose(gen.infer_logprobs, reference_logprobs(lm, prompt, gen.output_ids, params), atol=1e-5)


def test_a_call_at_a_tiny_temperature_samples_greedily_and_fails_no_call_beside_it():
    """temperature 1e-39 (accepted: it is > 0) divided the logits to inf and NaN, and sampling failed
    every call of the batch. Shifted first, it is the greedy limit: the argmax, log-prob 0."""
    lm = _tiny_qwen3()
    engine = TorchEngine(lm, max_batch=4, seed=0)
    prompt = np.arange(1, 10)
    normal, tiny = SamplingParams(max_tokens=5, temperature=1.0, seed=1), SamplingParams(max_tokens=5, temperature=1e-39, seed=2)

    async def both():
        return await asyncio.gather(engine.generate(prompt, normal), engine.generate(prompt, tiny))

    got_normal, got_tiny = asyncio.run(both())
    greedy = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0)))
    np.testing.assert_array_equal(got_tiny.output_ids, greedy.output_ids)
    assert np.all(got_tiny.infer_logprobs == 0.0) and np.all(np.isfinite(got_normal.infer_logprobs))


def test_a_delta_does_not_revive_an_engine_a_failed_full_update_broke():
    """A full update that failed after writing half the tensors leaves weights no version is made of:
    calls are refused until a full update succeeds. A delta (empty, on the old version) was accepted
    and served the half-written weights as its version."""
    from clawfast.engines.weight_delta import WeightDelta

    engine = TorchEngine(_tiny_qwen3(), max_batch=2, seed=0)
    new = {k: v + 1.0 for k, v in engine.model.state_dict().items()}
    load = engine.model.load_state_dict

    def half(state_dict, strict=True):
        with torch.no_grad():
            for k in list(state_dict)[: len(state_dict) // 2]:
                engine.model.state_dict()[k].copy_(state_dict[k])
        raise RuntimeError("out of memory")

    engine.model.load_state_dict = half
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.update_weights(new, 1)
    with pytest.raises(RuntimeError, match="on weights no version is made of"):
        engine.apply_delta(WeightDelta(0, 1, []))
    with pytest.raises(RuntimeError, match="serves no weights"):
        asyncio.run(engine.generate(np.arange(1, 5), SamplingParams(max_tokens=2)))
    engine.model.load_state_dict = load
    engine.update_weights(new, 2)
    assert asyncio.run(engine.generate(np.arange(1, 5), SamplingParams(max_tokens=2))).weight_version == 2
