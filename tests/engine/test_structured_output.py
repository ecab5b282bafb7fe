"""Structured outputs on a random-weight model: every output matches its grammar, whatever the sampling,
batching, n, preemption, migration or prefill → decode handoff; bad specs are refused before anything is held."""
from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from engine import Engine, EngineArgs, SamplingParams
from engine.sampling.grammar import GrammarCompiler, apply_token_bitmask
from engine.sampling.sampler import child_seed
from engine.sampling.structured import StructuredOutput
from proto.pdserve.v1 import generation_pb2

EOS = 1
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45], [300, 2, 99], [17] * 20]

SCHEMAS = {
    "nested objects": {
        "type": "object", "additionalProperties": False, "required": ["user"],
        "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["name", "address"],
                                "properties": {"name": {"type": "string", "maxLength": 6},
                                               "address": {"type": "object", "additionalProperties": False,
                                                           "required": ["city"],
                                                           "properties": {"city": {"type": "string",
                                                                                   "maxLength": 5}}}}}}},
    "arrays": {
        "type": "object", "additionalProperties": False, "required": ["ids", "pairs"],
        "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                               "minItems": 1, "maxItems": 3},
                       "pairs": {"type": "array", "maxItems": 2, "items": {
                           "type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}}}},
    "enums": {
        "type": "object", "additionalProperties": False, "required": ["color", "size"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, "big", None]}}},
    "numbers with bounds": {
        "type": "object", "additionalProperties": False, "required": ["age", "ratio", "temp"],
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 65},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                       "temp": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5}}},
    "required and optional": {
        "type": "object", "additionalProperties": False, "required": ["id"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                       "note": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}}},
    "anyOf": {
        "type": "object", "additionalProperties": False, "required": ["value"],
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                           {"type": "string", "maxLength": 3},
                                           {"type": "object", "additionalProperties": False, "required": ["x"],
                                            "properties": {"x": {"type": "null"}}}]}}},
}


def _engine(model_dir: str, **kw) -> Engine:
    return Engine(EngineArgs(model_dir, dtype="float32", attention="eager", **{"num_blocks": 256, **kw}))


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return _engine(tiny_model_dir)


def _params(spec: StructuredOutput, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 200, "temperature": 1.0, "structured": spec, **kw})


def _settings() -> list[dict]:
    """Greedy, and temperature 1.0 with three seeds."""
    return [dict(temperature=0.0)] + [dict(temperature=1.0, seed=s) for s in range(3)]


def _run(engine: Engine, prompts, params) -> list:
    done = engine.generate(prompts, params)
    engine.block_manager.check_no_leaks()
    assert not engine.requests and not engine.scheduler.compiling
    return done


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_validates_against_its_schema(engine, name):
    schema = SCHEMAS[name]
    spec = StructuredOutput(json_schema=json.dumps(schema))
    done = _run(engine, PROMPTS, [_params(spec, **s) for s in _settings()])      # one batch, greedy + sampled
    for c in done:
        assert c.finish_reason == "stop" and c.matched_stop == EOS, (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in done}) > 1          # the seeds draw different documents


def test_json_object_outputs_are_objects(engine):
    """Any object: keys are unbounded strings, so a random model may run to max_tokens inside one; what
    ends is an object, what is cut off is a prefix the grammar accepts."""
    spec = StructuredOutput(json_object=True)
    done = _run(engine, PROMPTS + PROMPTS, [_params(spec, max_tokens=40, seed=s) for s in range(8)])
    stopped = [c for c in done if c.finish_reason == "stop"]
    for c in stopped:
        assert isinstance(json.loads(c.text), dict), c.text
    for c in done:
        assert c.text.lstrip().startswith("{")
        assert engine.grammars.compile(spec).result().deep_copy().consume_tokens(c.token_ids), c.text
    assert stopped


