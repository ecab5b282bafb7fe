"""The OpenAI-compatible HTTP front door, driven by the official `openai` client over 127.0.0.1.

The router runs with ``http_port=0`` over `ScriptedBackend` (tests/router/openai_support.py):
sequence i answers REPLIES[i] then EOS, with per-sequence logprobs SEQ_LOGPROBS[i].
"""
from __future__ import annotations

import json
import logging
import socket
import threading

import httpx
import openai
import pytest
from openai_support import EOS, REPLIES, SEQ_LOGPROBS, ScriptedBackend, SpecialByteTokenizer

from router import BackendError
from router.openai_api.chat_template import ChatTemplate

MODEL = "tiny-test"


@pytest.fixture
def http(serve):
    """Factory: a ready router with HTTP on a free port → (running, openai client)."""
    clients = []

    def start(backend=None, token=None, **kwargs):
        backend = backend or ScriptedBackend()
        running = serve(backend, http_port=0, model_name=MODEL, token=token, **kwargs)
        client = openai.OpenAI(base_url=running.server.http_url + "/v1", api_key=token or "unused",
                               max_retries=0, timeout=10)
        clients.append(client)
        return running, client

    yield start
    for client in clients:
        client.close()


@pytest.fixture
def api(http):
    return http()


def test_http_port_is_bound_and_reported(api):
    running, _ = api
    assert running.server.http_port > 0
    assert running.server.http_url == f"http://127.0.0.1:{running.server.http_port}"


def test_completion_text_usage_and_finish(api):
    running, client = api
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, user="alice")
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    [choice] = out.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, REPLIES[0], "stop")
    assert choice.model_extra["stop_reason"] is None           # ended on EOS
    assert choice.logprobs is None
    prompt_tokens = 3                                          # <s> H i
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == len(REPLIES[0]) + 1  # + EOS
    assert out.usage.total_tokens == prompt_tokens + len(REPLIES[0]) + 1
    assert out.usage.prompt_tokens_details.cached_tokens == 2
    inp = next(iter(running.backend.inputs.values()))
    assert inp.prompt_token_ids == [256, ord("H"), ord("i")]


def test_completion_defaults_to_16_tokens_and_reports_length(api):
    running, client = api
    out = client.completions.create(model=MODEL, prompt="Hi", n=3)
    assert next(iter(running.backend.inputs.values())).params.max_tokens == 16
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [REPLIES[0], REPLIES[1], REPLIES[2][:16]]
    assert [c.finish_reason for c in out.choices] == ["stop", "stop", "length"]
    assert out.usage.completion_tokens == (len(REPLIES[0]) + 1) + (len(REPLIES[1]) + 1) + 16


def test_completion_token_id_prompt(api):
    running, client = api
    out = client.completions.create(model=MODEL, prompt=[72, 105], max_tokens=5)
    assert out.choices[0].text == REPLIES[0][:5]
    assert next(iter(running.backend.inputs.values())).prompt_token_ids == [72, 105]


def test_completion_stream_with_usage(api):
    _, client = api
    stream = client.completions.create(model=MODEL, prompt="Hi", n=2, max_tokens=40, stream=True,
                                       stream_options={"include_usage": True})
    texts, finishes, usage = ["", ""], [None, None], None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        [c] = chunk.choices
        texts[c.index] += c.text
        if c.finish_reason:
            finishes[c.index] = c.finish_reason
    assert texts == [REPLIES[0], REPLIES[1]]
    assert finishes == ["stop", "stop"]
    assert usage.completion_tokens == len(REPLIES[0]) + len(REPLIES[1]) + 2


