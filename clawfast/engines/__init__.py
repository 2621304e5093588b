"""Inference engines behind one interface: token ids in, token ids and sampling log-probs out."""

from clawfast.engines.base import Engine, Generation, SamplingParams

__all__ = ["Engine", "Generation", "SamplingParams"]
