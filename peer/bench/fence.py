"""``fence``: what an invite-only swarm costs. Two peers train the demo for a fixed number of global epochs,
open and invite-only in turn (``pairs`` times each, alternating, so that the machine's noise hits both):
samples/s of each, and their ratio within each pair. The fence signs and checks every DHT request and
response and checks each averaging partner (swarm/fence.py)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from peer.bench.harness import Bench, Options, peer_rate, swarm, table


def run(bench: Bench, opts: Options, pairs: int = 3, epochs: int = 60) -> None:
    from swarm.invite import load_or_create_owner_key, make_invite

    stamp = int(time.time())
    key, _ = load_or_create_owner_key(bench.work / f"bench-fence-{stamp}-owner.pem")
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
    header = ["pair", "swarm", "samples/s (2 peers)", "s per global epoch", "vs the open swarm of the pair",
              "final val acc"]  # fmt: skip
    return table(
        rows,
        "fence",
        header,
        lambda r: [
            r["pair"],
            r["mode"],
            r["samples_per_second"],
            r["seconds_per_global_epoch"],
            f"{r['vs_open']:.2f}",
            ", ".join(str(a) for a in r["final_val_acc"]),
        ],  # fmt: skip
    )
