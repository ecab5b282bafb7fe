"""Stop conditions and the incremental detokenizer."""
from __future__ import annotations

from engine import Engine, EngineArgs, SamplingParams
from engine.tokenizer import IncrementalDetokenizer


def test_max_tokens_and_eos(tiny_model_dir):
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64))
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    # Make the greedy pick EOS by treating the first generated token as EOS.
    engine.output.eos = {out.token_ids[0]}
    stopped = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=7, temperature=0.0))[0]
    assert stopped.token_ids == out.token_ids[:1] and stopped.finish_reason == "stop"
    ignored = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))[0]
    assert ignored.token_ids == out.token_ids


def test_stop_string_spanning_tokens_cuts_text_and_never_streams_it(tiny_model_dir):
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=64))
    base = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    text = base.text
    # A stop string made of the end of one token's text and the start of a later one.
    pieces = [engine.tokenizer.decode([t]) for t in base.token_ids]
    boundary = len(pieces[0]) + len(pieces[1])
    stop = text[boundary - 1: boundary + 2]
    assert len(stop) == 3
    cut = text.find(stop)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop]))
    deltas, reason = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.text_delta)
            reason = out.finish_reason or reason
    assert "".join(deltas) == text[:cut]
    assert reason == "stop"
    engine.block_manager.check_no_leaks()


def test_cjk_and_emoji_stream_without_replacement_chars(tiny_model_dir):
    engine = Engine(EngineArgs(tiny_model_dir, dtype="float32", num_blocks=8))
    tok = engine.tokenizer
    text = "缓存模型 → 你好世界, データ 😀 done"
    ids = []
    for ch in text:                      # byte-level tokens: multi-byte chars split across ids
        ids.extend(tok.encode(ch) if ord(ch) < 128 else [tok._tok.token_to_id(b) for b in _bytes_tokens(ch)])
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.push(t) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def _bytes_tokens(ch: str) -> list[str]:
    """The single-byte vocabulary symbols of a character (GPT-2 byte-level alphabet)."""
    return [_BYTE_TO_SYM[b] for b in ch.encode("utf-8")]


def _byte_to_symbol() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_SYM = _byte_to_symbol()
