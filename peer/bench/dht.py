"""``dht``: what the swarm's DHT reads cost as the swarm grows. N DHT nodes on 127.0.0.1 (a swarm node's
SwarmDHT, each with its own p2p daemon); in each round every node stores its record (1.5 KB, one subkey per
node) under one key, as a peer stores its progress, then every node reads the key's latest value, as a peer
reads the swarm's progress. The CPU that all DHT processes and daemons spend per store and read, with
hivemind's reads (a read asks every node, then pushes what it found to one more) against the swarm's (a read
asks the nodes nearest the key, swarm/patches/dht_store.py), in turn, for each N; and whether every read found
every node's record."""

from __future__ import annotations

import os
import time
from typing import Any

from peer.bench.harness import Bench, Options, table

SIZES = (9, 17)  # nodes: the volunteers lab's 8 peers and its bootstrap, and twice as many
ROUNDS = 30
RECORD_BYTES = 1500
PAIRS = 2  # each N: hivemind's reads and the swarm's, this many times in turn


def _helpers(cpu: dict[str, float] | None) -> float:
    if cpu is None:
        raise RuntimeError("dht: needs /proc to count the DHT processes' CPU")
    return cpu["helpers"]


def _cost(n: int, narrow: bool, rounds: int = ROUNDS) -> tuple[float, int, int]:
    """``n`` nodes, ``rounds`` rounds of a store and a read per node: (ms of CPU per store and read, the
    fewest and the most records a read found)."""
    from hivemind.utils import get_dht_time

    from swarm.patches.dht import SwarmDHT
    from swarm.training.sysmetrics import cpu_seconds

    class Node(SwarmDHT):
        narrow_reads = narrow

    nodes: list[Any] = []
    value = os.urandom(RECORD_BYTES)

    def one_round() -> list[int]:
        for i, dht in enumerate(nodes):
            dht.store("progress", subkey=f"p{i}", value=value, expiration_time=get_dht_time() + 30,
                      return_future=True)  # fmt: skip
        reads = [dht.get("progress", latest=True, return_future=True) for dht in nodes]
        found = [f.result(timeout=60) for f in reads]
        return [len(f.value) if f is not None else 0 for f in found]

    try:
        for _ in range(n):
            initial = [str(m) for m in nodes[0].get_visible_maddrs()] if nodes else []
            nodes.append(Node(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True))
        for _ in range(5):  # warm up: every node learns of every other
            one_round()
            time.sleep(0.2)
        # the DHT processes and their daemons are this process's descendants
        before, seen = _helpers(cpu_seconds()), []
        for _ in range(rounds):
            seen += one_round()
            time.sleep(0.2)
        used = _helpers(cpu_seconds()) - before
    finally:
        for dht in nodes:
            dht.shutdown()
    return used / (rounds * n) * 1000, min(seen), max(seen)


def run(bench: Bench, opts: Options) -> None:
    for n in SIZES:
        for pair in range(PAIRS):
            costs = {}
            for mode, narrow in (("hivemind", False), ("swarm", True)):
                costs[mode] = ms, fewest, most = _cost(n, narrow)
                bench.record({"scenario": "dht", "mode": mode, "nodes": n, "pair": pair, "rounds": ROUNDS,
                              "cpu_ms_per_store_and_read": round(ms, 2), "records_found_min": fewest,
                              "records_found_max": most,
                              "vs_hivemind": round(ms / costs["hivemind"][0], 3)})  # fmt: skip
                print(f"dht {n} nodes, {mode} reads (pair {pair}): {ms:.1f} ms of the DHT processes' and "
                      f"daemons' CPU per store and read ({ms / costs['hivemind'][0]:.2f}x hivemind's); "
                      f"each read found {fewest}-{most} of {n} records", flush=True)  # fmt: skip


def summary_table(rows: list[dict[str, Any]]) -> str:
    header = ["nodes", "pair", "reads", "CPU ms per store and read", "vs hivemind's reads",
              "records a read found"]  # fmt: skip

    def cells(r: dict[str, Any]) -> list[Any]:
        return [r["nodes"], r["pair"], r["mode"], r["cpu_ms_per_store_and_read"], f"{r['vs_hivemind']:.2f}",
                f"{r['records_found_min']}-{r['records_found_max']} of {r['nodes']}"]  # fmt: skip

    return table(rows, "dht", header, cells)