def test_stream_ends_with_done_and_sends_no_usage_unasked(api):
    running, _ = api
    with httpx.stream("POST", running.server.http_url + "/v1/completions", timeout=10,
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == "Hel"
    assert all("usage" not in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_cut_or_kept_and_stop_reason(api):
    _, client = api
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, stop="there")
    assert out.choices[0].text == "Hello "
    assert (out.choices[0].finish_reason, out.choices[0].model_extra["stop_reason"]) == ("stop", "there")
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, stop=["xyz", "there"],
                                    extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == "Hello there"


def test_stop_token_ids_and_vllm_extensions_reach_the_backend(api):
    running, client = api
    out = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=40, seed=7, temperature=0.5, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={"65": 5.0},
        extra_body={"stop_token_ids": [ord("o")], "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.1,
                    "min_tokens": 2, "skip_special_tokens": False, "ignore_eos": True})
    assert out.choices[0].text == "Hello"
    assert out.choices[0].model_extra["stop_reason"] == ord("o")
    p = next(iter(running.backend.inputs.values())).params
    assert (p.seed, p.top_k, p.min_tokens, p.stop_token_ids, p.logit_bias) == (7, 4, 2, (ord("o"),), {65: 5.0})
    assert p.temperature == pytest.approx(0.5) and p.top_p == pytest.approx(0.9) and p.min_p == pytest.approx(0.1)
    assert p.repetition_penalty == pytest.approx(1.1)
    assert (p.presence_penalty, p.frequency_penalty) == (pytest.approx(0.5), pytest.approx(-0.5))
    assert (p.skip_special_tokens, p.ignore_eos) == (False, True)


def test_completion_logprobs_shape(api):
    _, client = api
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == list("Hello")
    assert lp.token_logprobs == [pytest.approx(SEQ_LOGPROBS[0])] * 5
    assert lp.text_offset == [0, 1, 2, 3, 4]
    assert len(lp.top_logprobs) == 5
    assert lp.top_logprobs[0] == {"H": pytest.approx(-0.5), "I": pytest.approx(-1.5)}


def test_echo_with_logprobs_puts_the_prompt_first(api):
    running, client = api
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == "Hi" + "Hel"
    assert next(iter(running.backend.inputs.values())).params.prompt_logprobs == 1
    lp = choice.logprobs
    assert lp.tokens == ["<s>", "H", "i", "H", "e", "l"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:3] == [pytest.approx(-1.0), pytest.approx(-2.0)]
    assert lp.token_logprobs[3:] == [pytest.approx(-0.5)] * 3
    assert lp.text_offset == [0, 0, 1, 2, 3, 4]                  # the BOS is not in the text: it takes no room
    assert [choice.text[o:o + len(t)] for o, t in zip(lp.text_offset[1:], lp.tokens[1:])] == lp.tokens[1:]


def test_echo_streamed_sends_the_prompt_first(api):
    _, client = api
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, echo=True, stream=True))
    assert chunks[0].choices[0].text == "Hi"
    assert "".join(c.choices[0].text for c in chunks) == "HiHel"


def test_prompt_logprobs_vllm_field(api):
    _, client = api
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"prompt_logprobs": 1})
    prompt_lps = out.choices[0].model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None
    assert prompt_lps[1] == {str(ord("H")): {"logprob": pytest.approx(-1.0), "decoded_token": "H"}}
    assert len(prompt_lps) == 3


def test_best_of_keeps_the_likeliest_and_renumbers(api):
    running, client = api
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=40, n=2, best_of=4)
    assert next(iter(running.backend.inputs.values())).params.best_of == 4
    # cumulative logprob per sequence = SEQ_LOGPROBS[i] * (len(REPLIES[i]) + 1)
    scores = sorted(range(4), key=lambda i: -SEQ_LOGPROBS[i] * (len(REPLIES[i]) + 1))
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [REPLIES[scores[0]], REPLIES[scores[1]]]
    assert all(c.logprobs is None for c in out.choices)      # computed for ranking, not asked for
    assert out.usage.completion_tokens == sum(len(r) + 1 for r in REPLIES)


def test_best_of_cannot_be_streamed(api):
    _, client = api
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", n=1, best_of=2, stream=True)
    assert e.value.body["param"] == "best_of"
    assert "stream" in e.value.message


