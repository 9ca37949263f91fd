"""The judges against a real HTTP server on loopback (``judge_server.JudgeServer``): both APIs, the
key only in the header and never in an error, retries on 5xx / 429 / timeouts, failures as failures,
bounded concurrency, and a judge that is down or refuses the key as one line before training."""
import socket
import time

import pytest

from nla_grpo.evals.judges import Judge, parse_json_reply
from judge_server import JudgeServer
from nla_grpo.shared.config import build_config
from nla_grpo.shared.errors import NlaInputError

KEY = "sk-test-0123456789abcdef"


def _judge(url, backend="openai", key_env="NLA_TEST_JUDGE_KEY", **judge):
    cfg = build_config({"evals": {"judge": {"backend": backend, "base_url": url, "model": "judge", "api_key_env": key_env,
                                            **judge}}}, "t").evals.judge
    return Judge(cfg, sleep=lambda s: None)


def test_parse_json_reply_is_tolerant_but_wants_an_object():
    assert parse_json_reply('{"claims": ["a"]}') == {"claims": ["a"]}
    assert parse_json_reply('Sure!\n```json\n{"captures_quirk": true}\n```\nHope this helps') == {"captures_quirk": True}
    assert parse_json_reply('The verdict: {"claims": []} -- done {"x": 1}') == {"claims": []}
    assert parse_json_reply("{not json} then {\"a\": 2}") == {"a": 2}
    for bad in (None, "", "no json here", "[1, 2]", '{"a": '):
        assert parse_json_reply(bad) is None


@pytest.mark.parametrize("backend", ["openai", "anthropic"])
def test_each_backend_speaks_its_api_with_the_key_in_the_header_only(backend, monkeypatch):
    monkeypatch.setenv("NLA_TEST_JUDGE_KEY", KEY)
    with JudgeServer() as server:
        base = server.url + ("/v1" if backend == "openai" else "")
        judge = _judge(base, backend)
        judge.check()
        good, fenced, garbage, failing = judge.ask_many([
            ("sys", 'REPLY:{"claims": ["the sea"]}'), ("sys", 'REPLY:```json\n{"claims": []}\n```'),
            ("sys", "REPLY:I would say it is fine."), ("sys", "FAIL500")])
        judge.close()
    assert good.reply == {"claims": ["the sea"]} and good.error is None
    assert fenced.reply == {"claims": []}
    assert garbage.reply is None and garbage.error == "no JSON object in the judge's reply"
    assert failing.reply is None and failing.error.startswith("HTTP 500") and "(4 attempts)" in failing.error
    assert KEY not in failing.error and "***" in failing.error  # the server echoed the key: masked
    posts = [r for r in server.requests if r["body"]["messages"][-1]["content"] == 'REPLY:{"claims": ["the sea"]}']
    head, body = posts[0]["headers"], posts[0]["body"]
    assert body["temperature"] == 0.0 and body["model"] == "judge"
    if backend == "anthropic":
        assert posts[0]["path"] == "/v1/messages" and head["x-api-key"] == KEY and head["anthropic-version"] == "2023-06-01"
        assert body["system"] == "sys" and "Authorization" not in head
    else:
        assert posts[0]["path"] == "/v1/chat/completions" and head["Authorization"] == f"Bearer {KEY}"
        assert body["messages"][0] == {"role": "system", "content": "sys"}


def test_retries_timeouts_and_concurrency(monkeypatch):
    monkeypatch.setenv("NLA_TEST_JUDGE_KEY", KEY)
    with JudgeServer(slow_s=1.0) as server:
        judge = _judge(server.url + "/v1", retries=2, timeout_s=0.3, concurrency=2)
        flaky, rate, slow = judge.ask_many([("s", "FLAKY"), ("s", "RATE"), ("s", "SLOW")])
        assert flaky.reply == {"ok": True} and rate.reply == {"ok": True}  # one 503 / 429, then the answer
        assert slow.reply is None and slow.error == "timeout after 0.3 s (3 attempts)"
        judge.close()
        deadline = time.time() + 30
        # the three timed-out attempts reach the server and their handlers finish (1 s each, later on a loaded
        # machine: a fixed sleep let one still count below)
        while (server.seen.get("SLOW", 0) < 3 or server.in_flight) and time.time() < deadline:
            time.sleep(0.05)
        assert server.seen.get("SLOW") == 3 and server.in_flight == 0, (server.seen, server.in_flight)
        server.slow_s, server.max_in_flight = 0.3, 0
        judge = _judge(server.url + "/v1", timeout_s=5.0, concurrency=2)
        judge.ask_many([("s", f"SLOW {i}") for i in range(6)])
        assert server.max_in_flight == 2  # bounded, and used
        judge.close()
    # anthropic defaults to one request at a time
    cfg = build_config({"evals": {"judge": {"backend": "anthropic", "model": "m"}}}, "t").evals.judge
    assert Judge(cfg).concurrency == 1


def test_a_missing_key_a_judge_that_is_down_or_refuses_the_key_is_one_line(monkeypatch):
    monkeypatch.delenv("NLA_TEST_JUDGE_KEY", raising=False)
    with pytest.raises(NlaInputError, match="evals.judge.api_key_env: the environment variable NLA_TEST_JUDGE_KEY is not set"):
        _judge("http://127.0.0.1:9/v1")
    monkeypatch.setenv("NLA_TEST_JUDGE_KEY", "sk-with inner-space")
    with pytest.raises(NlaInputError, match="holds whitespace or control characters") as exc:
        _judge("http://127.0.0.1:9/v1")
    assert "inner-space" not in str(exc.value)
    monkeypatch.setenv("NLA_TEST_JUDGE_KEY", KEY + "\r\n")  # as read from a CRLF .env file: taken without the line end
    assert _judge("http://127.0.0.1:9/v1")._key == KEY
    monkeypatch.setenv("NLA_TEST_JUDGE_KEY", KEY)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(NlaInputError, match=rf"openai judge at http://127.0.0.1:{port}/v1 does not answer \(ConnectError"):
        _judge(f"http://127.0.0.1:{port}/v1").check()
    with JudgeServer(models_status=401) as server:
        with pytest.raises(NlaInputError, match="refuses the key .HTTP 401; key from NLA_TEST_JUDGE_KEY.") as exc:
            _judge(server.url + "/v1").check()
    assert KEY not in str(exc.value)
    with pytest.raises(NlaInputError, match="expected the name of an environment variable"):
        build_config({"evals": {"judge": {"api_key_env": KEY + "-with-dash"}}}, "t")
