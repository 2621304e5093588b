"""`Policy` refuses a causal LM whose forward changes its logits past the LM head: the fused log-probs
compute ``hidden @ head.weight.T``, so such a model would train another distribution than the engines
sample from. The rule is probed from the model, not looked up by its type."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from clawfast.train.policy import Policy

SHAPE = dict(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=0)


def _lm(config_cls, model_cls, **kw):
    torch.manual_seed(0)
    return model_cls(config_cls(**{**SHAPE, **kw}))


@pytest.mark.parametrize("config_cls, model_cls, kw", [
    (tf.Gemma2Config, tf.Gemma2ForCausalLM, {"head_dim": 16}),  # final_logit_softcapping 30 by default
    (tf.GraniteConfig, tf.GraniteForCausalLM, {"logits_scaling": 8.0}),
    (tf.CohereConfig, tf.CohereForCausalLM, {}),  # logit_scale 0.0625
], ids=["gemma2 soft-cap", "granite scale", "cohere scale"])
def test_a_model_that_changes_its_logits_is_refused(config_cls, model_cls, kw):
    lm = _lm(config_cls, model_cls, **kw)
    with pytest.raises(ValueError, match=f"{model_cls.__name__} changes its logits past the LM head"):
        Policy(lm)
    # The probe leaves the model as it was.
    assert "forward" not in vars(lm.base_model)
    assert lm(input_ids=torch.tensor([[2, 3]])).logits.shape == (1, 2, SHAPE["vocab_size"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_whose_logits_are_the_head_trains_the_logprobs_it_samples(dtype):
    """Gemma 2 without its final soft-cap: accepted, and the policy's log-probs are the model's own
    log-softmax of the logits it samples from."""
    lm = _lm(tf.Gemma2Config, tf.Gemma2ForCausalLM, head_dim=16, final_logit_softcapping=None).to(dtype)
    policy = Policy(lm, attention="sdpa-dense")
    ids = torch.tensor([2, 7, 11, 5, 9])
    n = len(ids)
    out = policy(ids, torch.arange(n), torch.full((n,), n - 1), torch.arange(n - 1), ids[1:])
    want = torch.log_softmax(lm(input_ids=ids[None]).logits[0, :-1].float(), -1).gather(1, ids[1:, None])[:, 0]
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.logprobs.float(), want, atol=tol, rtol=0)