def test_chat_completion_renders_the_template_and_defaults_max_tokens(api):
    running, client = api
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "Hi"}])
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.message.content == REPLIES[0]
    assert choice.finish_reason == "stop"
    inp = next(iter(running.backend.inputs.values()))
    tokenizer = running.backend.tokenizer
    rendered = tokenizer.decode(inp.prompt_token_ids, skip_special_tokens=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\n")      # no BOS: the default template adds the config's, if any
    assert inp.params.max_tokens == running.backend.max_model_len - len(inp.prompt_token_ids)
    assert out.usage.prompt_tokens == len(inp.prompt_token_ids)


def test_chat_text_parts_are_joined_and_other_parts_refused(api):
    running, client = api
    out = client.chat.completions.create(model=MODEL, max_completion_tokens=3, messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert out.choices[0].message.content == "Hel"
    inp = next(iter(running.backend.inputs.values()))
    assert inp.params.max_tokens == 3
    assert "user\na\nb<|im_end|>" in running.backend.tokenizer.decode(inp.prompt_token_ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}])
    assert e.value.body["param"] == "messages"
    assert "image_url" in e.value.message


def test_chat_stream_role_first_then_content_and_usage(api):
    _, client = api
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=40, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    roles = [c.choices[0] for c in chunks[:2]]
    assert [(r.index, r.delta.role, r.delta.content) for r in roles] == [(0, "assistant", ""), (1, "assistant", "")]
    texts, finishes = ["", ""], [None, None]
    for c in chunks[2:-1]:
        [choice] = c.choices
        texts[choice.index] += choice.delta.content or ""
        finishes[choice.index] = choice.finish_reason or finishes[choice.index]
        assert c.usage is None
    assert texts == [REPLIES[0], REPLIES[1]] and finishes == ["stop", "stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(REPLIES[0]) + len(REPLIES[1]) + 2


def test_chat_logprobs_shape(api):
    _, client = api
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert [(c.token, c.bytes) for c in content] == [("H", [72]), ("e", [101])]
    assert content[0].logprob == pytest.approx(-0.5)
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("H", pytest.approx(-0.5)),
                                                                       ("I", pytest.approx(-1.5))]
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert out.choices[0].logprobs is None


def test_chat_top_logprobs_needs_logprobs(api):
    _, client = api
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


@pytest.mark.parametrize("kwargs, param, words", [
    ({"extra_body": {"foo": 1}}, "foo", "Unrecognized request argument supplied: foo"),
    ({"temperature": -1.0}, "temperature", "temperature must be"),
    ({"max_tokens": 1000}, "max_tokens", "max_model_len"),
    ({"max_tokens": -2}, "max_tokens", "max_tokens"),
    ({"max_tokens": 2**32}, "max_tokens", "max_tokens must be in [0, 4294967295], got 4294967296"),
    ({"extra_body": {"top_k": 10**10}}, "top_k", "top_k must be in [0, 4294967295]"),
    ({"n": 0}, "n", "n must be"),
    ({"logprobs": 25}, "logprobs", "logprobs must be"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "logit_bias"),
    ({"logit_bias": {"9999": 1.0}}, "logit_bias", "out of range"),
    ({"extra_body": {"stop_token_ids": [300]}}, "stop_token_ids", "out of range"),
    ({"seed": -1}, "seed", "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"max_tokens": "5"}, "max_tokens", "valid integer"),                  # types are not coerced, as OpenAI
    ({"extra_body": {"echo": "yes"}}, "echo", "valid boolean"),
])
def test_bad_fields_are_400_naming_the_field(api, kwargs, param, words):
    _, client = api
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert words in e.value.message


def test_bad_chat_fields_name_the_openai_parameter(api):
    _, client = api
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_completion_tokens=0)
    assert e.value.body["param"] == "max_completion_tokens" and "max_completion_tokens must be" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "Hi"}])
    assert e.value.body["param"] == "messages" and "messages[0].role" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert e.value.body["param"] == "messages"


def test_wrong_model_is_404_model_not_found(api):
    _, client = api
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="Hi")
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])


def test_models_lists_the_served_model(api):
    running, client = api
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == running.backend.max_model_len
    assert client.models.retrieve(MODEL).id == MODEL


