"""``fence``: what an invite-only swarm costs. First a DHT store among 3 nodes, open and fenced (twice each);
then two peers train the demo for a fixed number of global epochs,
open and invite-only in turn (``pairs`` times each, alternating, so that the machine's noise hits both):
samples/s of each, and their ratio within each pair. The fence checks the access token of every DHT request
and response (swarm/net/authorizer.py) and each averaging partner (swarm/net/fence.py)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from peer.bench.harness import Bench, Options, peer_rate, swarm, table


def _store_cost(invite: str | None, run_id: str, stores: int = 300) -> tuple[float, float]:
    """Three DHT nodes started as every role starts them (open, or with ``invite``); one stores ``stores``
    times in a row: (wall ms per store, ms of the DHT processes' CPU per store)."""
    import os

    from hivemind.utils import get_dht_time

    from swarm.config import SwarmConfig
    from swarm.net.node import start_node

    def cpu(pids: list[int]) -> float:
        ticks = 0
        for pid in pids:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime + stime
        return ticks / os.sysconf("SC_CLK_TCK")

    nodes: list[Any] = []
    try:
        for _ in range(3):
            initial = tuple(str(m) for m in nodes[0].dht.get_visible_maddrs()) if nodes else ()
            cfg = SwarmConfig(run_id=run_id, host_maddrs=("/ip4/127.0.0.1/tcp/0",), initial_peers=initial,
                              invite=invite)  # fmt: skip
            nodes.append(start_node(cfg))
        writer = nodes[-1].dht
        for i in range(20):  # warm up: routing tables, token verdicts
            writer.store("bench", subkey=b"s", value=i, expiration_time=get_dht_time() + 60)
        cpu0, wall0 = cpu([n.dht.pid for n in nodes]), time.perf_counter()
        for i in range(stores):
            writer.store("bench", subkey=b"s", value=i, expiration_time=get_dht_time() + 60)
        wall, used = time.perf_counter() - wall0, cpu([n.dht.pid for n in nodes]) - cpu0
    finally:
        for node in nodes:
            node.stop()
    return wall / stores * 1000, used / stores * 1000


def run(bench: Bench, opts: Options, pairs: int = 3, epochs: int = 60) -> None:
    from swarm.net.invite import load_or_create_owner_key, make_invite

    stamp = int(time.time())
    key, _ = load_or_create_owner_key(bench.work / f"bench-fence-{stamp}-owner.pem")
    store_run = f"bench-fence-{stamp}-store"
    make_invite(key, store_run, "bench", 3600.0).save(bench.work / f"{store_run}.tok")
    for n in range(2):
        costs = {mode: _store_cost(path, store_run) for mode, path in
                 (("open", None), ("invite-only", str(bench.work / f"{store_run}.tok")))}  # fmt: skip
        for mode, (wall, used) in costs.items():
            bench.record({"scenario": "fence", "mode": mode, "pair": f"store {n}",
                          "dht_store_ms": round(wall, 2), "dht_cpu_ms_per_store": round(used, 2),
                          "vs_open": round(costs["open"][0] / wall, 3)})  # fmt: skip
            print(f"fence DHT store {n}, {mode}: {wall:.2f} ms per store among 3 nodes, DHT processes' CPU "
                  f"{used:.2f} ms per store", flush=True)  # fmt: skip
    args = ["--max-epochs", str(epochs)]
    for n in range(pairs):
        rates = {}
        for mode in ("open", "invite-only"):
            run_id = f"bench-fence-{stamp}-{n}-{mode}"
            env = None
            if mode == "invite-only":
                invite = bench.work / f"{run_id}.tok"
                make_invite(key, run_id, "bench", 3600.0).save(invite)
                env = {"SWARM_INVITE": str(invite)}
            sums = swarm(bench, run_id, 2, args, env, seed=n)
            rates[mode] = sum(peer_rate(s) for s in sums)
            wall = statistics.mean(s["train_seconds"] for s in sums)
            bench.record(
                {
                    "scenario": "fence",
                    "mode": mode,
                    "pair": n,
                    "peers": 2,
                    "global_epochs": epochs,
                    "samples_per_second": round(rates[mode], 1),
                    "seconds_per_global_epoch": round(wall / epochs, 3),
                    "vs_open": round(rates[mode] / rates["open"], 3),
                    "final_val_acc": [
                        round((s.get("final_val") or {}).get("acc", float("nan")), 3) for s in sums
                    ],
                }
            )
            r = bench.rows[-1]
            print(
                f"fence pair {n}, {mode}: {r['samples_per_second']:.1f} samples/s, "
                f"{r['seconds_per_global_epoch']:.2f} "
                f"s per global epoch, {r['vs_open']:.2f}x the open swarm of the pair",
                flush=True,
            )


def summary_table(rows: list[dict[str, Any]]) -> str:
    header = ["pair", "swarm", "samples/s (2 peers), or ms per DHT store",
              "s per global epoch, or DHT CPU ms per store", "speed vs the open swarm of the pair",
              "final val acc"]  # fmt: skip

    def cells(r: dict[str, Any]) -> list[Any]:
        if "dht_store_ms" in r:
            store = [r["dht_store_ms"], r["dht_cpu_ms_per_store"]]
            return [r["pair"], r["mode"], *store, f"{r['vs_open']:.2f}", "-"]
        return [r["pair"], r["mode"], r["samples_per_second"], r["seconds_per_global_epoch"],
                f"{r['vs_open']:.2f}", ", ".join(str(a) for a in r["final_val_acc"])]  # fmt: skip

    return table(rows, "fence", header, cells)
