"""make_sender / make_receiver: from the transfer settings (how the actors call them) or a transport name."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kv_helpers import TOKEN, assert_no_leak, random_cache

from kv_transfer import (
    KVPiece,
    DEFAULT_CHUNK_BYTES,
    FakeHub,
    KVLayout,
    SimpleBlockPool,
    TransferSettings,
    TransferStatus,
    layout_of,
    make_receiver,
    make_sender,
)


def test_layout_of_reads_the_engine_cache_shape():
    cache = torch.zeros(3, 5, 2, 2, 4, 8, dtype=torch.bfloat16)  # [L, NB, 2, Hkv, bs, D]
    assert layout_of(cache, "fp") == KVLayout(3, 2, 4, 8, torch.bfloat16, "fp")


def test_settings_give_both_ends_their_codec_token_and_deadline(layout):
    settings = TransferSettings(transport="fake", codec="none", token=TOKEN, chunk_bytes=200, deadline_s=7.5)
    hub, pool, seen = FakeHub(), SimpleBlockPool(8), []
    cache = torch.zeros(layout.cache_shape(8), dtype=layout.dtype)
    receiver = make_receiver(settings, layout, cache, pool, seen.append, hub=hub)
    sender = make_sender(settings, layout, "cpu", hub=hub)
    try:
        assert (receiver.codec, receiver.token, receiver.default_timeout_s) == ("none", TOKEN, 7.5)
        assert (sender.codec.name, sender.token, sender.chunk_bytes) == ("none", TOKEN, 200)
        src = random_cache(layout, 4)
        handle = sender.send(KVPiece("r", src, [3, 1], num_tokens=8, first_token_id=5), receiver.endpoint)
        assert handle.wait(10) == TransferStatus.DONE, handle
        result = receiver.wait(handle.transfer_id, 5)
        assert seen == [result] and (result.num_tokens, result.first_token_id, result.codec) == (8, 5, "none")
        assert torch.equal(cache[:, result.dst_block_ids], src[:, [3, 1]])
        assert_no_leak(pool, result.dst_block_ids)
    finally:
        sender.close()
        receiver.close()


def test_settings_bind_the_receiver_and_place_the_torch_sender(layout):
    cache = torch.zeros(layout.cache_shape(4), dtype=layout.dtype)
    settings = TransferSettings(transport="grpc", bind_host="127.0.0.1")
    receiver = make_receiver(settings, layout, cache, SimpleBlockPool(4))
    torch_sender = make_sender(TransferSettings(transport="torch", codec="none"), layout, "cpu")
    grpc_sender = make_sender(TransferSettings(), layout, "cpu")  # the device is the torch transport's alone
    try:
        assert receiver.endpoint.startswith("127.0.0.1:") and receiver.codec == "fp8"
        assert torch_sender.device == torch.device("cpu") and torch_sender.codec.name == "none"
        assert grpc_sender.codec.name == "fp8" and grpc_sender.chunk_bytes == DEFAULT_CHUNK_BYTES
        assert make_sender(TransferSettings(transport="fake"), layout, hub=FakeHub(), codec="none").codec.name == "none"
    finally:
        for end in (grpc_sender, torch_sender, receiver):
            end.close()


def test_a_transport_name_passes_only_the_keywords_given(layout):
    sender = make_sender("fake", layout, hub=FakeHub())
    try:
        assert sender.codec.name == "none" and sender.token == ""  # the classes' defaults, not TransferSettings'
    finally:
        sender.close()


def test_factory_rejects_unknown_transport(layout):
    with pytest.raises(ValueError, match="unknown KV transport 'carrier-pigeon'"):
        make_sender("carrier-pigeon", layout)


def test_kv_transfer_imports_neither_ray_nor_engine():
    """Nor the packages above it: kv_transfer sits at the ground of the import graph."""
    above = ("engine", "router", "deploy", "prefill_worker", "decode_worker")
    code = (
        "import sys, torch, kv_transfer\n"
        "from kv_transfer import KVLayout, make_sender\n"
        "make_sender('grpc', KVLayout(1, 1, 1, 1, torch.float32)).close()\n"
        "make_sender('torch', KVLayout(1, 1, 1, 1, torch.float32)).close()\n"
        "loaded = lambda p: any(m == p or m.startswith(p + '.') for m in sys.modules)\n"
        f"print('ray' in sys.modules, *map(loaded, {above!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"] * (1 + len(above))
    assert_no_leak(SimpleBlockPool(1))
