"""The disk tier: one file per block in a directory, each checked before it is used.

A block file is ``<chained hash hex>.kvb``::

    b"PDKVBLK1" | header length (u32, little-endian) | header (JSON) | payload (the block's bytes as stored)

The header names the model fingerprint, the chained hash, the block's dtype and shape, the payload's length
and its blake2b checksum. A block is written to a temporary file and renamed into place (with `fsync:
always`, fsynced first), so a reader sees a whole file or none; a file that fails any check (another model,
another hash, a short or altered payload) is deleted and counted, and the prefix is recomputed instead.
A write that fails (disk full, directory gone or read-only) turns the tier off: one log line, `enabled`
False, its blocks forgotten; the actor keeps serving from the tiers above.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
from collections import OrderedDict

import torch

log = logging.getLogger(__name__)
MAGIC = b"PDKVBLK1"
SUFFIX = ".kvb"


def encode_block(block: torch.Tensor, block_hash: bytes, fingerprint: str) -> bytes:
    payload = block.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    header = json.dumps({"fingerprint": fingerprint, "hash": block_hash.hex(), "dtype": str(block.dtype),
                         "shape": list(block.shape), "nbytes": len(payload),
                         "checksum": hashlib.blake2b(payload, digest_size=16).hexdigest()}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


class BadBlock(ValueError):
    """A block file that fails a check."""


def read_header(data: bytes) -> tuple[dict, int]:
    """The header of a block file's leading bytes, and where its payload starts."""
    if data[:len(MAGIC)] != MAGIC:
        raise BadBlock("not a block file")
    start = len(MAGIC) + 4
    if len(data) < start:
        raise BadBlock("truncated header")
    (length,) = struct.unpack("<I", data[len(MAGIC):start])
    if len(data) < start + length:
        raise BadBlock("truncated header")
    try:
        header = json.loads(data[start:start + length])
    except ValueError as e:
        raise BadBlock(f"bad header: {e}") from None
    if not isinstance(header, dict):
        raise BadBlock("bad header")
    return header, start + length


def decode_block(data: bytes, block_hash: bytes, fingerprint: str, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> torch.Tensor:
    """The block a file holds, after every check (raises BadBlock naming the first that fails)."""
    header, offset = read_header(data)
    if header.get("fingerprint") != fingerprint:
        raise BadBlock("another model's block")
    if header.get("hash") != block_hash.hex():
        raise BadBlock("another block's hash")
    if header.get("dtype") != str(dtype) or tuple(header.get("shape", ())) != tuple(shape):
        raise BadBlock("another cache layout")
    payload = data[offset:]
    if len(payload) != header.get("nbytes"):
        raise BadBlock(f"payload of {len(payload)} bytes, header says {header.get('nbytes')}")
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("checksum"):
        raise BadBlock("checksum mismatch")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)