def test_regex_and_choice_outputs_match(engine):
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    choices = ("positive", "negative", "neutral", "not sure")
    regex = _run(engine, PROMPTS, [_params(StructuredOutput(regex=pattern), **s) for s in _settings()])
    choice = _run(engine, PROMPTS, [_params(StructuredOutput(choice=choices), **s) for s in _settings()])
    for c in regex:
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c.text
    for c in choice:
        assert c.finish_reason == "stop" and c.text in choices, c.text


def test_gbnf_and_lark_grammars(engine):
    gbnf, lark = 'root ::= "(" inner ")"\ninner ::= "x" | "(" inner ")"', 'start: "(" inner ")"\ninner: "x" | start'
    for grammar in (gbnf, lark):
        for c in _run(engine, PROMPTS[:2], [_params(StructuredOutput(grammar=grammar), seed=s) for s in (1, 2)]):
            assert c.finish_reason == "stop" and re.fullmatch(r"(\()+x(\))+", c.text), c.text
            assert c.text.count("(") == c.text.count(")")


def test_constrained_and_plain_requests_share_a_batch(engine):
    """The plain rows (the fast greedy path and the sampled one) draw exactly what they draw alone."""
    plain = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True)]
    alone = [c.token_ids for c in _run(engine, PROMPTS[:2], plain)]
    spec = StructuredOutput(json_schema=json.dumps(SCHEMAS["enums"]))
    mixed = _run(engine, PROMPTS, plain + [_params(spec, temperature=0.0), _params(spec, seed=9)])
    assert [c.token_ids for c in mixed[:2]] == alone
    for c in mixed[2:]:
        jsonschema.validate(json.loads(c.text), SCHEMAS["enums"])


def test_n_sequences_each_match_with_their_own_matcher(engine):
    schema = SCHEMAS["required and optional"]
    spec = StructuredOutput(json_schema=schema)
    done = _run(engine, [PROMPTS[1]], _params(spec, n=2, seed=5))
    assert [c.index for c in done] == [0, 1] and done[0].token_ids != done[1].token_ids
    for i, c in enumerate(done):
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)
        [lone] = _run(engine, [PROMPTS[1]], _params(spec, seed=child_seed(5, i)))
        assert c.token_ids == lone.token_ids


def test_eos_only_where_the_grammar_accepts(engine):
    """A +100 bias on EOS cannot end the output early; a -100 bias cannot keep it going once complete."""
    early = _run(engine, PROMPTS[:1], _params(StructuredOutput(regex="[ab]{5}"), logit_bias={EOS: 100.0}))
    late = _run(engine, PROMPTS[:1], _params(StructuredOutput(choice=("yes", "no")), logit_bias={EOS: -100.0}))
    assert re.fullmatch("[ab]{5}", early[0].text) and early[0].token_ids[-1] == EOS
    assert late[0].text in ("yes", "no") and late[0].finish_reason == "stop"


def test_ignore_eos_max_tokens_and_min_tokens(engine):
    spec = StructuredOutput(regex="[ab]{3}")
    [ignored] = _run(engine, PROMPTS[:1], _params(spec, ignore_eos=True, max_tokens=8))
    assert ignored.finish_reason == "length" and ignored.text == "".join(re.findall("[ab]", ignored.text))
    assert len(ignored.text) == 3 and ignored.token_ids[-1] == EOS       # complete: only EOS from there on
    [cut] = _run(engine, PROMPTS[:1], _params(StructuredOutput(json_schema=SCHEMAS["nested objects"]), max_tokens=3))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 3 and cut.text.startswith("{")
    # min_tokens bans the EOS that the complete grammar alone allows: the grammar wins, EOS is drawn
    # but ends the output only at min_tokens.
    [held] = _run(engine, PROMPTS[:1], _params(StructuredOutput(choice=("yes",)), min_tokens=6, temperature=0.0))
    assert held.text == "yes" and held.finish_reason == "stop" and len(held.token_ids) == 6
    assert held.token_ids[-1] == EOS


