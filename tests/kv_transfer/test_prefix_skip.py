"""A transfer that skips the leading blocks the decode side already holds (decode-side prefix reuse):
the header still describes the whole prompt (num_tokens), only the trailing blocks travel, the receiver
reserves exactly those, and a failed one frees them; on every transport with both codecs."""
from __future__ import annotations

import pytest
import torch
from kv_helpers import assert_no_leak, random_cache, wait_for

from kv_transfer import KVPiece, TransferStatus


CASES = [(kind, codec) for kind in ("fake", "grpc", "tcp", "torch") for codec in ("none", "fp8")] + [("ray", "none")]
CASES += [("fake", "int8"), ("tcp", "int8")]


@pytest.mark.parametrize("kind,codec", CASES)
def test_only_the_trailing_blocks_travel_and_are_reserved(make_pair, layout, kind, codec):
    src = random_cache(layout, 10, seed=4)
    prompt_blocks = [7, 2, 9, 0, 5, 3]               # the prompt's blocks on the prefill side, in token order
    num_tokens = 5 * layout.block_size + 1           # the last block holds one token
    skip = 4                                         # the decode side holds (pinned) the first four
    pair = make_pair(kind, layout, codec=codec, num_dst_blocks=16, chunk_bytes=300)
    pinned = pair.pool.allocate(skip)                # what the decode worker pinned before the transfer
    piece = KVPiece("r", src, prompt_blocks[skip:], num_tokens=num_tokens, first_token_id=7)
    handle = pair.sender.send(piece, pair.dest)
    assert handle.wait(30) == TransferStatus.DONE, handle
    result = pair.receiver.wait(handle.transfer_id, 10)
    assert result.status == TransferStatus.DONE and result.num_tokens == num_tokens
    assert len(result.dst_block_ids) == len(prompt_blocks) - skip and not set(result.dst_block_ids) & set(pinned)
    block_nbytes = src[:, 0].numel() * src.element_size()
    if codec == "none":
        assert result.nbytes == 2 * block_nbytes
        got, expected = pair.dst_cache[:, result.dst_block_ids], src[:, prompt_blocks[skip:]]
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    else:
        assert 0 < result.nbytes < 2 * block_nbytes
    assert_no_leak(pair.pool, pinned + result.dst_block_ids)


@pytest.mark.parametrize("kind", ["fake", "tcp"])
def test_a_cancelled_skipping_transfer_frees_only_what_it_reserved(make_pair, layout, kind):
    src = random_cache(layout, 10, seed=5)
    pair = make_pair(kind, layout, num_dst_blocks=16, chunk_bytes=64)
    pinned = pair.pool.allocate(3)
    pair.receiver.cancel(transfer_id="t-c")         # the decode worker dropped the request first
    handle = pair.sender.send(KVPiece("r", src, [1, 2], transfer_id="t-c", num_tokens=5 * layout.block_size), pair.dest)
    assert handle.wait(30) == TransferStatus.FAILED
    assert wait_for(lambda: pair.pool.used_ids == set(pinned))
    assert_no_leak(pair.pool, pinned)