def test_token_is_required_except_for_health(http):
    running, client = http(token="s3cret")
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text == "He"
    anonymous = openai.OpenAI(base_url=running.server.http_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        anonymous.completions.create(model=MODEL, prompt="Hi")
    assert e.value.status_code == 401 and "invalid bearer token" in e.value.message
    anonymous.close()
    r = httpx.get(running.server.http_url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["message"].startswith("missing bearer token")
    assert httpx.get(running.server.http_url + "/health").status_code == 200


def test_the_bearer_scheme_is_case_insensitive_and_the_token_is_not(http):
    """RFC 7235: `bearer` and `BEARER` name the same scheme; the credentials must match exactly."""
    running, _ = http(token="s3cret")
    url = running.server.http_url + "/v1/models"
    for good in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret", "Bearer   s3cret"):
        assert httpx.get(url, headers={"Authorization": good}).status_code == 200, good
    for bad in ("Bearer S3CRET", "Basic s3cret", "s3cret", "Bearers3cret", "Bearer", "Bearer s3cret x"):
        assert httpx.get(url, headers={"Authorization": bad}).status_code == 401, bad


def test_over_max_queue_is_429_and_shared_with_grpc(http, wait_until):
    backend = ScriptedBackend()
    backend.release.clear()
    running, client = http(backend, max_queue=1)
    held = threading.Thread(target=lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=2))
    held.start()
    wait_until(lambda: running.server.core.num_in_flight == 1)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 429 and "capacity" in e.value.message
    import grpc

    from router import generate
    with pytest.raises(grpc.RpcError) as g:
        list(generate(running.address, "Hi", max_tokens=2, timeout=10))
    assert g.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    backend.release.set()
    held.join(10)


def test_draining_is_503_and_health_follows(http, wait_until):
    backend = ScriptedBackend()
    running, client = http(backend)
    url = running.server.http_url
    assert httpx.get(url + "/health").status_code == 200
    backend.is_ready = False
    wait_until(lambda: httpx.get(url + "/health").status_code == 503)
    backend.is_ready = True
    wait_until(lambda: httpx.get(url + "/health").status_code == 200)
    running.loop.run(running.server.drain(0.1))
    assert httpx.get(url + "/health").status_code == 503
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="Hi")
    assert e.value.status_code == 503 and "draining" in e.value.message


def test_backend_error_before_first_token_gets_its_status(http):
    backend = ScriptedBackend()
    backend.fail_with = BackendError("RESOURCE_EXHAUSTED", "decode pool is full")
    _, client = http(backend)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="Hi", stream=True)
    assert "decode pool is full" in e.value.message
    backend.fail_with = BackendError("UNAVAILABLE", "no decode actor")
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 503


