"""A small internet on one machine: Linux network namespaces joined by rate-limited links (root only).

:class:`Lab` makes one namespace per peer and a hub namespace that holds a bridge. Each peer's namespace
has one interface, ``eth0``, with the address 10.213.0.<i+1>/24, joined to the hub's bridge by a veth pair.
Both directions of every link go through ``tc ... tbf`` at ``mbit`` Mbit/s (upload on the peer's side,
download on the hub's), as a home or cloud uplink would. Every interface lives inside a namespace the lab
created, so no traffic can leave them, and deleting the namespaces removes everything. netem (delay, loss)
is not available on these machines; tbf (rate) is.

With ``delays_ms`` (one per peer) the lab routes instead of bridging: peer ``i`` has 10.214.<i>.2/24 behind
the hub's 10.214.<i>.1, and every packet the hub forwards waits in a user-space delay line
(peer/bench/delayline.py) for the sender's plus the receiver's delay, so two peers ``d_a`` and ``d_b`` ms from
the hub are ``2 (d_a + d_b)`` ms apart in round-trip time. ``up_mbit`` and ``down_mbit`` (one per peer) give
each link its own rates, upload slower than download as on a home line.

A process runs in peer ``i``'s namespace when started with :meth:`Lab.prefix` (``ip netns exec <ns>``, which
execs the command in place: the PID, and so the process group, stay the same).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence

from peer.bench.harness import Built

SUBNET = "10.213.0"
ROUTED = "10.214"  # 10.214.<i>.2: peer i of a routed lab (the delay line reads i from the third byte)


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


class Lab(Built):
    """``peers`` namespaces on one bridge, each link shaped to ``mbit`` Mbit/s both ways; or, with
    ``delays_ms``, on one router with a delay line, each link with its own rates and delay."""

    def __init__(
        self,
        peers: int,
        mbit: float,
        tag: str | None = None,
        firewalled: Iterable[int] = (),
        *,
        up_mbit: Sequence[float] | None = None,
        down_mbit: Sequence[float] | None = None,
        delays_ms: Sequence[float] | None = None,
    ) -> None:
        if not 1 <= peers <= 200:
            raise ValueError(f"a lab holds 1 to 200 peers, not {peers}")
        for name, values in (("up_mbit", up_mbit), ("down_mbit", down_mbit), ("delays_ms", delays_ms)):
            if values is not None and len(values) != peers:
                raise ValueError(f"{name} needs one value per peer ({peers}), not {len(values)}")
        self.peers, self.mbit = peers, mbit
        self.up = list(up_mbit or [mbit] * peers)
        self.down = list(down_mbit or [mbit] * peers)
        self.delays = list(delays_ms) if delays_ms is not None else None
        self.firewalled = set(firewalled)
        self.tag = tag or str(os.getpid() % 100000)
        self.hub = f"swarmlab{self.tag}-hub"
        self.made: list[str] = []
        self.line: subprocess.Popen | None = None

    def namespace(self, i: int) -> str:
        return f"swarmlab{self.tag}-{i}"

    def address(self, i: int) -> str:
        return f"{ROUTED}.{i}.2" if self.delays is not None else f"{SUBNET}.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program in peer ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def _build(self) -> None:
        routed = self.delays is not None
        self._namespace(self.hub)
        if routed:
            self._router()
        else:
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
        for i in range(self.peers):
            ns, link = self.namespace(i), f"h{i}"
            self._namespace(ns)
            _ip("-n", self.hub, "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            if routed:
                _ip("-n", self.hub, "addr", "add", f"{ROUTED}.{i}.1/24", "dev", link)
            else:
                _ip("-n", self.hub, "link", "set", link, "master", "br0")
            _ip("-n", self.hub, "link", "set", link, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            if routed:
                _ip("-n", ns, "route", "add", "default", "via", f"{ROUTED}.{i}.1")
            upload = _shape(self.up[i])
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *upload])
            if i in self.firewalled:
                self._firewall(link)
            else:
                download = _shape(self.down[i])
                _run(["ip", "netns", "exec", self.hub, "tc", "qdisc", "add", "dev", link, *download])

    def _router(self) -> None:
        """The hub forwards between its links through the delay line: ``dly0`` takes every packet that does
        not come out of the line (table 100), ``dly1`` gives them back after their delay (main table)."""
        hub = ["ip", "netns", "exec", self.hub]
        for key in ("ipv4/ip_forward", "ipv4/conf/all/rp_filter", "ipv4/conf/default/rp_filter"):
            value = "1" if key.endswith("forward") else "0"
            _run([*hub, "sh", "-c", f"echo {value} > /proc/sys/net/{key}"])
        self.line = subprocess.Popen(
            [*hub, sys.executable, "-m", "peer.bench.delayline", *(f"{d:g}" for d in self.delays or [])],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.line.stdout is not None
        if self.line.stdout.readline().strip() != "ready":
            raise LabError(f"the delay line did not start (exit code {self.line.poll()})")
        for dev in ("dly0", "dly1"):
            _ip("-n", self.hub, "link", "set", dev, "up")
        _ip("-n", self.hub, "rule", "add", "pref", "100", "iif", "dly1", "lookup", "main")
        _ip("-n", self.hub, "rule", "add", "pref", "200", "lookup", "100")
        _ip("-n", self.hub, "route", "add", "default", "dev", "dly0", "table", "100")

    def rtt_ms(self, a: int, b: int) -> float:
        """The median round trip (ms) of a small TCP message from peer ``a``'s namespace to peer ``b``'s."""
        module = [sys.executable, "-m", "peer.bench.delayline"]
        server = subprocess.Popen(
            [*self.prefix(b), *module, "--echo", self.address(b)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "ready":
                raise LabError("the echo server did not start")
            done = subprocess.run(
                [*self.prefix(a), *module, "--rtt", self.address(b)],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            if done.returncode:
                raise LabError(f"the RTT probe failed: {done.stderr.strip()[-300:]}")
            return float(done.stdout)
        finally:
            server.kill()
            server.wait()

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
        """Stop the delay line and delete every namespace this lab made (their interfaces go with them)."""
        if self.line is not None:
            self.line.kill()
            self.line.wait()
            self.line = None
        for name in reversed(self.made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self.made.clear()


def _shape(mbit: float) -> list[str]:
    """A ``tc qdisc add dev X`` tail that limits X's sending to ``mbit`` Mbit/s (tbf)."""
    burst = max(int(mbit * 1e6 / 8 / 100), 16 * 1514)  # 10 ms of traffic, at least a few full-size packets
    return ["root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms"]


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise LabError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")
