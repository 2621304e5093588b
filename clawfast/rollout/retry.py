"""Infrastructure retries: the one rule both executors (`clawfast.rollout.scheduler`, in this
process, and `clawfast.rollout.ray_backend`, on Ray actors) apply to a finished attempt.

An attempt whose status is an infrastructure failure (`INFRA_STATUSES`: its sandbox did not start or
died, or its Ray actor or node died under it) says nothing about the policy, and a GRPO group that
loses it trains smaller. (A task the sandbox backend refused outright, ``info["sandbox_refused"]``,
is not run again: the same backend refuses it again.) So it runs again, as a new proxy rollout with the same task, harness and
sample index, up to `infra_retries` times; what is returned for the spec is the last attempt.

The failed attempt is closed first, with its truthful status, like any rollout; then its record file
is set aside (`RolloutRegistry.set_aside`: ``<records_dir>/retried/``), so no trainer and no reader
of the records directory takes it for a sample of its task. The returned attempt lists the failed
ones in ``info["retries"]`` (`attempt_note`: rollout id, status, error, Ray node, whether its
actor died), also in its own record file. An attempt that fails when the budget is spent is returned
as it is (its status still the infrastructure failure), with the notes of the attempts before it.
"""

from __future__ import annotations

from typing import Any

from clawfast.records import RolloutResult

INFRA_STATUSES = frozenset({"sandbox_error"})


def should_retry(result: RolloutResult, retries_done: int, infra_retries: int) -> bool:
    """Whether `result`, after `retries_done` retries of its spec, runs again (not when the backend
    refused its task outright: the same backend refuses the same task again)."""
    return (result.status in INFRA_STATUSES and not result.info.get("sandbox_refused")
            and retries_done < infra_retries)


def attempt_note(result: RolloutResult) -> dict[str, Any]:
    """What the returned attempt keeps of a failed one (plain JSON)."""
    note = {"rollout_id": result.rollout_id, "status": result.status, "error": result.info.get("error", "")}
    for key in ("ray_node_id", "actor_died"):
        if key in result.info:
            note[key] = result.info[key]
    return note


def infra_counts(results: list[RolloutResult]) -> dict[str, Any]:
    """Of a batch's returned rollouts: ``retries`` (attempts run again), ``infra_failures`` (attempts
    that ended in an infrastructure failure: the retried ones and the returned ones),
    ``retried_rollouts`` (returned rollouts that needed a retry) and ``nodes_lost`` (the Ray nodes
    whose actor died under one of their attempts)."""
    notes = [note for r in results for note in r.info.get("retries", ())]
    lost = {n["ray_node_id"] for n in notes if n.get("actor_died") and n.get("ray_node_id")}
    lost |= {r.info["ray_node_id"] for r in results if r.info.get("actor_died") and r.info.get("ray_node_id")}
    return {
        "retries": len(notes),
        "infra_failures": len(notes) + sum(r.status in INFRA_STATUSES for r in results),
        "retried_rollouts": sum(bool(r.info.get("retries")) for r in results),
        "nodes_lost": sorted(lost),
    }
