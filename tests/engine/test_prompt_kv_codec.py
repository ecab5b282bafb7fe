"""A prompt whose KV crossed the fp8 codec is recomputed through it (engine/kv_cache/prompt_kv.py): a stream
migrated to another decode engine resumes from the very KV the first one held, and every encoded
prompt's last block has a zero tail, whatever an earlier request left in it."""
from __future__ import annotations

import torch

from engine import Engine, EngineArgs, SamplingParams
from kv_transfer.codec import get_codec

FP8 = get_codec("fp8")
BLOCK = 16
PROMPT = [(7 * i + 3) % 250 + 2 for i in range(37)]      # 2 full blocks and 5 tokens of a third
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(model_dir: str, *, lossy: bool) -> Engine:
    engine = Engine(EngineArgs(model_dir, dtype="float32", num_blocks=10, block_size=BLOCK))
    if lossy:
        engine.prompt_kv_roundtrip = lambda index: FP8.roundtrip(engine.kv_cache, index)
    _dirty(engine)
    return engine


def _dirty(engine: Engine) -> None:
    """Leave an earlier request's KV in every block."""
    engine.generate([[(11 * i) % 200 + 5 for i in range(150)]], SamplingParams(max_tokens=8, temperature=0.0))
    assert engine.kv_cache.abs().amax(dim=(0, 2, 3, 4, 5)).gt(0).all()


def _prefill(model_dir: str) -> tuple[Engine, list[int], int]:
    """A prefill engine's handoff of PROMPT: (engine, its block ids, the first token)."""
    prefill = _engine(model_dir, lossy=False)
    prefill.add_request(PROMPT, GREEDY, request_id="r", prefill_only=True)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    return prefill, list(outs[-1].block_ids), outs[-1].new_token_ids[0]


def _transfer(src: Engine, blocks: list[int], dst: Engine) -> list[int]:
    """What the fp8 transfer does: encode the blocks out of one cache, decode them into another's."""
    dst_blocks = dst.block_manager.allocate(len(blocks))
    shape = (src.kv_cache.shape[0], len(blocks), *src.kv_cache.shape[2:])
    payload = torch.empty(FP8.payload_nbytes(shape, src.kv_cache.dtype), dtype=torch.uint8)
    FP8.encode_from(src.kv_cache, (0, shape[0]), torch.tensor(blocks), payload)
    FP8.decode_into(payload, shape, dst.kv_cache, (0, shape[0]), torch.tensor(dst_blocks))
    return dst_blocks


def _adopted(model_dir: str) -> tuple[Engine, Engine, list[int], int]:
    """PROMPT prefilled, shipped through fp8 and adopted: (prefill engine, decode engine, the decode
    engine's blocks for it, the first token)."""
    prefill, blocks, first = _prefill(model_dir)
    decode = _engine(model_dir, lossy=True)
    decode.expect_kv("r", PROMPT, GREEDY, transfer_id="t", deadline=float("inf"))
    held = _transfer(prefill, blocks, decode)
    decode.adopt("r", [first], held)
    return prefill, decode, held, first


def _prompt_kv(engine: Engine, blocks: list[int]) -> torch.Tensor:
    """The prompt's KV, [L, tokens, 2, H, D]: the slots after the prompt are left out."""
    kv = engine.kv_cache[:, blocks].permute(0, 1, 4, 2, 3, 5).flatten(1, 2)
    return kv[:, :len(PROMPT)].clone()


def test_an_encoded_prompt_leaves_a_zero_tail_in_its_last_block(tiny_model_dir):
    prefill, blocks, _ = _prefill(tiny_model_dir)
    tail = prefill.kv_cache[:, blocks[-1], :, :, len(PROMPT) % BLOCK:]
    assert tail.abs().max() == 0
    assert prefill.kv_cache[:, blocks[-1], :, :, :len(PROMPT) % BLOCK].abs().max() > 0


def test_a_migrated_stream_resumes_from_the_kv_the_first_decode_engine_held(tiny_model_dir):
    prefill, decode, held, first = _adopted(tiny_model_dir)
    held_kv = _prompt_kv(decode, held)
    stream = [first]
    while decode.has_unfinished():
        stream += [t for out in decode.step() for t in out.new_token_ids]

    resumed = 9                                  # the first decode engine died after streaming 9 tokens
    target = _engine(tiny_model_dir, lossy=True)
    target.add_request(PROMPT, GREEDY, request_id="m", resume_output_ids=stream[:resumed], prompt_kv_lossy=True)
    req = target.requests["m"]
    target.step()                                # the prompt alone, then through the codec
    assert req.num_computed_tokens == len(PROMPT)
    assert torch.equal(_prompt_kv(target, req.block_table[:len(held)]), held_kv)
    tokens = stream[:resumed]
    while target.has_unfinished():
        tokens += [t for out in target.step() for t in out.new_token_ids]
    assert tokens == stream
    prefill.release("r")
    for engine in (prefill, decode, target):
        engine.block_manager.check_no_leaks()


def test_without_the_codec_the_recomputed_prompt_kv_differs(tiny_model_dir):
    """The control: recomputed in full precision, the prompt KV is not what the decode engine held."""
    prefill, decode, held, first = _adopted(tiny_model_dir)
    exact = _engine(tiny_model_dir, lossy=False)
    exact.add_request(PROMPT, GREEDY, request_id="m", resume_output_ids=[first], prompt_kv_lossy=True)
    assert not exact.requests["m"].prompt_kv_lossy        # no codec on this engine: nothing to go through
    exact.step()
    assert not torch.equal(_prompt_kv(exact, exact.requests["m"].block_table[:len(held)]), _prompt_kv(decode, held))


def test_a_preempted_adopted_request_recomputes_its_prompt_through_the_codec(tiny_model_dir):
    prefill, decode, held, first = _adopted(tiny_model_dir)
    held_kv = _prompt_kv(decode, held)
    req = decode.requests["r"]
    assert req.prompt_kv_lossy
    decode.step()
    decode.scheduler.running.remove(req)
    decode.scheduler._preempt(req)               # as the scheduler does when blocks run out
    decode.step()                                # its own prompt blocks are cached, but not taken
    assert req.num_computed_tokens == len(PROMPT)
    assert torch.equal(_prompt_kv(decode, req.block_table[:len(held)]), held_kv)
