"""``comm``: for each --compression mode and for DiLoCo, two real peers (``swarm-peer join``) train the demo
model for the same number of samples, with the state (parameters) averaged every 10th global epoch. Bytes
sent are the averagers' own counters (swarm/patches/traffic.py), per averaging round (global epoch) and per
training sample, and apart for gradient and state rounds; validation accuracy is each peer's final one."""

from __future__ import annotations

import time
from typing import Any

from peer.bench.harness import Bench, Options, swarm, table

MODES = ("none", "fp16", "int8", "powersgd:4", "diloco", "diloco+int8")
STATE_EVERY = 10  # every mode averages the parameters (state) every 10th global epoch


def run(bench: Bench, opts: Options, batch: int = 32) -> None:
    """Two peers per mode, ``samples`` training samples in all (both peers together)."""
    samples, local_steps = opts.samples or 4096, opts.local_steps
    for mode in MODES:
        diloco = mode.startswith("diloco")
        # gradients: a global epoch every 128 samples (the demo's target); DiLoCo: 2 peers x H x batch
        target = 2 * local_steps * batch if diloco else 128
        epochs = max(2, samples // target)
        run = f"bench-comm-{mode.replace(':', '').replace('+', '-')}-{int(time.time())}"
        extra = (
            ["--averaging", "diloco", "--local-steps", str(local_steps)]
            if diloco
            else ["--compression", mode]
        )
        if mode == "diloco+int8":  # 8-bit pseudo-gradients, as in INTELLECT-1
            extra += ["--compression", "int8"]
        extra += ["--average-state-every", str(STATE_EVERY)]
        started = time.time()
        sums = swarm(
            bench,
            run,
            2,
            [
                "--batch-size",
                str(batch),
                "--target-batch-size",
                str(target),
                "--max-epochs",
                str(epochs),
                *extra,
            ],
        )
        wall = time.time() - started
        trained = sum(h["samples"] for s in sums for h in s["history"])
        sent = sum(s["bytes_sent"] for s in sums)
        rounds = max(s["final_epoch"] for s in sums) - min(s.get("loaded_epoch") or 0 for s in sums)
        accs = [s["final_val"]["acc"] for s in sums if s.get("final_val")]
        bench.record(
            {
                "scenario": "comm",
                "mode": mode,
                "local_steps": local_steps if diloco else None,
                "target_batch_size": target,
                "global_epochs": max(s["final_epoch"] for s in sums),
                "samples_trained": trained,
                "bytes_sent_both_peers": sent,
                "bytes_per_round_per_peer": sent / 2 / max(rounds, 1),
                "bytes_per_sample": sent / max(trained, 1),
                "gradient_bytes_per_round_per_peer": sum(s["bytes_sent_gradients"] for s in sums)
                / 2
                / max(rounds, 1),
                "state_bytes_per_state_round_per_peer": sum(s["bytes_sent_state"] for s in sums)
                / 2
                / max(rounds // STATE_EVERY, 1),
                "average_state_every": STATE_EVERY,
                "val_acc": sum(accs) / len(accs) if accs else None,
                "val_acc_per_peer": accs,
                "wall_seconds": round(wall, 1),
            }
        )
        print(_comm_line(bench.rows[-1]), flush=True)


def _comm_line(r: dict[str, Any]) -> str:
    acc = f"{r['val_acc']:.3f}" if r["val_acc"] is not None else "-"
    return (
        f"comm {r['mode']:>11}: {r['bytes_per_round_per_peer'] / 1e6:8.3f} MB/round/peer  "
        f"{r['bytes_per_sample']:10.1f} B/sample  val acc {acc}  ({r['global_epochs']} global epochs, "
        f"{r['samples_trained']} samples, {r['wall_seconds']:.0f} s)"
    )


def summary_table(rows: list[dict[str, Any]]) -> str:
    comm_rows = [r for r in rows if r["scenario"] == "comm"]
    base = next((r for r in comm_rows if r["mode"] == "none"), comm_rows[0]) if comm_rows else None
    header = [
        "mode",
        "bytes / round / peer",
        "of which gradients",
        "bytes / state round / peer",
        "bytes / sample",
        "vs none",
        "val acc",
        "global epochs",
        "samples",
    ]
    return table(
        rows,
        "comm",
        header,
        lambda r: [
            r["mode"].replace("diloco", f"diloco H={r['local_steps']}"),
            f"{r['bytes_per_round_per_peer']:,.0f}",
            f"{r['gradient_bytes_per_round_per_peer']:,.0f}",
            f"{r['state_bytes_per_state_round_per_peer']:,.0f}",
            f"{r['bytes_per_sample']:,.1f}",
            f"{base['bytes_per_sample'] / max(r['bytes_per_sample'], 1e-9):.1f}x fewer",
            "-" if r["val_acc"] is None else f"{r['val_acc']:.3f}",
            r["global_epochs"],
            r["samples_trained"],
        ],  # fmt: skip
    )