def test_error_mid_stream_is_an_error_event_then_done(http):
    backend = ScriptedBackend()
    backend.fail_with = BackendError("INTERNAL", "decode actor died")
    backend.fail_after = 3
    running, client = http(backend)
    received = []
    with pytest.raises(openai.APIError) as e:
        for chunk in client.completions.create(model=MODEL, prompt="Hi", max_tokens=10, stream=True):
            received.append(chunk.choices[0].text)
    assert "decode actor died" in e.value.message
    assert "".join(received) == "Hel"
    with httpx.stream("POST", running.server.http_url + "/v1/completions", timeout=10,
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 10, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "internal"


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_the_request(http, wait_until, stream):
    backend = ScriptedBackend()
    backend.release.clear()
    running, _ = http(backend)
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 10, "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", running.server.http_port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_until(lambda: len(backend.active) == 1)
    wait_until(lambda: len(backend.cancelled) == 1 and running.server.core.num_in_flight == 0)


def test_tokenize_and_detokenize(api):
    running, _ = api
    url = running.server.http_url
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "Hi"}).json()
    assert r == {"count": 3, "max_model_len": running.backend.max_model_len, "tokens": [256, 72, 105]}
    r = httpx.post(url + "/tokenize", json={"prompt": "Hi", "add_special_tokens": False}).json()
    assert r["tokens"] == [72, 105]
    r = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert running.backend.tokenizer.decode(r["tokens"]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert httpx.post(url + "/detokenize", json={"tokens": [72, 105, EOS]}).json() == {"prompt": "Hi"}
    bad = httpx.post(url + "/detokenize", json={"tokens": [999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_request_id_header_and_log_line(api, caplog):
    running, client = api
    with caplog.at_level(logging.INFO, logger="pdserve.router"):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2, user="bob",
                                                          extra_headers={"X-Request-Id": "req-42"})
    assert raw.headers["x-request-id"] == "req-42" and raw.parse().id == "cmpl-req-42"
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "request_finished"]
    assert line.fields["request_id"] == "req-42" and line.fields["api"] == "http" and line.fields["user"] == "bob"
    assert line.fields["status"] == "OK" and line.fields["completion_tokens"] == 2


def test_bad_json_and_unknown_route(api):
    running, _ = api
    url = running.server.http_url
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_duplicate_request_id_in_flight_is_409(http, wait_until):
    backend = ScriptedBackend()
    backend.release.clear()
    running, client = http(backend)
    held = threading.Thread(target=lambda: client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": "dup"}))
    held.start()
    wait_until(lambda: "dup" in backend.active)
    with pytest.raises(openai.ConflictError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": "dup"})
    assert e.value.status_code == 409 and "already in flight" in e.value.message
    backend.release.set()
    held.join(10)


def test_body_over_the_limit_is_413(http):
    running, _ = http(max_message_bytes=2048)
    r = httpx.post(running.server.http_url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 4096})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_http_requests_feed_the_same_metrics(http):
    from router.metrics import Metrics
    metrics = Metrics()
    _, client = http(metrics=metrics)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=40)
    text = metrics.exposition().decode()
    assert 'pdserve_requests_total{finish_reason="length"} 1.0' in text
    assert 'pdserve_requests_total{finish_reason="stop"} 1.0' in text
    assert "pdserve_ttft_seconds_count 2.0" in text


def _stream_in_thread(url: str, lines: list[str]) -> threading.Thread:
    def read():
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=10,
                              json={"model": MODEL, "prompt": "Hi", "max_tokens": 10, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
        except httpx.HTTPError as e:
            lines.append(f"error: {type(e).__name__}")
    thread = threading.Thread(target=read)
    thread.start()
    return thread


def test_drain_lets_an_open_stream_finish(http, wait_until):
    backend = ScriptedBackend()
    backend.pause_after = 2
    running, _ = http(backend)
    lines: list[str] = []
    reader = _stream_in_thread(running.server.http_url, lines)
    wait_until(lambda: len(lines) == 2)
    drained = running.loop.submit(running.server.drain(10))
    wait_until(lambda: httpx.get(running.server.http_url + "/health").status_code == 503)
    backend.resume.set()
    assert drained.result(10) is True
    reader.join(10)
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == REPLIES[0][:10]


def test_stop_cancels_an_open_stream_and_frees_it(http, wait_until, caplog):
    backend = ScriptedBackend()
    backend.pause_after = 2
    running, _ = http(backend)
    lines: list[str] = []
    reader = _stream_in_thread(running.server.http_url, lines)
    wait_until(lambda: len(lines) == 2)
    with caplog.at_level(logging.INFO, logger="pdserve.router"):
        running.loop.run(running.server.stop(0.2))
    reader.join(10)
    assert "data: [DONE]" not in lines
    assert len(backend.cancelled) == 1 and not backend.active and running.server.core.num_in_flight == 0
    [line] = [r for r in caplog.records if getattr(r, "event", None) == "request_finished"]
    assert line.fields["status"] == "CANCELLED" and line.fields["api"] == "http"


def test_batched_prompts_number_choices_prompt_major(api):
    running, client = api
    out = client.completions.create(model=MODEL, prompt=["Hi", [72, 105, 33]], n=2, max_tokens=40, echo=True,
                                    extra_headers={"X-Request-Id": "batch"})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == ["Hi" + REPLIES[0], "Hi" + REPLIES[1], "Hi!" + REPLIES[0],
                                             "Hi!" + REPLIES[1]]
    assert sorted(running.backend.inputs) == ["batch-0", "batch-1"]
    assert out.usage.prompt_tokens == 3 + 3
    assert out.usage.completion_tokens == 2 * (len(REPLIES[0]) + len(REPLIES[1]) + 2)


def test_batched_prompts_stream(api):
    _, client = api
    texts: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(model=MODEL, prompt=["Hi", "Yo"], max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: "Hel", 1: "Hel"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (6, 6)


def test_a_batch_stream_is_one_response_with_one_id(api):
    _, client = api
    chunks = list(client.completions.create(model=MODEL, prompt=["Hi", "Yo", [72]], max_tokens=3, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_headers={"X-Request-Id": "batch"}))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2}
    assert {(c.id, c.created) for c in chunks} == {("cmpl-batch-0", chunks[0].created)}


def test_a_batch_names_the_request_id_header_it_cannot_extend(api):
    running, client = api
    header = {"X-Request-Id": "r" * 255}                    # fits alone; "-0", "-1" make it 257 characters
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_headers=header).id == \
        "cmpl-" + "r" * 255
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=["Hi", "Yo"], max_tokens=2, extra_headers=header)
    assert e.value.body["param"] == "X-Request-Id"
    assert "batch of 2 prompts" in e.value.message and "at most 254 characters, got 255" in e.value.message
    assert running.server.core.num_in_flight == 0


def test_batch_failure_fails_the_whole_request_and_frees_every_prompt(http, wait_until):
    backend = ScriptedBackend()
    running, client = http(backend)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=["Hi", [999]], max_tokens=3)
    assert e.value.body["param"] == "prompt" and "out of range" in e.value.message
    assert running.server.core.num_in_flight == 0 and not backend.inputs
    backend.fail_with = BackendError("UNAVAILABLE", "no decode actor")
    backend.fail_after = 5
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt=["Hi", "Yo"], max_tokens=10)
    assert e.value.status_code == 503
    wait_until(lambda: not backend.active and running.server.core.num_in_flight == 0)