def test_logprobs_stay_those_of_the_raw_logits(engine):
    spec = StructuredOutput(choice=("zzzz",))
    [constrained] = _run(engine, PROMPTS[:1], _params(spec, temperature=0.0, logprobs=3))
    [plain] = _run(engine, PROMPTS[:1], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))
    first, free = constrained.logprobs[0], plain.logprobs[0]
    assert [(t.token_id, t.logprob) for t in first.top] == [(t.token_id, t.logprob) for t in free.top]
    assert first.token_id != free.token_id and first.logprob < free.logprob


def test_preempted_requests_resume_with_identical_output(tiny_model_dir, engine):
    spec = StructuredOutput(json_schema=SCHEMAS["arrays"])
    prompts = [list(range(2 + i, 40 + i)) for i in range(6)]
    params = [_params(spec, seed=i) for i in range(6)]
    solo = [c.token_ids for c in _run(engine, prompts, params)]
    small = _engine(tiny_model_dir, num_blocks=14, chunk_size=16, max_num_batched_tokens=64)
    got = [c.token_ids for c in _run(small, prompts, params)]
    assert small.scheduler.num_preemptions > 0
    assert got == solo


def test_migrated_request_replays_its_tokens_into_the_matcher(engine):
    spec = StructuredOutput(json_schema=SCHEMAS["numbers with bounds"])
    [whole] = _run(engine, PROMPTS[:1], _params(spec, seed=3))
    half = whole.token_ids[:len(whole.token_ids) // 2]
    rid = engine.add_request(PROMPTS[0], _params(spec, seed=3), resume_output_ids=half)
    rest = []
    while engine.has_unfinished():
        rest += [t for out in engine.step() for t in out.new_token_ids]
    assert half + rest == whole.token_ids and rid not in engine.requests


def test_adopted_request_continues_as_one_engine_would(tiny_model_dir, engine):
    """First tokens drawn by a prefill engine; the decode engine's matchers replay them at adopt."""
    spec = StructuredOutput(json_schema=SCHEMAS["anyOf"])
    params = SamplingParams.from_proto(_params(spec, seed=11, n=2).to_proto())     # as the handoff carries it
    expected = [c.token_ids for c in _run(engine, [PROMPTS[3]], params)]
    prefill, decode = _engine(tiny_model_dir, num_blocks=32), _engine(tiny_model_dir, num_blocks=32)
    prefill.add_request(PROMPTS[3], params, request_id="r", prefill_only=True)
    firsts = []
    while prefill.has_unfinished():
        firsts += prefill.step()
    assert [o.index for o in firsts] == [0, 1] and firsts[0].prefilled
    dst = decode.block_manager.allocate(len(firsts[0].block_ids))
    decode.kv_cache[:, dst] = prefill.kv_cache[:, firsts[0].block_ids]
    prefill.release("r")
    decode.expect_kv("r", PROMPTS[3], params, transfer_id="t", deadline=float("inf"))
    got = {o.index: list(o.new_token_ids) for o in decode.adopt("r", [o.new_token_ids[0] for o in firsts], dst)}
    while decode.has_unfinished():
        for out in decode.step():
            got[out.index] += out.new_token_ids
    assert [got[0], got[1]] == expected
    prefill.block_manager.check_no_leaks()
    decode.block_manager.check_no_leaks()


def test_no_step_samples_a_request_before_its_grammar_is_compiled(engine, monkeypatch):
    pending: Future = Future()
    real = engine.grammars.compile(StructuredOutput(choice=("ok",)))
    monkeypatch.setattr(engine.grammars, "compile", lambda spec: pending)
    rid = engine.add_request(PROMPTS[0], _params(StructuredOutput(choice=("ok",)), temperature=0.0))
    plain = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=2, temperature=0.0))
    outs = [o for _ in range(4) for o in engine.step()]
    assert {o.request_id for o in outs} == {plain} and engine.requests[rid].num_computed_tokens == 0
    assert engine.has_unfinished() and engine.scheduler.num_queued == 1
    pending.set_result(real.result())
    text = ""
    while engine.has_unfinished():
        text += "".join(o.text_delta for o in engine.step())
    assert text == "ok"
    engine.block_manager.check_no_leaks()


