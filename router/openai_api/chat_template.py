"""Chat templates: a model directory's jinja template, rendered as transformers renders it.

`ChatTemplate.from_model_dir` reads ``tokenizer_config.json``: ``chat_template`` (a string, or a
list of ``{"name", "template"}`` of which "default" is used), and the special tokens the template
may name (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ... as strings or as
``{"content": ...}`` added-token objects). Template files, where there are any, win, as in
transformers: ``chat_template.jinja`` beside it, and named ones (``tool_use``) in
``additional_chat_templates/``. `ChatTemplate.render` is ``apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)``: an immutable sandboxed jinja environment with ``trim_blocks`` and
``lstrip_blocks``, the loop-control extension, ``raise_exception``, ``strftime_now``, and a
``tojson`` that does not HTML-escape (``json.dumps(..., ensure_ascii=False)``).

Tools reach the template as ``apply_chat_template(tools=...)`` passes them: ``tools`` is the list of
OpenAI tool definitions (None without tools), and a named ``tool_use`` template is used for requests
with tools when the model has one (as transformers picks it).

Models without a template get `DEFAULT_CHAT_TEMPLATE`, ChatML (``<|im_start|>role\\ncontent
<|im_end|>\\n`` per message, then ``<|im_start|>assistant\\n``), prefixed with the BOS token when
the tokenizer config defines one; with tools it is Qwen2.5's (Hermes) tool format: the tools in a
system turn, an assistant's calls as ``<tool_call>`` blocks, tool results as ``<tool_response>`` in a
user turn. The rendered text is tokenized without adding special tokens (the template holds the BOS).
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}{{ '<|im_start|>assistant' }}"
    "{% if message['content'] %}{{ '\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}{{ '\n<tool_call>\n{\"name\": \"' + call['function']['name'] + "
    "'\", \"arguments\": ' + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the messages (``raise_exception``) or failed to render them."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '); chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with.

    Args:
        source: the jinja template text.
        special_tokens: ``bos_token`` etc. → their text (what the template sees).
        is_default: True when the model had no template of its own.
        tool_source: the model's ``tool_use`` template, used for requests with tools (None: ``source``).
    """

    def __init__(self, source: str, special_tokens: dict[str, object] | None = None,
                 is_default: bool = False, tool_source: str | None = None) -> None:
        self.source = source
        self.tool_source = tool_source
        self.special_tokens = dict(special_tokens or {})
        self.is_default = is_default
        self._template = _environment().from_string(source)
        self._tool_template = _environment().from_string(tool_source) if tool_source else self._template

    @classmethod
    def from_model_dir(cls, model_dir: str | None) -> ChatTemplate:
        """The template of ``model_dir`` (`DEFAULT_CHAT_TEMPLATE` without one, or without a directory).

        Raises:
            ValueError: ``tokenizer_config.json`` is not JSON, or its template does not compile.
        """
        config: dict[str, Any] = {}
        path = os.path.join(model_dir, "tokenizer_config.json") if model_dir else None
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        special: dict[str, object] = {}
        for key in SPECIAL_TOKEN_KEYS:
            text = _token_text(config.get(key))
            if text is not None:
                special[key] = text
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            special["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
        source = _template_source(config.get("chat_template"))
        tool_source = _template_source(config.get("chat_template"), "tool_use")
        files = _template_files(model_dir) if model_dir else {}
        if files:           # as in transformers: template files, where there are any, replace the config's
            source, tool_source = files.get("default"), files.get("tool_use")
        try:
            if source is None:
                return cls(DEFAULT_CHAT_TEMPLATE, special, is_default=True)
            return cls(source, special, tool_source=tool_source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{path}: chat_template does not compile: {e}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, extra: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and ``content``, as the template reads them).

        Args:
            add_generation_prompt: end with the template's opening of an assistant turn.
            continue_final_message: end inside the final message, right after its content, so
                the model continues it (vLLM's prefill of a partial answer); needs
                ``add_generation_prompt`` False.
            extra: further template variables (``chat_template_kwargs``: ``enable_thinking``, ...).
            tools: OpenAI tool definitions (``{"type": "function", "function": {...}}``), as transformers
                passes them; None without tools.

        Raises:
            ChatTemplateError: the template raised (``raise_exception``) or failed on these messages,
                or the final message's content is not in the rendered text.
        """
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
        variables = {**self.special_tokens, **(extra or {}), "messages": messages, "tools": tools or None,
                     "documents": None, "add_generation_prompt": add_generation_prompt}
        template = self._tool_template if tools else self._template
        try:
            text = template.render(**variables)
        except jinja2.TemplateError as e:       # raise_exception, undefined names, sandbox refusals
            raise ChatTemplateError(str(e) or type(e).__name__) from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from None
        if not continue_final_message:
            return text
        final = messages[-1]["content"] if messages else ""
        end = text.rfind(final) if final else -1
        if end < 0:
            raise ChatTemplateError("continue_final_message: the final message's content is not in the "
                                    "rendered prompt, so it cannot be continued")
        return text[:end + len(final)]


def _template_files(model_dir: str) -> dict[str, str]:
    """Templates saved as files (transformers >= 4.50), by name: ``chat_template.jinja`` is "default",
    ``additional_chat_templates/<name>.jinja`` the named ones (``tool_use``)."""
    paths = {"default": os.path.join(model_dir, "chat_template.jinja")}
    extra_dir = os.path.join(model_dir, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        paths.update({n.removesuffix(".jinja"): os.path.join(extra_dir, n)
                      for n in sorted(os.listdir(extra_dir)) if n.endswith(".jinja")})
    files = {}
    for name, path in paths.items():
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                files[name] = f.read()
    return files


def _template_source(value: object, name: str = "default") -> str | None:
    """``chat_template`` as tokenizer_config.json holds it: a string (the default), or named templates."""
    if isinstance(value, str):
        return value if name == "default" else None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get(name)
        return template if isinstance(template, str) else None
    return None
