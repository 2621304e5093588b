"""Delta weight pushes: each encoding against plain bit arithmetic, the torch engine's weights after
delta pushes bit-identical to full pushes after real AdamW steps, refusals that change nothing, and
the pusher's full pushes (first, every N, after a refusal)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from clawfast.engines.base import SamplingParams
from clawfast.engines.torch_engine import TorchEngine
from clawfast.engines.weight_delta import DeltaEncoder, DeltaMismatch, checksum
from clawfast.train.push import WeightPusher

from .delta_pushes import adamw_steps

BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_encoding_rebuilds_the_new_bits(dtype):
    """Random tensors changed in the ways an optimizer changes them (one unit in the last place, near
    or far apart; a jump; almost everything; -0.0 for 0.0; units with a few jumps; nothing but a NaN
    kept): applying the delta to the old bits gives the new bits exactly, and the smallest encoding
    is chosen."""
    from clawfast.engines.weight_delta import apply_tensor_delta

    g = torch.Generator().manual_seed(0)
    bits = BITS[dtype]
    old = {name: torch.randn(3000, generator=g).to(dtype) for name in ("ulp", "far", "jump", "most", "zero", "nan", "mixed")}
    old["zero"][:10] = 0.0
    old["nan"][5] = float("nan")
    new = {k: v.clone() for k, v in old.items()}
    pick = torch.randperm(3000, generator=g)[:90]
    new["ulp"].view(bits)[pick] += torch.where(torch.rand(90, generator=g) < 0.5, 1, -1).to(bits)
    far = torch.arange(150, 3000, 200)  # more than 127 apart: each needs a filler code
    new["far"].view(bits)[far] -= 1
    new["jump"][pick] = torch.randn(90, generator=g).to(dtype) * 100
    new["most"] = torch.randn(3000, generator=g).to(dtype)
    new["zero"][:10] = -0.0
    new["mixed"].view(bits)[pick] += 1
    new["mixed"][pick[:3]] = 1024.0  # three steps too large for a byte
    encoder = DeltaEncoder(dtype)
    list(encoder.reset(old.items(), 0))
    delta = encoder.encode(new.items(), 1)
    got = {t.name: t for t in delta.tensors}
    assert set(got) == {"ulp", "far", "jump", "most", "zero", "mixed"}  # a NaN with the same bits did not change
    assert [got[k].encoding for k in ("ulp", "far", "jump", "most", "zero", "mixed")] == [
        "ulps", "ulps", "values", "dense", "values", "ulps"]
    assert (got["ulp"].values != 0).sum() == 90 and got["ulp"].jumps.numel() == 0  # a byte a change (+ fillers)
    assert got["far"].values.numel() == 2 * len(far) and (got["far"].values == 0).sum() == len(far)
    assert got["mixed"].jumps.tolist() == [1024.0] * 3 and (got["mixed"].values != 0).sum() == 87
    for name, t in got.items():
        target = old[name].clone()
        apply_tensor_delta(target, t)
        assert bits_equal(target, new[name]), name
        assert bits_equal(encoder.base[name], new[name])
    assert delta.nbytes == sum(t.nbytes for t in got.values()) < delta.full_nbytes


def test_delta_pushes_leave_the_engine_bit_identical_to_full_pushes(embedded_dir):
    """The trainer in float32, two bfloat16 engines: one gets every push whole, the other through
    the pusher (a full push, then deltas with checksums). After each AdamW step both serve the same
    bits, the deltas move a fraction of the bytes, and both sample the same tokens."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    full = TorchEngine.from_pretrained(embedded_dir, dtype=torch.bfloat16, seed=0)
    by_delta = TorchEngine.from_pretrained(embedded_dir, dtype=torch.bfloat16, seed=0)
    pusher = WeightPusher(by_delta, torch.bfloat16, checksums=True)
    kinds = []
    for version, _ in enumerate(adamw_steps(lm, 4, lr=3e-5), start=1):
        state = {k: v.detach() for k, v in lm.state_dict().items()}
        full.update_weights(state, version)
        pusher.update_weights(state, version)
        kinds.append(pusher.last["push/delta"])
        assert by_delta.weight_version == full.weight_version == version
        a, b = full.model.state_dict(), by_delta.model.state_dict()
        assert all(bits_equal(a[k], b[k]) and checksum(a[k]) == checksum(b[k]) for k in a)
        if pusher.last["push/delta"]:
            assert pusher.last["push/bytes"] < pusher.last["push/full_bytes"]
    assert kinds == [0.0, 1.0, 1.0, 1.0]
    params = SamplingParams(max_tokens=12, seed=4)
    x, y = (asyncio.run(e.generate(np.arange(3, 19), params)) for e in (full, by_delta))
    np.testing.assert_array_equal(x.output_ids, y.output_ids)