def test_every_refusal_is_logged_once(api, caplog):
    _, client = api
    with caplog.at_level(logging.INFO, logger="pdserve.router"):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt="Hi")
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="Hi", temperature=-1)
    lines = [r.fields for r in caplog.records if getattr(r, "event", None) == "request_rejected"]
    assert [(f["api"], f["status"]) for f in lines] == [("http", "NOT_FOUND"), ("http", "INVALID_ARGUMENT")]


def test_chat_prompt_logprobs_whole_not_streamed(api):
    running, client = api
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                         extra_body={"prompt_logprobs": 0})
    inp = next(iter(running.backend.inputs.values()))
    prompt_lps = out.model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(inp.prompt_token_ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
                                       extra_body={"prompt_logprobs": 0})
    assert e.value.body["param"] == "prompt_logprobs"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_puts_running_counts_on_every_chunk(api, endpoint):
    _, client = api
    options = {"include_usage": True, "continuous_usage_stats": True}     # what guidellm and aiperf send
    if endpoint == "chat":
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=12, stream=True, stream_options=options)
    else:
        stream = client.completions.create(model=MODEL, prompt="Hi", n=2, max_tokens=12, stream=True,
                                           stream_options=options)
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens > 0
    running = [c.usage.completion_tokens for c in chunks[:-1]]
    assert running == sorted(running) and running[-1] == final.usage.completion_tokens
    assert {c.usage.prompt_tokens for c in chunks} == {final.usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_continuous_usage_stats_without_include_usage_adds_nothing(api):
    _, client = api
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, stream=True,
                                       stream_options={"continuous_usage_stats": True})
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)


def _last_input(running):
    return list(running.backend.inputs.values())[-1]


