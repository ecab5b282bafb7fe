"""``CoreReceiver``: the KVReceiver methods every transport shares.

A transport receiver owns a ``ReceiverCore`` (``self.core``), feeds it
chunks from its own threads, and sets ``endpoint``; poll/wait/status/cancel
and stats are the core's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kv_transfer.base import KVReceiver, ReceiverStats, TransferResult, TransferStatus
from kv_transfer.buffers import tune_malloc
from kv_transfer.layout import KVLayout
from kv_transfer.pool import BlockAllocator
from kv_transfer.receiver_core import ReceiverCore


class CoreReceiver(KVReceiver):
    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        allocator: BlockAllocator,
        *,
        codec: str = "none",
        token: str = "",
        on_complete: Callable[[TransferResult], None] | None = None,
        default_timeout_s: float = 30.0,
    ) -> None:
        tune_malloc()
        self.core = ReceiverCore(
            layout,
            kv_cache,
            allocator,
            codec=codec,
            token=token,
            on_complete=on_complete,
            default_timeout_s=default_timeout_s,
        )
        self._endpoint = ""

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def poll(self) -> list[TransferResult]:
        return self.core.poll()

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferResult | None:
        return self.core.wait(transfer_id, timeout)

    def status(self, transfer_id: str) -> TransferStatus | None:
        return self.core.status(transfer_id)

    def cancel(self, transfer_id: str | None = None, request_id: str | None = None) -> list[str]:
        return self.core.cancel(transfer_id, request_id)

    @property
    def stats(self) -> ReceiverStats:
        return self.core.stats

    def close(self) -> None:
        self.core.close()
