"""ChatTemplate renders exactly what transformers' apply_chat_template(tokenize=False,
add_generation_prompt=True) renders, from the same model directory's tokenizer_config.json."""
from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from router.openai_api import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError

transformers = pytest.importorskip("transformers")

LLAMA3_STYLE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_QWEN_STYLE = """{%- for message in messages %}
    {%- if loop.first and messages[0]['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
MISTRAL_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# Block tags on their own lines: trim_blocks / lstrip_blocks decide every newline and indent.
PLAIN_BLOCKS = """{% for message in messages %}
    {% if message.role == 'system' %}
[SYS] {{ message.content }}
    {% else %}
{{ message.role }}: {{ message.content }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
assistant:{% endif %}"""
TOJSON_AND_TIME = (
    "{{ bos_token }}Year {{ strftime_now('%Y') }}\n{% for m in messages %}{{ m | tojson }}\n"
    "{{ m.content | tojson(indent=2) }}\n{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "  You are terse & <polite>.  "},
    {"role": "user", "content": "Héllo, what's 2+2?\n"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And \"3+3\"?"},
]


def _model_dir(tmp_path, chat_template, **config) -> str:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", **config}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return str(tmp_path)


def _transformers_render(model_dir: str, messages) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("template", [LLAMA3_STYLE, CHATML_QWEN_STYLE, PLAIN_BLOCKS, TOJSON_AND_TIME],
                         ids=["llama3", "chatml-qwen", "plain-blocks", "tojson-strftime"])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:2]], ids=["conversation", "one-user"])
def test_renders_as_transformers(tmp_path, template, messages):
    model_dir = _model_dir(tmp_path, template)
    ours = ChatTemplate.from_model_dir(model_dir).render(messages)
    assert ours == _transformers_render(model_dir, messages)


def test_mistral_style_renders_and_raises_as_transformers(tmp_path):
    model_dir = _model_dir(tmp_path, MISTRAL_STYLE)
    template = ChatTemplate.from_model_dir(model_dir)
    good = CONVERSATION[1:]
    assert template.render(good) == _transformers_render(model_dir, good) == \
        "<s>[INST] Héllo, what's 2+2?\n [/INST]4.</s>[INST] And \"3+3\"? [/INST]"
    with pytest.raises(ChatTemplateError) as ours:
        template.render(CONVERSATION)                     # a system message: the template refuses it
    with pytest.raises(Exception) as theirs:
        _transformers_render(model_dir, CONVERSATION)
    assert str(ours.value) == str(theirs.value) == "Conversation roles must alternate user/assistant/user/assistant/..."


def test_named_templates_use_default_and_added_token_objects(tmp_path):
    model_dir = _model_dir(tmp_path, [{"name": "tool_use", "template": "TOOLS"},
                                      {"name": "default", "template": LLAMA3_STYLE}],
                           bos_token={"content": "<s>", "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "__type": "AddedToken"})
    ours = ChatTemplate.from_model_dir(model_dir).render(CONVERSATION)
    assert ours.startswith("<s><|start_header_id|>system")
    assert ours == _transformers_render(model_dir, CONVERSATION)


def test_chat_template_jinja_file_wins(tmp_path):
    model_dir = _model_dir(tmp_path, "FROM CONFIG")
    (tmp_path / "chat_template.jinja").write_text(CHATML_QWEN_STYLE, encoding="utf-8")
    ours = ChatTemplate.from_model_dir(model_dir).render(CONVERSATION[1:2])
    assert ours == _transformers_render(model_dir, CONVERSATION[1:2])
    assert ours.startswith("<|im_start|>system\nYou are a helpful assistant.")


def test_default_template_is_chatml_with_bos(tmp_path):
    template = ChatTemplate.from_model_dir(_model_dir(tmp_path, None))
    assert template.is_default and template.source == DEFAULT_CHAT_TEMPLATE
    assert template.render([{"role": "user", "content": "hi"}]) == \
        "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ChatTemplate.from_model_dir(None).render([{"role": "user", "content": "hi"}]).startswith("<|im_start|>")


def test_sandbox_refuses_unsafe_attribute_access(tmp_path):
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "hi"}])


def test_broken_template_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.from_model_dir(_model_dir(tmp_path, "{% for m in messages %}"))


def test_template_files_saved_by_transformers_are_used_with_and_without_tools(tmp_path):
    """transformers >= 4.50 saves named templates as chat_template.jinja + additional_chat_templates/tool_use.jinja
    (and nothing in tokenizer_config.json); a request with tools renders the tool_use one, as apply_chat_template."""
    saved = str(tmp_path / "saved")
    tok = transformers.AutoTokenizer.from_pretrained(_model_dir(tmp_path, "FROM CONFIG"))
    tok.chat_template = {"default": LLAMA3_STYLE,
                         "tool_use": "TOOLS {{ tools | length }} {% for m in messages %}{{ m.content }}{% endfor %}"}
    tok.save_pretrained(saved)
    assert os.path.isfile(os.path.join(saved, "additional_chat_templates", "tool_use.jinja"))
    template = ChatTemplate.from_model_dir(saved)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    hf = transformers.AutoTokenizer.from_pretrained(saved)
    for with_tools in (None, tools):
        ours = template.render(CONVERSATION, tools=with_tools)
        assert ours == hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True,
                                              tools=with_tools)
    assert template.render(CONVERSATION, tools=tools).startswith("TOOLS 1 ")
