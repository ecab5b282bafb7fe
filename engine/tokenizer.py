"""Tokenizer (a `tokenizer.json` via `tokenizers`) and the incremental detokenizer.

Prompts are encoded as `AutoTokenizer.from_pretrained(dir)(prompt)` does. A directory whose
tokenizer_config.json names the generic class (PreTrainedTokenizerFast, TokenizersBackend, or
none) is served from tokenizer.json as it stands, as transformers does: the special tokens
added are those of its post-processor (Llama-3's TemplateProcessing prepends
<|begin_of_text|>, Qwen's and GPT-2's ByteLevel one adds none). A named class (LlamaTokenizerFast,
Qwen2Tokenizer, ...) may rebuild parts of the pipeline in transformers (transformers 5's Llama
class swaps the normaliser for a Metaspace pre-tokenizer; transformers 4's rebuilt the
post-processor from `add_bos_token`), so for those the pipeline is taken from the installed
transformers' AutoTokenizer when it can be, else from tokenizer.json with a warning.
"""
from __future__ import annotations

import json
import logging
import os

from tokenizers import Tokenizer as _HFTokenizer

from engine.unreadable_file import unreadable

log = logging.getLogger(f"pdserve.{__name__}")

GIL_FREE_CHARS = 4096   # texts this long are encoded with the GIL released (`Tokenizer.encode`)
# tokenizer_config.json classes transformers loads from tokenizer.json unchanged.
GENERIC_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")


class Tokenizer:
    """encode/decode plus the ids the engine needs (eos, bos, vocab size)."""

    def __init__(self, model_dir: str, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: model directory has no tokenizer.json")
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        tok_cfg = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                try:
                    tok_cfg = json.load(f)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
            if not isinstance(tok_cfg, dict):
                raise ValueError(f"{cfg_path}: expected a JSON object")
        self._tok = _pipeline(model_dir, path, tok_cfg.get("tokenizer_class"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._max_token_chars: int | None = None
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        # Whether encode() prepends the BOS: what the post-processor does to a short text.
        special, plain = (self._tok.encode("a", add_special_tokens=flag).ids for flag in (True, False))
        self.add_bos = bos_token_id is not None and len(special) > len(plain) and special[0] == bos_token_id
        wanted = tok_cfg.get("add_bos_token")
        if wanted is not None and bool(wanted) != self.add_bos:
            log.warning("%s: add_bos_token is %s but the tokenizer's post-processor %s the BOS; prompts get "
                        "what AutoTokenizer gives them (transformers >= 5 reads the BOS from tokenizer.json)",
                        cfg_path, wanted, "adds" if self.add_bos else "does not add")

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens tokenizer.json's post-processor adds;
        `add_special_tokens=False` adds none (a chat template already has its BOS).

        A long text goes through ``encode_batch``, which releases the GIL (``encode`` holds it), so
        tokenizing it on a worker thread never stalls the event loop's other requests."""
        if len(text) >= GIL_FREE_CHARS:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for: the longest token in the vocabulary
        (a byte-level token's string is at least as long as the text it decodes to)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def to_json(self) -> str:
        """The pipeline encode/decode run, as tokenizer.json text (a grammar library builds its vocabulary from it)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; `skip_special_tokens=False` keeps special tokens (e.g. `</s>`) in it."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _pipeline(model_dir: str, path: str, tokenizer_class: str | None) -> _HFTokenizer:
    """The `tokenizers` pipeline AutoTokenizer runs for this directory (see the module docstring)."""
    if tokenizer_class in GENERIC_CLASSES:
        return _from_file(path)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        log.warning("%s: tokenizer_class %s may encode differently in transformers (not installed here); "
                    "using tokenizer.json as it stands", model_dir, tokenizer_class)
        return _from_file(path)
    try:
        backend = AutoTokenizer.from_pretrained(model_dir).backend_tokenizer
    except Exception as e:       # custom code, a slow-only class, a missing extra: fall back, loudly
        log.warning("%s: AutoTokenizer could not load tokenizer_class %s (%s); using tokenizer.json as it stands",
                    model_dir, tokenizer_class, e)
        return _from_file(path)
    return _HFTokenizer.from_str(backend.to_str())


def _from_file(path: str) -> _HFTokenizer:
    """tokenizer.json as a `tokenizers` pipeline; ValueError naming the file where it is not one (a Git LFS
    pointer left by a clone without git-lfs, a cut download, a format newer than the installed tokenizers)."""
    try:
        return _HFTokenizer.from_file(path)
    except Exception as e:          # tokenizers raises a bare Exception ("expected value at line 1 column 1")
        raise unreadable(path, "tokenizer.json", e) from None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never half a UTF-8 character.

    Decodes only a short window: tokens since the last emitted boundary
    (`prefix_offset`..end) against the same window without the unread tokens.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int, final: bool = False) -> str:
        self.ids.append(token_id)
        return self._delta(final)

    def flush(self) -> str:
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        dec, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip)
        full = dec(self.ids[self.prefix_offset:], skip)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""
