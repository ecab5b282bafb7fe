"""Shaped links for the transfer benchmark: two network namespaces joined by a veth pair.

    with ShapedLink() as link:          # needs root, `ip` and `tc`
        link.set_rate("1gbit")          # tbf on both veth ends
        link.exec_prefix("a")           # ["ip", "netns", "exec", "pdkv-a"]
        link.address("b")               # 10.213.7.2

Everything it creates is named pdkv-* and removed on exit.
"""

from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = "10.213.7"
NAMESPACES = {"a": "pdkv-a", "b": "pdkv-b"}
DEVICES = {"a": "pdkv-va", "b": "pdkv-vb"}
ADDRESSES = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}


def available() -> str | None:
    """None when shaped links can be built here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "shaped links need root (network namespaces and tc); skipping them"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"shaped links need {' and '.join(missing)} (apt-get install iproute2); skipping them"
    return None


def _run(*cmd: str, check: bool = True) -> None:
    subprocess.run(cmd, check=check, capture_output=True, text=True)


class ShapedLink:
    def __enter__(self) -> ShapedLink:
        self.teardown()  # leftovers of an interrupted run
        try:
            for side, ns in NAMESPACES.items():
                _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", DEVICES["a"], "type", "veth", "peer", "name", DEVICES["b"])
            for side, ns in NAMESPACES.items():
                _run("ip", "link", "set", DEVICES[side], "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{ADDRESSES[side]}/24", "dev", DEVICES[side])
                _run("ip", "-n", ns, "link", "set", DEVICES[side], "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.teardown()
            raise RuntimeError(f"cannot build the shaped link: {exc.stderr.strip()}") from None
        return self

    def set_rate(self, rate: str) -> None:
        """Token bucket on both ends; burst sized for the rate (>= one GSO packet)."""
        burst = "4mb" if rate.startswith("10") else "512kb"
        for side, ns in NAMESPACES.items():
            _run("tc", "-n", ns, "qdisc", "replace", "dev", DEVICES[side], "root", "tbf", "rate", rate, "burst", burst,
                 "latency", "50ms")

    def exec_prefix(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", NAMESPACES[side]]

    def address(self, side: str) -> str:
        return ADDRESSES[side]

    def device(self, side: str) -> str:
        return DEVICES[side]

    def teardown(self) -> None:
        for ns in NAMESPACES.values():
            _run("ip", "netns", "del", ns, check=False)

    def __exit__(self, *exc) -> None:
        self.teardown()