def test_completion_add_special_tokens_false_and_truncation(api):
    running, client = api
    client.completions.create(model=MODEL, prompt="<s>Hi", max_tokens=1, extra_body={"add_special_tokens": False})
    assert _last_input(running).prompt_token_ids == [256, ord("H"), ord("i")]        # the client's own BOS, once
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, echo=True,
                                    extra_body={"truncate_prompt_tokens": 2})
    assert _last_input(running).prompt_token_ids == [ord("l"), ord("o")]
    assert out.choices[0].text.startswith("lo") and out.usage.prompt_tokens == 2
    client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert _last_input(running).prompt_token_ids == [7, 8, 9]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"truncate_prompt_tokens": 0})
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_chat_template_fields_change_the_prompt(http):
    template = ChatTemplate("{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
                            "{% if add_generation_prompt %}[assistant:{% endif %}"
                            "{% if shout %}!{% endif %}", {"bos_token": "<s>"})
    running, client = http(chat_template=template)
    decode = running.backend.tokenizer.decode
    user = {"role": "user", "content": "Hi"}

    def prompt(**extra):
        client.chat.completions.create(model=MODEL, messages=extra.pop("messages", [user]), max_tokens=1,
                                       extra_body=extra)
        ids = _last_input(running).prompt_token_ids
        return decode(ids, skip_special_tokens=False), ids

    assert prompt() == ("[user:Hi][assistant:", [ord(c) for c in "[user:Hi][assistant:"])
    assert prompt(add_generation_prompt=False)[0] == "[user:Hi]"
    assert prompt(chat_template_kwargs={"shout": True})[0] == "[user:Hi][assistant:!"
    assert prompt(add_special_tokens=True)[1][0] == 256                                # BOS added on request
    partial = [user, {"role": "assistant", "content": "Once upon"}]
    assert prompt(messages=partial, add_generation_prompt=False, continue_final_message=True)[0] == \
        "[user:Hi][assistant:Once upon"
    with pytest.raises(openai.BadRequestError) as e:
        prompt(messages=partial, continue_final_message=True)                          # both true
    assert e.value.body["param"] == "messages" and "add_generation_prompt" in e.value.body["message"]
    r = httpx.post(running.server.http_url + "/tokenize", json={
        "messages": partial, "add_generation_prompt": False, "continue_final_message": True}).json()
    assert decode(r["tokens"]) == "[user:Hi][assistant:Once upon"


def test_fields_without_effect_are_accepted_and_logged_once(api, caplog):
    running, client = api
    caplog.set_level(logging.WARNING, logger="pdserve.router")
    for _ in range(2):
        out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, suffix="!",
                                        extra_body={"store": True, "metadata": {"k": "v"}, "service_tier": "auto"})
        assert out.choices[0].text == REPLIES[0][:2]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"echo": True, "skip_special_tokens": False})
    assert chat.choices[0].message.content == REPLIES[0][:2]
    logged = [r.fields["fields"] for r in caplog.records if getattr(r, "event", "") == "fields_ignored"]
    assert logged == ["store,metadata,service_tier,suffix", "echo"]
    with pytest.raises(openai.BadRequestError) as e:                                  # unknown stays refused
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"no_such_field": 1})
    assert "Unrecognized request argument supplied: no_such_field" in e.value.body["message"]


def test_max_tokens_0_with_echo_scores_the_prompt_only(api):
    running, client = api
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=0, echo=True, logprobs=1)
    [choice] = out.choices
    assert choice.text == "Hi" and choice.finish_reason == "length"
    assert choice.logprobs.tokens == ["<s>", "H", "i"]
    assert choice.logprobs.token_logprobs == [None, pytest.approx(-1.0), pytest.approx(-2.0)]
    assert choice.logprobs.text_offset == [0, 0, 1]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 0)
    batch = client.completions.create(model=MODEL, prompt=["Hi", "Yo"], max_tokens=0, echo=True)
    assert [c.text for c in batch.choices] == ["Hi", "Yo"] and batch.usage.completion_tokens == 0
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=0, echo=True, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hi"
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "echo" in e.value.body["message"]


