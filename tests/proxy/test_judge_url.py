"""`UrlJudge` against a live OpenAI-compatible server (the proxy, its engine playing the judge's scripted
answer): the prompt goes out as one user message with the key from the environment, the answer's text
comes back and is parsed into a verdict; a server that refuses is a verdict with its error, not a crash."""

from __future__ import annotations

from clawfast.tasks.judge import UrlJudge, ask


def test_url_judge_asks_a_live_openai_compatible_server(proxy, monkeypatch):
    monkeypatch.setenv("CLAWFAST_TEST_JUDGE_KEY", proxy.key)
    proxy.engine.push({"text": 'Scores:\n{"scores": {"faithful": 1.0, "brief": 0.5}, "total": 0.75, "notes": "ok"}'})
    judge = UrlJudge(proxy.url + "/v1", "policy", api_key_env="CLAWFAST_TEST_JUDGE_KEY", max_tokens=64)
    verdict = ask(judge, "Grade this run.")
    assert (verdict.total, verdict.scores, verdict.error) == (0.75, {"faithful": 1.0, "brief": 0.5}, None)
    assert verdict.prompt == "Grade this run." and verdict.judge == f"policy@{proxy.url}/v1"
    (call,) = proxy.registry.records(proxy.rollout_id)
    assert "Grade this run." in proxy.core.renderer.decode(call.prompt_ids)  # the prompt reached the model


def test_a_refusing_server_is_a_verdict_with_its_error(proxy, monkeypatch):
    monkeypatch.setenv("CLAWFAST_TEST_JUDGE_KEY", "not-a-rollout-key")
    verdict = ask(UrlJudge(proxy.url + "/v1", "policy", api_key_env="CLAWFAST_TEST_JUDGE_KEY"), "Grade.")
    assert verdict.total is None and "answered 401" in verdict.error and verdict.prompt == "Grade."
