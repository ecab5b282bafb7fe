"""torch.distributed pair plumbing shared by TorchSender and TorchReceiver.

Message kinds and limits of the pair protocol (see ``kv_transfer.transports.torch``),
process-group construction over the pair's own store (NCCL on CUDA, gloo on
CPU over the endpoint's interface) and small helpers. Imports
torch.distributed only.
"""

from __future__ import annotations

import os
import struct
from datetime import timedelta

import torch
import torch.distributed as dist

from kv_transfer.interface import FailedSide, TransferError
from kv_transfer.wire import WireError

KIND_CHUNK, KIND_CLOSE, KIND_ABORT = 1, 2, 3
# Every message group starts with a fixed-size control slot, so the receiver
# can post the next one before it arrives (gloo holds a send until its receive
# is posted): u32 kind | u32 header_len | u64 payload_len | u32 is_last |
# u64 next_len (the next chunk's payload size, 0 after the last chunk), then
# the msgpack header from offset 32.
CONTROL = struct.Struct("<IIQIQ")
CONTROL_BYTES = 4096
MAX_CONTROL_HEADER = CONTROL_BYTES - 32
MAX_PENDING_DECODES = 2  # received chunks waiting for decode, per pair
# A group's own timeout bounds its set-up (gloo) and nothing else: every wait on an operation names
# its timeout. An idle pair waits in recv up to IDLE_TIMEOUT (peer death or teardown wakes it).
IDLE_TIMEOUT = timedelta(days=1)
TEARDOWN_TIMEOUT = timedelta(seconds=2)  # for the close message of a pair being torn down


def control_tensor(kind: int, header: bytes, payload_len: int, is_last: bool, device,
                   next_len: int = 0) -> torch.Tensor:
    if len(header) > MAX_CONTROL_HEADER:
        raise WireError(f"chunk header of {len(header)} bytes exceeds the {MAX_CONTROL_HEADER}-byte control slot")
    slot = bytearray(CONTROL_BYTES)
    CONTROL.pack_into(slot, 0, kind, len(header), payload_len, int(is_last), next_len)
    slot[32 : 32 + len(header)] = header
    return torch.frombuffer(slot, dtype=torch.uint8).to(device)


def parse_control(slot: torch.Tensor) -> tuple[int, bytes, int, bool, int]:
    """-> (kind, header bytes, payload_len, is_last, next_len); raises WireError on a bad slot."""
    data = slot.cpu().numpy().tobytes()
    kind, header_len, payload_len, is_last, next_len = CONTROL.unpack_from(data)
    if kind not in (KIND_CHUNK, KIND_CLOSE, KIND_ABORT) or header_len > MAX_CONTROL_HEADER:
        raise WireError(f"bad control slot (kind {kind}, header {header_len} bytes)")
    return kind, data[32 : 32 + header_len], payload_len, bool(is_last), 0 if is_last else next_len


def split_host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise TransferError(f"bad torch endpoint {endpoint!r}; expected host:port", FailedSide.SENDER)
    return host, int(port)


def make_group(store, rank: int, backend: str, setup_timeout: timedelta, device_host: str, interface: str | None):
    """The pair's 2-rank group over ``store`` (the pair's own key space: no prefix, which a Store written in
    Python could not take anyway); gloo connects now and gives up after ``setup_timeout``.

    NCCL connects at the first operation (bounded by that operation's wait); its own timeout stays
    IDLE_TIMEOUT, since its watchdog would tear down a pair that merely waits for the next send.
    """
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = IDLE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [_gloo_device(device_host, interface)]
    options._timeout = setup_timeout
    return dist.ProcessGroupGloo(store, rank, 2, options)


def wait_work(work, timeout: timedelta | None) -> None:
    """Wait for one send/recv; raises (TimeoutError or the backend's error) when it does not complete.

    ``timeout`` None: the backend's own wait, for NCCL only (the current stream waits for the
    operation; the group's IDLE_TIMEOUT bounds it). gloo's own wait would use the group's timeout,
    which bounds its set-up only, so gloo waits always name one.
    """
    if timeout is None:
        work.wait()
    elif not work.wait(timeout):
        raise TimeoutError(f"torch pair operation did not complete within {timeout.total_seconds():.0f} s")


def destroy_group(group) -> None:
    """Tear a pair's group down: NCCL aborts its communicator (waking pending operations); gloo closes
    its connections when the last reference goes, which the caller drops next (its peer's pending
    receives then fail with "connection closed")."""
    if group is None:
        return
    try:
        group.abort()
    except Exception:  # already broken, or a backend without abort
        pass


def _gloo_device(host: str, interface: str | None):
    """Loopback peers talk over 127.0.0.1; others over ``interface`` or GLOO_SOCKET_IFNAME."""
    loopback = host.startswith("127.") or host == "localhost"
    interface = interface or (None if loopback else os.environ.get("GLOO_SOCKET_IFNAME"))
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    if loopback:
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()
