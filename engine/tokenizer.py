"""Tokenizer (a `tokenizer.json` via `tokenizers`) and the incremental detokenizer."""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """encode/decode plus the ids the engine needs (eos, bos, vocab size)."""

    def __init__(self, model_dir: str, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None):
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: model directory has no tokenizer.json")
        self._tok = _HFTokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        self.add_bos = False
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                self.add_bos = bool(json.load(f).get("add_bos_token", False))

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens=False` adds no BOS (a chat template already has it)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; `skip_special_tokens=False` keeps special tokens (e.g. `</s>`) in it."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


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