def test_client_gone_mid_upload_is_one_info_line(api, wait_until, caplog):
    running, client = api
    caplog.set_level(logging.INFO)
    with socket.create_connection(("127.0.0.1", running.server.http_port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\nX-Request-Id: gone-1\r\n\r\n{\"model\": ")
    wait_until(lambda: any(getattr(r, "event", "") == "client_disconnected" for r in caplog.records))
    [line] = [r for r in caplog.records if getattr(r, "event", "") == "client_disconnected"]
    assert line.levelno == logging.INFO and line.fields["request_id"] == "gone-1"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text == REPLIES[0][:2]


def test_every_refusal_is_counted_by_door_status_and_reason(http, serve, wait_until):
    """400s, 401s, 404s, 413s and the at-capacity 429 of both front doors, each in the rejected counter."""
    import grpc

    from proto.pdserve.v1 import generation_pb2 as pb
    from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
    from router.metrics import Metrics
    metrics = Metrics()
    backend = ScriptedBackend()
    backend.release.clear()                       # the first request holds the only slot
    running, client = http(backend=backend, metrics=metrics, token="s3cret", max_queue=1)
    url = running.server.http_url
    auth = {"Authorization": "Bearer s3cret"}
    holder = threading.Thread(target=lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=2))
    holder.start()
    wait_until(lambda: len(backend.inputs) == 1)
    assert httpx.post(url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "Hi"}).status_code == 429
    assert httpx.post(url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "Hi",
                                                                    "top_p": 7}).status_code == 429
    assert httpx.post(url + "/v1/completions", headers=auth, json={"model": MODEL, "bogus": 1}).status_code == 400
    assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"}).status_code == 401
    assert httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer no"}, json={}).status_code == 401
    assert httpx.get(url + "/v1/models/other", headers=auth).status_code == 404
    assert httpx.get(url + "/v1/nowhere", headers=auth).status_code == 404
    assert httpx.post(url + "/v1/completions", headers=auth, content=b"x" * (5 << 20)).status_code == 413
    with grpc.insecure_channel(running.server.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="Hi")))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="Hi"), metadata=[("authorization", "Bearer s3cret")]))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    backend.release.set()
    holder.join(10)
    text = metrics.exposition().decode()

    def count(api, status, reason):
        line = f'pdserve_rejected_requests_total{{api="{api}",reason="{reason}",status="{status}"}}'
        return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)), 0.0)
    assert count("http", "RESOURCE_EXHAUSTED", "capacity") == 2          # room is checked before the fields
    assert count("http", "INVALID_ARGUMENT", "invalid_input") == 1
    assert count("http", "UNAUTHENTICATED", "missing_token") == 1
    assert count("http", "UNAUTHENTICATED", "invalid_token") == 1
    assert count("http", "NOT_FOUND", "unknown_model") == 1
    assert count("http", "NOT_FOUND", "unknown_route") == 1
    assert count("http", "INVALID_ARGUMENT", "body_too_large") == 1
    assert count("grpc", "UNAUTHENTICATED", "missing_token") == 1
    assert count("grpc", "RESOURCE_EXHAUSTED", "capacity") == 1


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_schema_text_nested_too_deep_for_json_is_a_400(api, endpoint):
    running, client = api
    deep = '{"type": "array", "items": ' * 1100 + "{}" + "}" * 1100      # under the size limit, over json's depth
    body = {"model": MODEL, "max_tokens": 2, "guided_json": deep,
            **({"prompt": "Hi"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "Hi"}]})}
    r = httpx.post(f"{running.server.http_url}/v1/{endpoint}", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_json" and "nested too deeply" in r.json()["error"]["message"]
    assert running.server.core.num_in_flight == 0
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text == REPLIES[0][:2]


def test_a_schema_text_nested_too_deep_for_json_is_invalid_argument_over_grpc(api):
    import grpc

    from proto.pdserve.v1 import generation_pb2 as pb
    from proto.pdserve.v1 import generation_pb2_grpc as pb_grpc
    running, _ = api
    deep = '{"type": "array", "items": ' * 1100 + "{}" + "}" * 1100
    request = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(
        max_tokens=2, structured=pb.StructuredOutput(json_schema=deep)))
    with grpc.insecure_channel(running.server.address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.GenerationServiceStub(channel).Generate(request))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nested too deeply" in e.value.details()


class _ThreadRecordingTokenizer(SpecialByteTokenizer):
    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize("content", [
    "a" * 9000,
    [{"type": "text", "text": "a" * 4500}, {"type": "text", "text": "b" * 4500}],     # parts count as well
])
def test_a_long_chat_prompt_is_tokenized_off_the_event_loop(http, content):
    backend = ScriptedBackend(max_model_len=16384)
    backend.tokenizer = _ThreadRecordingTokenizer()
    running, client = http(backend)

    async def loop_thread() -> int:
        return threading.get_ident()
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2)
    assert out.choices[0].message.content == REPLIES[0][:2] and out.usage.prompt_tokens > 9000
    assert backend.tokenizer.threads and running.loop.run(loop_thread()) not in backend.tokenizer.threads
