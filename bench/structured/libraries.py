"""One adapter per grammar library, so the benchmark drives each the same way.

Every adapter turns a tokenizer.json into the library's vocabulary (`setup`, once per tokenizer),
compiles a spec (`compile`: kinds json_schema, json_object, regex, grammar — GBNF syntax), makes
per-sequence matchers from a compiled spec, fills one int32 bitmask row per matcher (bit t of row r:
token t allowed; the layout all three libraries share) and advances each matcher by one token.
Libraries with a batch API (a thread pool in native code) get it; the thread count is the same for all.
"""
from __future__ import annotations

import importlib.metadata
import json

import torch

from bench.structured.vocab import Vocab


class Unsupported(Exception):
    """The library cannot express this kind of spec at all."""


class Library:
    name = ""
    package = ""

    def __init__(self, threads: int):
        self.threads = threads

    @property
    def version(self) -> str:
        return importlib.metadata.version(self.package)

    def setup(self, vocab: Vocab) -> None:
        raise NotImplementedError

    def compile(self, kind: str, text: str):
        raise NotImplementedError

    def matchers(self, compiled, n: int) -> list:
        raise NotImplementedError

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        """bitmask: [len(matchers), ceil(V / 32)] int32, row r for matchers[r]."""
        raise NotImplementedError

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        raise NotImplementedError


class LLGuidance(Library):
    name, package = "llguidance", "llguidance"

    def setup(self, vocab: Vocab) -> None:
        import llguidance
        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.vocab_size,
                                                eos_token=vocab.eos_token_id)
        self.executor = llguidance.LLExecutor(num_threads=self.threads)

    def compile(self, kind: str, text: str):
        fmt = {"json_object": "json_schema", "grammar": "grammar"}.get(kind, kind)
        grammar = self.llg.grammar_from(fmt, '{"type": "object"}' if kind == "json_object" else text)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matchers(self, compiled, n: int) -> list:
        return [compiled.deep_copy() for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        if len(matchers) == 1:
            return [matchers[0].consume_token(tokens[0])]
        return self.executor.consume_token_par(list(zip(matchers, tokens)))


class XGrammar(Library):
    name, package = "xgrammar", "xgrammar"

    def setup(self, vocab: Vocab) -> None:
        import xgrammar
        from tokenizers import Tokenizer
        self.xgr = xgrammar
        tok = Tokenizer.from_str(vocab.tokenizer_json)
        encoded = [""] * vocab.vocab_size
        for token, i in tok.get_vocab(with_added_tokens=True).items():
            encoded[i] = token
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(vocab.tokenizer_json)
        info = xgrammar.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab.vocab_size,
                                      stop_token_ids=[vocab.eos_token_id], add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=self.threads)

    def compile(self, kind: str, text: str):
        if kind == "json_schema":
            return self.compiler.compile_json_schema(text)
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}')
        if kind == "regex":
            return self.compiler.compile_regex(text)
        return self.compiler.compile_grammar(text)

    def matchers(self, compiled, n: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        if len(matchers) == 1:
            return [matchers[0].accept_token(tokens[0])]
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)


class OutlinesCore(Library):
    """Regular languages only: a JSON schema becomes a regex (integer / number bounds are not enforced,
    recursion is cut at a fixed depth), and a context-free grammar cannot be expressed."""
    name, package = "outlines-core", "outlines_core"

    def setup(self, vocab: Vocab) -> None:
        import outlines_core
        from tokenizers import Tokenizer
        self.oc = outlines_core
        byte_of = _byte_level_decoder()
        tok = Tokenizer.from_str(vocab.tokenizer_json)
        by_bytes: dict[bytes, list[int]] = {}
        for token, i in tok.get_vocab(with_added_tokens=True).items():
            if i != vocab.eos_token_id and i != 0:
                by_bytes.setdefault(bytes(byte_of[c] for c in token), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(vocab.eos_token_id, by_bytes)

    def compile(self, kind: str, text: str):
        if kind == "grammar":
            raise Unsupported("context-free grammars")
        if kind in ("json_schema", "json_object"):
            text = self.oc.json_schema.build_regex_from_schema('{"type": "object"}' if kind == "json_object" else text)
        return self.oc.Index(text, self.vocabulary)

    def matchers(self, compiled, n: int) -> list:
        return [self.oc.Guide(compiled) for _ in range(n)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        width = bitmask.shape[1]
        for i, guide in enumerate(matchers):
            guide.write_mask_into(bitmask[i].data_ptr(), width, 4)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        ok = []
        for guide, token in zip(matchers, tokens):
            try:
                guide.advance(token, return_tokens=False)
                ok.append(True)
            except Exception:
                ok.append(False)
        return ok


LIBRARIES = {lib.name: lib for lib in (XGrammar, LLGuidance, OutlinesCore)}


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable stand-in character of each byte → the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


# ---- feature probes: (feature, kind, spec, texts that must match, texts that must not) -------------
PROBES = [
    ("integer bounds", "json_schema", json.dumps({"type": "integer", "minimum": 5, "maximum": 7}), ["6"], ["9"]),
    ("anyOf", "json_schema", json.dumps({"anyOf": [{"type": "integer"}, {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}]}),
     ['{"a": "x"}', "3"], ['{"b": 1}']),
    ("recursive $ref", "json_schema", json.dumps({
        "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
            "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v", "kids"],
            "additionalProperties": False}}, "$ref": "#/$defs/node"}),
     ['{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3, "kids": [{"v": 4, "kids": []}]}]}]}'], ['{"v": 1}']),
    ("any JSON object", "json_object", "", ['{"a": [1, {"b": null}], "c": {"d": {"e": [true]}}}'], ["[1]"]),
    ("regex", "regex", r"[a-z]+@[a-z]+\.com", ["ab@cd.com"], ["ab@cd.org"]),
    ("CFG (GBNF)", "grammar", 'root ::= "(" root* ")"', ["(()(()))"], ["(()"]),
]


def probe(lib: Library, vocab: Vocab, tokenizer) -> dict[str, str]:
    """Per feature: "yes", "no: refuses / accepts <text>" (compiles but matches wrongly), "unsupported"
    (cannot be expressed) or "error: ..." (refused to compile)."""
    out = {}
    for feature, kind, spec, good, bad in PROBES:
        try:
            compiled = lib.compile(kind, spec)
        except Unsupported:
            out[feature] = "unsupported"
            continue
        except Exception as e:
            out[feature] = f"error: {str(e).splitlines()[0][:60]}"
            continue
        refused = [t for t in good if not _matches(lib, compiled, tokenizer, vocab, t)]
        let_through = [t for t in bad if _matches(lib, compiled, tokenizer, vocab, t)]
        out[feature] = ("yes" if not refused + let_through else
                        f"no: refuses {_short(refused[0])}" if refused else f"no: accepts {_short(let_through[0])}")
    return out


def _short(text: str) -> str:
    return repr(text if len(text) <= 12 else text[:11] + "…")


def _matches(lib: Library, compiled, tokenizer, vocab: Vocab, text: str) -> bool:
    """Whether `text` (as the tokenizer splits it) is accepted token by token and may then end (EOS allowed)."""
    [matcher] = lib.matchers(compiled, 1)
    for token in tokenizer.encode(text, add_special_tokens=False).ids:
        if not lib.accept([matcher], [token])[0]:
            return False
    bitmask = torch.zeros(1, (vocab.vocab_size + 31) // 32, dtype=torch.int32)
    lib.fill([matcher], bitmask)
    eos = vocab.eos_token_id
    return bool((int(bitmask[0, eos // 32]) >> (eos % 32)) & 1)