@pytest.fixture
def engine_and_delta(embedded_dir):
    """A bfloat16 engine at version 1 and a checked delta to version 2 after one AdamW step (at the
    quickstart's learning rate: mostly sparse tensors)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    engine = TorchEngine.from_pretrained(embedded_dir, dtype=torch.bfloat16, seed=0)
    encoder = DeltaEncoder(torch.bfloat16, checksums=True)
    engine.update_weights(dict(encoder.reset(lm.state_dict().items(), 1)), 1)
    next(adamw_steps(lm, 1, lr=3e-5))
    return engine, encoder.encode(lm.state_dict().items(), 2)


def _bad_deltas(delta):
    from clawfast.engines.weight_delta import TensorDelta

    first = delta.tensors[0]
    two = torch.zeros(2, dtype=first.dtype)
    values = TensorDelta(first.name, first.shape, first.dtype, "values", two, torch.tensor([1, 10**9]))
    ulps = next(t for t in delta.tensors if t.encoding == "ulps")
    yield "serves version 1", dataclasses.replace(delta, base_version=0)
    yield "does not have", dataclasses.replace(delta, tensors=[dataclasses.replace(first, name="nope")])
    yield "the engine's tensor", dataclasses.replace(delta, tensors=[dataclasses.replace(first, shape=(1, 2))])
    yield "the engine's tensor", dataclasses.replace(delta, tensors=[dataclasses.replace(first, dtype=torch.float16)])
    yield "indexes outside", dataclasses.replace(delta, tensors=[values])
    yield "gaps do not match", dataclasses.replace(delta, tensors=[dataclasses.replace(values, gaps=values.gaps[:1])])
    yield "unknown encoding", dataclasses.replace(delta, tensors=[dataclasses.replace(first, encoding="zip")])
    yield "twice", dataclasses.replace(delta, tensors=[first, first])
    yield "do not match", dataclasses.replace(delta, tensors=[dataclasses.replace(
        ulps, jump_index=torch.zeros(ulps.jumps.numel() + 1, dtype=torch.int32))])
    yield "indexes outside", dataclasses.replace(delta, tensors=[dataclasses.replace(
        ulps, values=torch.cat([ulps.values, torch.zeros(10**6, dtype=torch.uint8)]))])


def test_a_delta_that_does_not_fit_is_refused_before_anything_changes(engine_and_delta):
    engine, delta = engine_and_delta
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    params = SamplingParams(max_tokens=6, seed=2)
    answer = asyncio.run(engine.generate(np.arange(3, 19), params))
    for match, bad in _bad_deltas(delta):
        with pytest.raises(ValueError, match=match):
            engine.apply_delta(bad)
        assert engine.weight_version == 1
        assert all(bits_equal(v, before[k]) for k, v in engine.model.state_dict().items())
    again = asyncio.run(engine.generate(np.arange(3, 19), params))  # the old weights keep serving
    np.testing.assert_array_equal(again.output_ids, answer.output_ids)
    engine.apply_delta(delta)
    assert engine.weight_version == 2


def test_a_checksum_mismatch_stops_serving_until_a_full_push(engine_and_delta):
    engine, delta = engine_and_delta
    tampered = dataclasses.replace(delta, tensors=[dataclasses.replace(delta.tensors[0], checksum=1)] + delta.tensors[1:])
    with pytest.raises(DeltaMismatch):
        engine.apply_delta(tampered)
    with pytest.raises(RuntimeError, match="serves no weights"):
        asyncio.run(engine.generate(np.arange(3, 9), SamplingParams(max_tokens=2)))
    engine.update_weights(engine.model.state_dict(), 3)
    assert len(asyncio.run(engine.generate(np.arange(3, 9), SamplingParams(max_tokens=2))).output_ids) == 2


def test_the_pusher_pushes_whole_first_every_n_and_after_a_refusal(embedded_dir):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32)
    engine = TorchEngine.from_pretrained(embedded_dir, dtype=torch.bfloat16, seed=0)
    pusher = WeightPusher(engine, torch.bfloat16, full_every=3)  # every third push whole
    kinds = []
    for version, _ in enumerate(adamw_steps(lm, 5, lr=1e-3), start=1):
        pusher.update_weights(lm.state_dict(), version)
        kinds.append(pusher.last["push/delta"])
    assert kinds == [0.0, 1.0, 1.0, 0.0, 1.0]
    # Weights pushed by other means: the next delta's base is not what serves; the full weights go.
    engine.update_weights(engine.model.state_dict(), 9)
    next(adamw_steps(lm, 1, lr=1e-3, seed=1))
    pusher.update_weights(lm.state_dict(), 10)
    assert pusher.last["push/fallback"] == 1.0 and engine.weight_version == 10
    served = engine.model.state_dict()
    assert all(bits_equal(served[k], v.detach().to(torch.bfloat16)) for k, v in lm.state_dict().items())
    # A stream that lacks a tensor: refused, nothing changes, and the next push is whole.
    before = {k: v.clone() for k, v in served.items()}
    partial = {k: v for i, (k, v) in enumerate(lm.state_dict().items()) if i}
    with pytest.raises(ValueError, match="not pushed"):
        pusher.update_weights(partial, 11)
    assert engine.weight_version == 10 and all(bits_equal(v, before[k]) for k, v in served.items())
    pusher.update_weights(lm.state_dict(), 11)
    assert pusher.last["push/delta"] == 0.0 and engine.weight_version == 11


@pytest.mark.parametrize("stream", [False, True], ids=["dict", "stream"])
def test_an_engine_that_reads_checkpoints_gets_the_checkpoints_layout(tmp_path, stream):
    # transformers (>= 5) fuses an MoE layer's experts into one tensor in memory and writes them per
    # expert; an engine that loads checkpoint names (vLLM, a remote server) gets what the file holds,
    # tensor for tensor, also from a stream (a sharded trainer's gathers); the torch engine, serving the
    # same modules, gets them as they are.
    from safetensors.torch import load_file

    from clawfast.engines.scripted import ScriptedEngine
    from clawfast.train.push import engine_layout

    from tiny_moe import tiny_moe

    lm = tiny_moe("qwen3_moe", vocab_size=64, seed=4)
    lm.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    own = {k: v.detach() for k, v in lm.state_dict().items()}
    reader = ScriptedEngine(lambda text: [], 0)
    reader.checkpoint_layout = True
    pairs = iter(own.items()) if stream else own.items()
    got = dict(engine_layout(WeightPusher(reader, torch.float32), lm, pairs))
    assert sorted(got) == sorted(on_disk) and all(torch.equal(got[k], on_disk[k]) for k in on_disk)
    if any(k.endswith("mlp.experts.gate_up_proj") for k in own):  # fused in memory (transformers >= 5)
        assert any(k.endswith(".experts.0.gate_proj.weight") for k in got) and len(got) > len(own)
    same = TorchEngine(lm)
    assert dict(engine_layout(same, lm, own.items())).keys() == own.keys()
