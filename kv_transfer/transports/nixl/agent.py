"""One end's NIXL agent: the library, the environment UCX reads, registered regions, one-sided transfers.

    agent = Agent(name, backend="UCX", ucx_tls="tcp,shm", host="127.0.0.1", device=cache.device, workers=2)
    region = agent.register(tensor)                  # a whole tensor, once: DRAM on CPU, VRAM on CUDA
    peer = agent.load_peer(metadata)                 # the other end's agent (again: its new regions)
    xfer = agent.post("READ", local, remote, peer)   # Nx3 (address, bytes, device) descriptor arrays
    agent.state(xfer) -> "PROC" | "DONE" | "ERR";  agent.release(xfer)     # any thread, one at a time per xfer
    agent.notifications() -> {peer: [bytes]}

The library is imported on first use: ``nixl_cu13`` (what ``pip install 'pdserve[nixl]'`` installs), else
``nixl_cu12`` or the ``nixl`` meta package; none of them is a ``NixlUnavailable`` naming the install line.
Before the first agent the environment UCX and NIXL read is set: ``UCX_TLS`` from the config (with
``cuda_copy`` added for a CUDA cache), ``UCX_NET_DEVICES=lo`` when the end binds to loopback (else the
interface holding its bind address, unless set already), ``UCX_TCP_TX_SEG_SIZE`` / ``UCX_TCP_RX_SEG_SIZE``
256k when TCP is among the transports (unless set), ``NIXL_LOG_LEVEL=WARN`` unless set. NIXL's own
metadata listener (it binds every interface) is never started: metadata travels over the transport's
authenticated control connection. The Python API starts its progress thread busy-polling (a whole core
per agent); agents here wait on the UCX worker's events instead, with a periodic wake-up.

An agent has ``workers`` UCX workers and takes NIXL's reader-writer lock (``NIXL_THREAD_SYNC_RW``): transfers
are posted and polled under a shared lock, registrations and peers change under an exclusive one. Transfers
posted from different threads then run on different workers at once: over shared memory a READ copies (CMA)
on the thread that posts it, so one worker is one core's copy, two are two.
"""

from __future__ import annotations

import fcntl
import importlib
import ipaddress
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pdserve[nixl]'"
MODULES = ("nixl_cu13._api", "nixl_cu12._api", "nixl._api")
PROGRESS_WAKE_US = 10_000  # the progress thread's periodic wake-up (events wake it at once)
TCP_SEG_SIZE = "256k"      # UCX's TCP segment: a READ over TCP runs 2-3x faster than at its default 8 KiB
_SIOCGIFADDR = 0x8915


class NixlUnavailable(RuntimeError):
    """The NIXL library is not installed (or does not load)."""


@dataclass(frozen=True, slots=True)
class Region:
    """A registered tensor as a peer addresses it."""

    base: int        # address of byte 0
    nbytes: int
    mem: str         # "DRAM" | "VRAM"
    device_id: int   # CUDA device index; 0 for host memory

    def describe(self) -> dict:
        return {"base": self.base, "nbytes": self.nbytes, "mem": self.mem, "device_id": self.device_id}

    @classmethod
    def parse(cls, value: object) -> Region:
        """A peer's region description; ValueError when malformed."""
        if not isinstance(value, dict):
            raise ValueError("region is not a map")
        fields = (value.get("base"), value.get("nbytes"), value.get("mem"), value.get("device_id"))
        if not (all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in fields[:2] + fields[3:])
                and fields[2] in ("DRAM", "VRAM")):
            raise ValueError(f"malformed region {value!r}")
        return cls(*fields)


