"""``KVHandoff``: the typed message between prefill and decode.

Prefill builds one after ``send`` (block_ids empty: the receiver picks
them); the decode worker builds one from a DONE ``TransferResult`` (its own
destination block ids) to record what it now owns.
"""

from __future__ import annotations

from kv_transfer.base import TransferResult
from proto.pdserve.v1 import kv_transfer_pb2

CODEC_ENUM = {
    "none": kv_transfer_pb2.KV_CODEC_NONE,
    "fp8": kv_transfer_pb2.KV_CODEC_FP8,
    "fp8_tensor": kv_transfer_pb2.KV_CODEC_FP8_TENSOR,
}
CODEC_NAME = {value: name for name, value in CODEC_ENUM.items()}


def make_handoff(
    request_id: str,
    transfer_id: str,
    *,
    num_tokens: int,
    first_token_id: int,
    codec: str,
    block_ids: list[int] | None = None,
) -> kv_transfer_pb2.KVHandoff:
    return kv_transfer_pb2.KVHandoff(
        request_id=request_id,
        transfer_id=transfer_id,
        block_ids=block_ids or [],
        num_tokens=num_tokens,
        first_token_id=first_token_id,
        codec=CODEC_ENUM.get(codec, kv_transfer_pb2.KV_CODEC_UNSPECIFIED),
    )


def handoff_from_result(result: TransferResult) -> kv_transfer_pb2.KVHandoff:
    return make_handoff(
        result.request_id,
        result.transfer_id,
        num_tokens=result.num_tokens,
        first_token_id=result.first_token_id,
        codec=result.codec,
        block_ids=result.dst_block_ids,
    )
