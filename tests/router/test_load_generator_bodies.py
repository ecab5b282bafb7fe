"""The request bodies that guidellm and aiperf send, replayed byte for byte against the HTTP front door.

Each body below was captured from the tool itself (a logging proxy on 127.0.0.1 in front of
``pdserve serve``, see docs/benchmarks/load-generators.md), key order kept, and is sent compact as
the tools send it. The router runs over `ScriptedBackend` (tests/router/openai_support.py): every
body asks ``ignore_eos`` and 32 tokens, so the answer is REPLIES[0], its EOS (a token with no
text), then "." until 32 tokens, one token per chunk. The chat template is pydoc's, the model the
tools ran against.
"""
from __future__ import annotations

import json

import httpx
import pytest
from openai_support import REPLIES, ScriptedBackend

from router.openai_api.chat_template import ChatTemplate

MODEL = "pydoc"
NUM_OUTPUT_TOKENS = 32
EXPECTED_TEXT = REPLIES[0] + "." * (NUM_OUTPUT_TOKENS - len(REPLIES[0]) - 1)     # the EOS token has no text
PYDOC_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] | trim }}\n\n{% endfor %}"

GUIDELLM_TEXT = ("1 0 m0 Finish medical want almost away until. Its culture song reveal return finally affect.\n"
                 "Push page seem quickly actually memory than. Them business subject media audience executive "
                 "everybody.\n")

# guidellm 0.8.1, `guidellm run --backend kind=openai_http,...,request_format=/v1/completions`
GUIDELLM_COMPLETIONS = {
    "model": "pydoc", "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_tokens": 32, "ignore_eos": True, "prompt": GUIDELLM_TEXT}

# guidellm 0.8.1, `guidellm run --backend kind=openai_http,...,request_format=/v1/chat/completions`
GUIDELLM_CHAT = {
    "model": "pydoc", "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "max_completion_tokens": 32, "ignore_eos": True,
    "messages": [{"role": "user", "content": [{"type": "text", "text": GUIDELLM_TEXT}]}]}

# aiperf 0.13.0, `aiperf profile --endpoint-type chat --streaming --use-server-token-count --per-chunk-usage
# --extra-inputs ignore_eos:true --osl 32 ...`
AIPERF_CHAT = {
    "messages": [{"role": "user", "content": " MESSENGER Gracious madam I that do bring the news made not the "
                                              "match CLEOPATRA Say tis not so a province I will give thee And "
                                              "make thy fortunes proud The blow th"}],
    "model": "pydoc", "stream": True, "max_completion_tokens": 32, "ignore_eos": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

# aiperf 0.13.0, `aiperf profile --endpoint-type completions --streaming --use-server-token-count
# --extra-inputs ignore_eos:true --osl 32 ...` (aiperf asks per-chunk usage on chat only)
AIPERF_COMPLETIONS = {
    "prompt": " steel my lances point That it may enter Mowbrays waxen coat And furbish new the name of John o "
              "Gaunt Even in the lusty haviour of his son GAUNT God in thy",
    "model": "pydoc", "stream": True, "max_tokens": 32, "ignore_eos": True,
    "stream_options": {"include_usage": True}}

GUIDELLM_HEADERS = {"Accept": "*/*", "Content-Type": "application/json", "User-Agent": "python-httpx/0.29.0"}
AIPERF_HEADERS = {"Accept": "text/event-stream", "Content-Type": "application/json", "User-Agent": "aiperf/0.13.0",
                  "X-Request-ID": "34e7d16f-3612-4ccd-a157-e2689e08d214"}

CASES = {
    "guidellm-completions": ("/v1/completions", GUIDELLM_COMPLETIONS, GUIDELLM_HEADERS),
    "guidellm-chat": ("/v1/chat/completions", GUIDELLM_CHAT, GUIDELLM_HEADERS),
    "aiperf-chat": ("/v1/chat/completions", AIPERF_CHAT, AIPERF_HEADERS),
    "aiperf-completions": ("/v1/completions", AIPERF_COMPLETIONS, AIPERF_HEADERS),
}


@pytest.fixture
def router(serve):
    """A ready router with HTTP on a free port over `ScriptedBackend`, pydoc's chat template."""
    template = ChatTemplate(PYDOC_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    return serve(ScriptedBackend(), http_port=0, model_name=MODEL, chat_template=template)


def _expected_prompt_ids(body: dict) -> list[int]:
    """What the byte tokenizer makes of the body's prompt: BOS + UTF-8 bytes (chat: pydoc's template)."""
    if "prompt" in body:
        return [256] + list(body["prompt"].encode())
    content = body["messages"][0]["content"]
    text = content if isinstance(content, str) else "\n".join(part["text"] for part in content)
    return [256] + list((text.strip() + "\n\n").encode())


def _replay(router, path: str, body: dict, headers: dict) -> tuple[httpx.Headers, list[dict]]:
    """POST the body as the tool sends it (compact JSON) → (response headers, the stream's events), after
    checking the stream's framing."""
    raw = json.dumps(body, separators=(",", ":")).encode()
    with httpx.stream("POST", router.server.http_url + path, content=raw, headers=headers, timeout=10) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: {") for line in lines[:-1])
    return r.headers, [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("case", list(CASES))
def test_load_generator_body_streams_32_tokens_with_usage(router, case):
    path, body, headers = CASES[case]
    response_headers, events = _replay(router, path, body, headers)
    chat = path.endswith("chat/completions")
    prompt_ids = _expected_prompt_ids(body)

    # the backend got the prompt and the limits the tool asked for
    [inp] = router.backend.inputs.values()
    assert inp.prompt_token_ids == prompt_ids
    assert (inp.params.max_tokens, inp.params.ignore_eos, inp.params.num_sequences) == (NUM_OUTPUT_TOKENS, True, 1)
    if "X-Request-ID" in headers:                       # aiperf's id becomes the request's id, echoed back
        assert inp.request_id == response_headers["X-Request-Id"] == headers["X-Request-ID"]

    # one stream: same id and model throughout, the OpenAI chunk object
    assert {e["id"] for e in events} == {events[0]["id"]}
    assert {e["model"] for e in events} == {MODEL}
    assert {e["object"] for e in events} == {"chat.completion.chunk" if chat else "text_completion"}

    *content, final = events
    assert final["choices"] == []
    assert final["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": NUM_OUTPUT_TOKENS,
                              "total_tokens": len(prompt_ids) + NUM_OUTPUT_TOKENS,
                              "prompt_tokens_details": {"cached_tokens": 2}}      # ScriptedBackend's count
    choices = [c for e in content for c in e["choices"]]
    assert {c["index"] for c in choices} == {0}
    if chat:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") for c in choices)
    else:
        text = "".join(c["text"] for c in choices)
    assert text == EXPECTED_TEXT
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]

    continuous = body["stream_options"].get("continuous_usage_stats", False)
    if not continuous:
        assert all(e["usage"] is None for e in content)
        return
    # usage on every chunk: the counts so far, one token per chunk, the prompt's count throughout
    running = [e["usage"]["completion_tokens"] for e in content]
    first = 0 if chat else 1                            # chat opens with the role chunk, before any token
    assert running == list(range(first, NUM_OUTPUT_TOKENS + 1))
    assert all(e["usage"]["prompt_tokens"] == len(prompt_ids) for e in content)
    assert all(e["usage"]["total_tokens"] == len(prompt_ids) + e["usage"]["completion_tokens"] for e in content)


def test_health_probe_guidellm_sends_before_a_run(router):
    r = httpx.get(router.server.http_url + "/health", headers=GUIDELLM_HEADERS, timeout=10)
    assert r.status_code == 200
