"""How the HTTP front door is set up: the config key and CLI flag, TLS, the model's chat template,
bind errors, and that stop() closes it."""
from __future__ import annotations

import json
import ssl

import httpx
import openai
import pytest
from openai_support import REPLIES, ScriptedBackend
from tls_support import make_certs

from deploy.cli import build_parser, config_from_args
from deploy.config import ConfigError
from router import TLSConfig, start_server
from router.openai_api import served_model_name

MISTRAL_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def _cfg(*argv):
    return config_from_args(build_parser().parse_args(["serve", *argv])).server


def test_http_port_config_and_flag():
    assert _cfg().http_port == 8000
    assert _cfg("--http-port", "0").http_port == 0
    assert _cfg("--http-port", "9001").http_port == 9001
    assert _cfg("--http-port", "none").http_port is None
    assert _cfg("--set", "server.http_port=none").http_port is None
    with pytest.raises(ConfigError, match="server.http_port"):
        _cfg("--http-port", "50051")
    with pytest.raises(ConfigError, match="server.http_port"):
        _cfg("--http-port", "70000")


def test_served_model_name():
    assert served_model_name("small") == "small"
    assert served_model_name("/models/Llama-3-8B-Instruct/") == "Llama-3-8B-Instruct"


def test_model_directory_template_is_used_and_its_refusal_is_400(serve, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": MISTRAL_STYLE}))
    backend = ScriptedBackend()
    running = serve(backend, http_port=0, model_name="m", model_dir=str(tmp_path))
    with openai.OpenAI(base_url=running.server.http_url + "/v1", api_key="x", max_retries=0) as client:
        out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert out.choices[0].message.content == REPLIES[0][:3]
        inp = next(iter(backend.inputs.values()))
        # rendered "<s>[INST] Hi [/INST]", tokenized without adding another BOS
        assert backend.tokenizer.decode(inp.prompt_token_ids, skip_special_tokens=False) == "<s>[INST] Hi [/INST]"
        assert inp.prompt_token_ids.count(256) == 1
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=[{"role": "assistant", "content": "Hi"}])
        assert e.value.body["param"] == "messages" and "must alternate" in e.value.message


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_https_with_the_grpc_tls_files(serve, certs):
    tls = TLSConfig(certs / "server.pem", certs / "server.key")
    running = serve(ScriptedBackend(), http_port=0, model_name="m", tls=tls, token="t0k")
    url = running.server.http_url
    assert url.startswith("https://127.0.0.1:")
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    with httpx.Client(verify=context) as http_client:
        with openai.OpenAI(base_url=url + "/v1", api_key="t0k", max_retries=0, http_client=http_client) as client:
            assert client.completions.create(model="m", prompt="Hi", max_tokens=2).choices[0].text == "He"
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https", "http") + "/health", timeout=5)


def test_mutual_tls_refuses_a_client_without_certificate(serve, certs):
    tls = TLSConfig(certs / "server.pem", certs / "server.key", certs / "ca.pem")
    running = serve(ScriptedBackend(), http_port=0, model_name="m", tls=tls)
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    with pytest.raises(httpx.HTTPError):
        httpx.get(running.server.http_url + "/health", verify=context, timeout=5)
    context.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
    assert httpx.get(running.server.http_url + "/health", verify=context, timeout=5).status_code == 200


def test_busy_http_port_fails_the_start(serve, loop_thread):
    running = serve(ScriptedBackend(), http_port=0, model_name="m")
    with pytest.raises(OSError, match="could not bind HTTP"):
        loop_thread.run(start_server(ScriptedBackend(), port=0, http_port=running.server.http_port))


def test_stop_closes_the_http_port(serve, loop_thread):
    running = serve(ScriptedBackend(), http_port=0, model_name="m")
    url = running.server.http_url
    assert httpx.get(url + "/health").status_code == 200
    loop_thread.run(running.server.stop(0))
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