@pytest.mark.parametrize("spec,problem", [
    (StructuredOutput(json_schema={"not": {"type": "string"}}), r"structured\.json_schema: .*not"),
    (StructuredOutput(json_schema={"type": "array", "uniqueItems": True}), r"structured\.json_schema: .*uniqueItems"),
    (StructuredOutput(json_schema={"type": "string", "format": "color"}), r"structured\.json_schema: .*format"),
    (StructuredOutput(json_schema="{not json"), r"structured\.json_schema is not valid JSON"),
    (StructuredOutput(json_schema="[1, 2]"), r"structured\.json_schema must be a JSON object"),
    (StructuredOutput(regex="a(b"), r"structured\.regex: .*unclosed group"),
    (StructuredOutput(regex="(?=a)b"), r"structured\.regex: .*look-around"),
    (StructuredOutput(grammar='root ::= "a" | missing'), r"structured\.grammar: .*missing"),
    (StructuredOutput(grammar='start: "a" | missing'), r"structured\.grammar: .*missing"),
    (StructuredOutput(choice=()), r"structured\.choice must be a non-empty list"),
    (StructuredOutput(regex="a", choice=("a",)), r"structured: exactly one of .* got regex, choice"),
    (StructuredOutput(), r"structured: exactly one of .* got none"),
    (StructuredOutput(grammar="x" * 70000), r"structured\.grammar must be at most 65536 characters"),
])
def test_bad_specs_are_refused_naming_the_problem_and_hold_nothing(engine, spec, problem):
    free = engine.block_manager.num_free_blocks
    with pytest.raises(ValueError, match=problem):
        engine.add_request(PROMPTS[0], _params(spec), request_id="bad")
    with pytest.raises(ValueError, match=problem):
        engine.expect_kv("bad", PROMPTS[3], _params(spec), transfer_id="t", deadline=float("inf"))
    assert "bad" not in engine.requests and engine.block_manager.num_free_blocks == free
    assert not engine.has_unfinished()


@pytest.mark.parametrize("spec", [
    StructuredOutput(json_schema=json.dumps(SCHEMAS["anyOf"])), StructuredOutput(json_object=True),
    StructuredOutput(regex=r"\d+"), StructuredOutput(choice=("a", "", "ü ✓")),
    StructuredOutput(grammar="start: /x+/"),
])
def test_proto_round_trip(spec):
    params = SamplingParams(max_tokens=9, structured=spec)
    wire = generation_pb2.SamplingParams.FromString(params.to_proto().SerializeToString())
    assert wire.structured.WhichOneof("kind") == spec.kind
    assert SamplingParams.from_proto(wire) == params
    assert SamplingParams.from_proto(SamplingParams().to_proto()).structured is None


def test_compiled_grammars_are_cached_lru_per_tokenizer(engine):
    compiler = GrammarCompiler(engine.tokenizer.to_json(), engine.vocab_size, engine.eos_token_ids, cache_size=2)
    a, b, c = (StructuredOutput(regex=r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(StructuredOutput(regex="a+")) is first           # equal spec: the same compile
    second = compiler.compile(b)
    compiler.compile(c)                                                       # a is the least recently used
    assert compiler.compile(b) is second and compiler.compile(a) is not first
    matcher = compiler.compile(a).result().deep_copy()
    assert matcher.consume_tokens(engine.tokenizer.encode("aa", add_special_tokens=False)) and matcher.is_accepting()
    other = GrammarCompiler(engine.tokenizer.to_json(), engine.vocab_size + 32, engine.eos_token_ids)
    assert other.fingerprint != compiler.fingerprint


def test_apply_token_bitmask_matches_the_unpacked_mask():
    g = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 37), (5, 1024), (3, 1000)):
        logits = torch.randn(rows, vocab, generator=g)
        bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=g)
        allowed = ((bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().view(rows, -1)[:, :vocab]
        expected = logits.masked_fill(~allowed, float("-inf"))
        apply_token_bitmask(logits, bitmask)
        assert torch.equal(logits, expected)