class DiskTier:
    """Block files in `path`, LRU within `capacity_bytes` (file sizes). Thread-safe."""

    kind = "disk"

    def __init__(self, path: str, capacity_bytes: int, fingerprint: str, dtype: torch.dtype,
                 shape: tuple[int, ...], fsync: str = "never", reopen: bool = False):
        """Raises ValueError naming `path` when the directory cannot be created or written."""
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.dtype, self.shape = dtype, tuple(shape)
        self.fsync = fsync
        self.enabled = True
        self.num_bytes = 0
        self.num_corrupt = 0             # block files that failed a check (dropped, recomputed)
        self.disabled_reason = ""
        self._files: OrderedDict[bytes, int] = OrderedDict()     # hash -> file size, least recently used first
        self._lock = threading.Lock()
        try:
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, ".probe")
            with open(probe, "wb") as f:
                f.write(b"0")
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"path: the disk tier's directory {path!r} is not writable ({e.strerror})") from None
        self._open(reopen)

    def _file(self, block_hash: bytes) -> str:
        return os.path.join(self.path, block_hash.hex() + SUFFIX)

    def _open(self, reopen: bool) -> None:
        """Index the blocks a previous run left (reopen), oldest first, or delete them."""
        found = []
        for name in os.listdir(self.path):
            full = os.path.join(self.path, name)
            if name.startswith(".") and name.endswith(".tmp"):
                os.remove(full)                       # a write a crash cut short
                continue
            if not name.endswith(SUFFIX):
                continue
            if not reopen:
                os.remove(full)
                continue
            try:
                block_hash = bytes.fromhex(name[:-len(SUFFIX)])
                with open(full, "rb") as f:
                    header, _ = read_header(f.read(1 << 16))
                if header.get("fingerprint") != self.fingerprint or header.get("hash") != block_hash.hex() \
                        or header.get("dtype") != str(self.dtype) or tuple(header.get("shape", ())) != self.shape:
                    raise BadBlock("another model or layout")
                stat = os.stat(full)
            except (ValueError, OSError):
                self.num_corrupt += 1
                os.remove(full)
                continue
            found.append((stat.st_mtime, block_hash, stat.st_size))
        for _, block_hash, size in sorted(found):
            self._files[block_hash] = size
            self.num_bytes += size
        self._trim()
        if reopen:
            log.info("disk KV tier %s reopened: %d blocks, %d bytes", self.path, len(self._files), self.num_bytes)

    @property
    def num_blocks(self) -> int:
        return len(self._files)

    def hashes(self) -> list[bytes]:
        with self._lock:
            return list(self._files)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._files

    def touch(self, block_hash: bytes) -> bool:
        with self._lock:
            if block_hash not in self._files:
                return False
            self._files.move_to_end(block_hash)
            return True

    def _trim(self) -> list[bytes]:
        """Delete least recently used files until the tier fits; their hashes (lock held)."""
        gone = []
        while self._files and self.num_bytes > self.capacity_bytes:
            block_hash, size = self._files.popitem(last=False)
            self.num_bytes -= size
            gone.append(block_hash)
            try:
                os.remove(self._file(block_hash))
            except OSError:
                pass
        return gone

    def put(self, block_hash: bytes, block: torch.Tensor) -> list[bytes]:
        """Write a block; returns the hashes this tier no longer holds because of it (LRU ones pushed
        out; every hash it held when the write failed and the tier turned off)."""
        if not self.enabled or block_hash in self._files:
            self.touch(block_hash)
            return []
        data = encode_block(block, block_hash, self.fingerprint)
        if len(data) > self.capacity_bytes:
            return []
        final = self._file(block_hash)
        tmp = os.path.join(self.path, f".{block_hash.hex()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync == "always":
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError as e:
            try:
                os.remove(tmp)
            except OSError:
                pass
            return self.disable(f"write failed: {e.strerror or e}")
        with self._lock:
            self._files[block_hash] = len(data)
            self.num_bytes += len(data)
            return self._trim()

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        """The checked block (most recently used from now on), or None: missing, or it failed a check
        (then its file is deleted and `num_corrupt` counts it)."""
        if not self.enabled or not self.touch(block_hash):
            return None
        try:
            with open(self._file(block_hash), "rb") as f:
                data = f.read()
            return decode_block(data, block_hash, self.fingerprint, self.dtype, self.shape)
        except (OSError, BadBlock) as e:
            log.warning("disk KV tier %s: block %s dropped: %s", self.path, block_hash.hex(), e)
            with self._lock:
                self.num_corrupt += 1
                size = self._files.pop(block_hash, None)
                if size is not None:
                    self.num_bytes -= size
            try:
                os.remove(self._file(block_hash))
            except OSError:
                pass
            return None

    def forget(self, block_hash: bytes) -> bool:
        """Drop a block the caller found bad; True if it was here."""
        with self._lock:
            size = self._files.pop(block_hash, None)
            if size is None:
                return False
            self.num_bytes -= size
        try:
            os.remove(self._file(block_hash))
        except OSError:
            pass
        return True

    def disable(self, reason: str) -> list[bytes]:
        """Turn the tier off (once): one log line; returns the hashes it held."""
        with self._lock:
            if not self.enabled:
                return []
            self.enabled = False
            self.disabled_reason = reason
            gone = list(self._files)
            self._files.clear()
            self.num_bytes = 0
        log.error("disk KV tier %s turned off (%s); serving continues without it", self.path, reason)
        return gone
