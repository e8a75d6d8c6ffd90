"""One-way link delays in user space, for a lab on a kernel without netem (peer/bench/netns.py).

The lab's hub namespace routes between its peers. Every packet that the hub would forward goes, by a policy
rule, into the TUN device ``dly0``; this process reads it, holds it for the sum of the sender's and the
receiver's one-way delays (each peer's distance to the hub), and writes it to the TUN device ``dly1``. A
packet that arrives on ``dly1`` is routed by the main table, to the receiver's link. Packets of one pair of
peers share one delay, so the line keeps their order. Peer ``i``'s address is 10.214.<i>.2, so the third byte
of an address names its peer.

Run by the lab as ``python -m peer.bench.delayline DELAY_MS ...`` (one per peer) inside the hub namespace;
it prints ``ready`` once both devices exist and runs until it is stopped. ``python -m peer.bench.delayline
--rtt HOST`` prints the round-trip time of small TCP messages to a :func:`echo` server on HOST.
"""

from __future__ import annotations

import fcntl
import heapq
import os
import select
import socket
import statistics
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
ECHO_PORT = 5599


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def forward(delays_ms: list[float], subnet_byte: int = 214) -> None:
    """Read packets from ``dly0``, write each to ``dly1`` after its pair's delay; runs until killed."""
    inbound, outbound = open_tun("dly0"), open_tun("dly1")
    delays = [d / 1000 for d in delays_ms]

    def delay(address: bytes) -> float:  # a peer's one-way distance to the hub, from its IPv4 address
        if address[0] == 10 and address[1] == subnet_byte and address[2] < len(delays):
            return delays[address[2]]
        return 0.0

    print("ready", flush=True)
    queue: list[tuple[float, int, bytes]] = []
    seq = 0
    while True:
        wait = max(0.0, queue[0][0] - time.monotonic()) if queue else 1.0
        readable, _, _ = select.select([inbound], [], [], wait)
        now = time.monotonic()
        if readable:
            while True:
                try:
                    packet = os.read(inbound, 65536)
                except BlockingIOError:
                    break
                if len(packet) >= 20 and packet[0] >> 4 == 4:
                    due = now + delay(packet[12:16]) + delay(packet[16:20])
                    heapq.heappush(queue, (due, seq, packet))
                    seq += 1
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            packet = heapq.heappop(queue)[2]
            try:
                os.write(outbound, packet)
            except (BlockingIOError, OSError):
                pass  # a full device queue drops the packet, as a router's would


def echo(host: str, port: int = ECHO_PORT) -> None:
    """Answer every message of every connection with itself (the other end of :func:`rtt`)."""
    server = socket.create_server((host, port))
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(64):
                conn.sendall(data)


def rtt(host: str, port: int = ECHO_PORT, rounds: int = 10) -> float:
    """The median round-trip time (ms) of a 1-byte TCP message to :func:`echo` on ``host``."""
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            conn.sendall(b"x")
            conn.recv(1)
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


if __name__ == "__main__":
    if sys.argv[1] == "--echo":
        echo(sys.argv[2])
    elif sys.argv[1] == "--rtt":
        print(f"{rtt(sys.argv[2]):.1f}", flush=True)
    else:
        forward([float(a) for a in sys.argv[1:]])
