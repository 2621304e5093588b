"""Fixtures shared by the trainer-step tests: one tiny policy and its harness-shaped rollouts per
test module (module scope: a test that trains copies the policy first)."""

from __future__ import annotations

import pytest

from test_step_equivalence import harness_rollouts, tiny_policy


@pytest.fixture(scope="module")
def policy():
    return tiny_policy(0)


@pytest.fixture(scope="module")
def rollouts(policy):
    return harness_rollouts(policy, seed=2)
