"""The HTTP front door with the engine's own Tokenizer (a byte-level BPE model directory): chat prompts
tokenize to exactly transformers' apply_chat_template(tokenize=True) ids, completions get the BOS,
logprob token texts are the tokens' own text."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai_support import ScriptedBackend
from tokenizers import processors

from engine.model.presets import build_tokenizer
from engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

LLAMA3_STYLE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Colour of snow?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe-model")
    tok = build_tokenizer(400)        # Llama-3 style: tokenizer.json's post-processor prepends the BOS
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "bos_token": "<s>",
        "eos_token": "</s>", "chat_template": LLAMA3_STYLE}))
    return str(path)


@pytest.fixture
def running(serve, model_dir):
    backend = ScriptedBackend()
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    backend.tokenizer = Tokenizer(model_dir, eos_token_ids=(hf.eos_token_id,), bos_token_id=hf.bos_token_id)
    return serve(backend, http_port=0, model_name="bpe", model_dir=model_dir), hf


def test_chat_prompt_ids_equal_transformers(running):
    run, hf = running
    with openai.OpenAI(base_url=run.server.http_url + "/v1", api_key="x", max_retries=0) as client:
        client.chat.completions.create(model="bpe", messages=MESSAGES, max_tokens=2)
    inp = next(iter(run.backend.inputs.values()))
    expected = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert inp.prompt_token_ids == list(expected)
    assert inp.prompt_token_ids.count(hf.bos_token_id) == 1          # the template's BOS only
    r = httpx.post(run.server.http_url + "/tokenize", json={"messages": MESSAGES}).json()
    assert r["tokens"] == list(expected)


def test_completion_prompt_gets_the_bos_and_logprob_texts_are_token_texts(running):
    run, hf = running
    with openai.OpenAI(base_url=run.server.http_url + "/v1", api_key="x", max_retries=0) as client:
        out = client.completions.create(model="bpe", prompt="snow is white", max_tokens=3, logprobs=1, echo=True)
    inp = next(iter(run.backend.inputs.values()))
    plain = hf("snow is white", add_special_tokens=False)["input_ids"]
    assert inp.prompt_token_ids == [hf.bos_token_id] + plain == hf("snow is white")["input_ids"]
    tokens = out.choices[0].logprobs.tokens
    assert tokens[0] == "<s>"
    assert tokens[:len(inp.prompt_token_ids)] == [hf.decode([t]) for t in inp.prompt_token_ids]
    assert "".join(tokens[1:len(inp.prompt_token_ids)]) == "snow is white"


def test_a_prompt_too_long_for_any_context_is_refused_unread_and_stalls_nothing(running):
    """Multi-megabyte prompts (under the body limit) are refused from their length, through every door
    that tokenizes, while the event loop keeps answering others."""
    import threading
    import time

    from engine.tokenizer import GIL_FREE_CHARS
    run, _ = running
    run.backend.max_model_len = 4096                 # room for a long prompt that fits
    url = run.server.http_url
    huge = "word " * 700_000                                          # 3.5 MB
    gaps, done = [], threading.Event()

    def ping():
        with httpx.Client() as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get(url + "/health").status_code == 200
                gaps.append(time.monotonic() - started)
    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        bodies = [("/v1/completions", {"model": "bpe", "prompt": huge, "max_tokens": 1}, "prompt"),
                  ("/v1/chat/completions", {"model": "bpe", "messages": [{"role": "user", "content": huge}]},
                   "messages"),
                  ("/tokenize", {"prompt": huge}, "prompt")]
        for path, body, param in bodies:
            r = httpx.post(url + path, json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "characters is more than max_model_len" in r.json()["error"]["message"]
        fits = "snow " * (GIL_FREE_CHARS // 5 + 10)                       # long, but a prompt: tokenized
        r = httpx.post(url + "/tokenize", json={"prompt": fits})
        assert r.status_code == 200 and r.json()["count"] > GIL_FREE_CHARS // 10
        assert r.json()["tokens"] == run.backend.tokenizer._tok.encode(fits).ids   # encode_batch = encode
    finally:
        done.set()
        pinger.join()
    assert gaps and max(gaps) < 0.2, f"the event loop stalled {max(gaps):.2f} s"