def load_api():
    """The NIXL Python API module; NixlUnavailable naming the package to install when none imports."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # read once, when the library's logging is set up
    errors = []
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise NixlUnavailable(f"kv_transfer.transport nixl needs the NIXL library (nixl-cu13==1.5.1); install it with "
                          f"{INSTALL_HINT} ({'; '.join(errors)})")


def available() -> str | None:
    """None when the library imports, else why not (tests skip with it)."""
    try:
        load_api()
    except NixlUnavailable as exc:
        return str(exc)
    return None


def ucx_environment(ucx_tls: str, host: str, device: torch.device) -> dict[str, str]:
    """The variables ``configure_environment`` sets (see the module docstring)."""
    tls = [name.strip() for name in ucx_tls.split(",") if name.strip()]
    if device.type == "cuda" and not {"cuda_copy", "cuda", "all"} & set(tls):
        tls.append("cuda_copy")  # NIXL refuses VRAM without a CUDA copy transport
    env = {"UCX_TLS": ",".join(tls), "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
    if "tcp" in tls:  # UCX's 8 KiB TCP segments cap a READ over TCP (emulated with active messages)
        for name in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"):
            env[name] = os.environ.get(name, TCP_SEG_SIZE)
    if is_loopback(host):
        env["UCX_NET_DEVICES"] = "lo"
    elif "UCX_NET_DEVICES" not in os.environ:
        interface = interface_of(host)
        if interface is not None:
            env["UCX_NET_DEVICES"] = interface
        else:
            log.warning("nixl: no interface holds %s; UCX may use every interface", host)
    return env


def configure_environment(ucx_tls: str, host: str, device: torch.device) -> None:
    """Set what UCX and NIXL read at agent creation (process-wide; every agent of a process shares it)."""
    os.environ.update(ucx_environment(ucx_tls, host, device))


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def interface_of(host: str) -> str | None:
    """The network interface whose IPv4 address is ``host`` (None: none, or not an IPv4 address)."""
    try:
        wanted = socket.inet_aton(host)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                request = struct.pack("256s", name.encode()[:15])
                address = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)[20:24]
            except OSError:  # no IPv4 address on it
                continue
            if address == wanted:
                return name
    return None


_CONFIG_LOCK = threading.Lock()


def _event_driven_agent(api, name: str):
    """A ``nixl_agent`` whose progress thread waits on events (``pthrDelay`` > 0); the Python API hard-codes 0,
    a busy poll. The agent is built through the API with its config class swapped for one that keeps our delay.
    Its lock is the reader-writer one (see the module docstring)."""
    bindings = api.nixlBind
    real = bindings.nixlAgentConfig

    class _Config(real):
        def __setattr__(self, key, value):
            super().__setattr__(key, PROGRESS_WAKE_US if key == "pthrDelay" else value)

    config = api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False, backends=[],
                                   sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
    with _CONFIG_LOCK:
        bindings.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgentConfig = real


class Transfer:
    """One posted READ or WRITE. Its handle is used by one thread at a time and never after its release:
    checking a handle's state walks and relinks the handle's own request list inside NIXL, unguarded under
    the reader-writer lock, and a released handle is freed memory."""

    __slots__ = ("handle", "lock", "last")

    def __init__(self, handle) -> None:
        self.handle = handle
        self.lock = threading.Lock()
        self.last = "PROC"


class Agent:
    def __init__(self, name: str, *, backend: str = "UCX", ucx_tls: str = "tcp,shm", host: str = "127.0.0.1",
                 device: torch.device | str = "cpu", workers: int = 2) -> None:
        configure_environment(ucx_tls, host, torch.device(device))
        api = load_api()
        self.name, self.backend = name, backend
        self._agent = _event_driven_agent(api, name)
        self._agent.create_backend(backend, {"num_workers": str(workers)})
        self._registered: list = []
        self._lock = threading.Lock()

    @property
    def _live(self):
        agent = self._agent
        if agent is None:
            raise RuntimeError(f"nixl agent {self.name} is closed")
        return agent

    def backend_params(self) -> dict[str, str]:
        """The backend's parameters as the library reports them (``num_workers`` among them for UCX)."""
        return dict(self._live.get_backend_params(self.backend))

    # --- memory and peers -------------------------------------------------------------
    def register(self, tensor: torch.Tensor) -> Region:
        """Register a whole contiguous tensor with the backend (kept alive while registered)."""
        if not tensor.is_contiguous():
            raise ValueError("nixl registers contiguous tensors only")
        descs = self._live.register_memory(tensor)
        with self._lock:
            self._registered.append((tensor, descs))
        device_id = tensor.get_device() if tensor.is_cuda else 0
        return Region(tensor.data_ptr(), tensor.numel() * tensor.element_size(), "VRAM" if tensor.is_cuda else "DRAM",
                      device_id)

    def deregister(self, tensor: torch.Tensor) -> None:
        with self._lock:
            entries = [entry for entry in self._registered if entry[0] is tensor]
            self._registered = [entry for entry in self._registered if entry[0] is not tensor]
        for _, descs in entries:
            self._live.deregister_memory(descs)

    def metadata(self) -> bytes:
        """What a peer loads to address this agent's registered regions (after the latest registration)."""
        return bytes(self._live.get_agent_metadata())

    def load_peer(self, metadata: bytes) -> str:
        """Load (or reload, with newer regions) a peer's metadata; returns its agent name."""
        name = self._live.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def forget_peer(self, name: str) -> None:
        try:
            self._live.remove_remote_agent(name)
        except Exception as exc:  # already gone
            log.debug("nixl: removing peer %s: %s", name, exc)

    # --- transfers --------------------------------------------------------------------
    def post(self, op: str, local: np.ndarray, local_mem: str, remote: np.ndarray, remote_mem: str, peer: str,
             notif: bytes = b"") -> Transfer:
        """Start ``op`` ("READ": remote -> local, "WRITE": local -> remote) over paired descriptors.

        ``local`` / ``remote``: uint64 [N, 3] rows (address, bytes, device id), row i of one matching row i
        of the other. Returns the transfer; RuntimeError when it cannot start.
        """
        local_descs = self._live.get_xfer_descs(local, local_mem)
        remote_descs = self._live.get_xfer_descs(remote, remote_mem)
        xfer = Transfer(self._live.initialize_xfer(op, local_descs, remote_descs, peer, notif))
        with xfer.lock:
            started = self._live.transfer(xfer.handle)
        if started == "ERR":
            self.release(xfer)
            raise RuntimeError(f"nixl {op} to {peer} failed to start")
        return xfer

    def state(self, xfer: Transfer) -> str:
        """"PROC", "DONE" or "ERR" (a peer that went away, or a handle the agent no longer knows); a released
        transfer keeps the state it was released in."""
        with xfer.lock:
            if xfer.handle is None:
                return xfer.last
            try:
                xfer.last = self._live.check_xfer_state(xfer.handle)
            except Exception:
                xfer.last = "ERR"
            return xfer.last

    def release(self, xfer: Transfer) -> None:
        """Release a settled transfer (an unsettled one may still move bytes: see the receiver's held blocks);
        again is a no-op."""
        with xfer.lock:
            handle, xfer.handle = xfer.handle, None
            if handle is None:
                return
            try:
                self._live.release_xfer_handle(handle)
            except Exception as exc:
                log.debug("nixl: releasing a transfer handle: %s", exc)

    def notifications(self) -> dict[str, list[bytes]]:
        return self._live.get_new_notifs()

    def close(self) -> None:
        """Deregister everything and destroy the agent now (its progress thread stops here, not at exit)."""
        with self._lock:
            entries, self._registered = self._registered, []
            agent, self._agent = self._agent, None
        if agent is None:
            return
        for _, descs in entries:
            try:
                agent.deregister_memory(descs)
            except Exception as exc:
                log.debug("nixl: deregistering: %s", exc)
        del agent
