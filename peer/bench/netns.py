"""A small internet on one machine: Linux network namespaces joined by rate-limited links (root only).

:class:`Lab` makes one namespace per peer and a hub namespace that holds a bridge. Each peer's namespace
has one interface, ``eth0``, with the address 10.213.0.<i+1>/24, joined to the hub's bridge by a veth pair.
Both directions of every link go through ``tc ... tbf`` at ``mbit`` Mbit/s (upload on the peer's side,
download on the hub's), as a home or cloud uplink would. Every interface lives inside a namespace the lab
created, so no traffic can leave them, and deleting the namespaces removes everything. netem (delay, loss)
is not available on these machines; tbf (rate) is.

A process runs in peer ``i``'s namespace when started with :meth:`Lab.prefix` (``ip netns exec <ns>``, which
execs the command in place: the PID, and so the process group, stay the same).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from typing import Any

SUBNET = "10.213.0"


def unavailable() -> str | None:
    """Why a lab cannot be built here (one line), or None if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc); run it as root (a VM, or a container with NET_ADMIN)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2); install iproute2"
    return None


class LabError(RuntimeError):
    pass


class Lab:
    """``peers`` namespaces on one bridge, each link shaped to ``mbit`` Mbit/s both ways."""

    def __init__(
        self, peers: int, mbit: float, tag: str | None = None, firewalled: Iterable[int] = ()
    ) -> None:
        if not 1 <= peers <= 200:
            raise ValueError(f"a lab holds 1 to 200 peers, not {peers}")
        self.peers, self.mbit = peers, mbit
        self.firewalled = set(firewalled)
        self.tag = tag or str(os.getpid() % 100000)
        self.hub = f"swarmlab{self.tag}-hub"
        self.made: list[str] = []

    def namespace(self, i: int) -> str:
        return f"swarmlab{self.tag}-{i}"

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program in peer ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def __enter__(self) -> Lab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _build(self) -> None:
        # tbf's bucket: 10 ms of traffic, at least a few full-size packets
        burst = max(int(self.mbit * 1e6 / 8 / 100), 16 * 1514)
        shape = ["root", "tbf", "rate", f"{self.mbit}mbit", "burst", str(burst), "latency", "200ms"]
        self._namespace(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i in range(self.peers):
            ns, link = self.namespace(i), f"h{i}"
            self._namespace(ns)
            _ip("-n", self.hub, "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.hub, "link", "set", link, "master", "br0")
            _ip("-n", self.hub, "link", "set", link, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *shape])  # upload
            if i in self.firewalled:
                self._firewall(link)
            else:
                _run(["ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", link, *shape])  # download

    def _firewall(self, link: str) -> None:
        """Shape the download of the peer behind the hub's ``link`` like the others, and let no connection
        from outside in.

        These machines' kernels have no netfilter tools, so the firewall is built from qdiscs on the hub's
        side of the link: every TCP segment towards the peer with SYN set and ACK clear (someone else opening
        a connection) goes to a class whose queue holds nothing. Connections the peer opens work (the answer
        to its SYN has ACK set); connections to it never arrive, as behind a home router's NAT. The match
        assumes IPv4 headers without options (IHL 5).
        """
        tc = ["ip", "netns", "exec", self.hub, "tc"]
        syn = "match ip protocol 6 0xff match u8 0x45 0xff at 0 match u8 0x02 0x12 at 33"
        for command in (
            f"qdisc add dev {link} root handle 1: htb default 10 r2q 1000",
            f"class add dev {link} parent 1: classid 1:10 htb rate {self.mbit}mbit",
            f"class add dev {link} parent 1: classid 1:30 htb rate 1mbit",
            f"qdisc add dev {link} parent 1:30 handle 30: pfifo limit 0",
            f"filter add dev {link} parent 1: protocol ip prio 1 u32 {syn} flowid 1:30",
        ):
            _run([*tc, *command.split()])

    def _namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def close(self) -> None:
        """Delete every namespace this lab made (their interfaces go with them)."""
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self.made.clear()


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise LabError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")
