"""``wan``: two peers behind rate-limited links (``--wan-mbit``, 20 Mbit/s each way by default), the wall time
to reach a fixed validation accuracy with gradient averaging in fp32, in int8, and with DiLoCo + int8.

Loopback flatters communication: it moves gigabytes per second, so the ``scaling`` scenario hardly sees the
bytes. Here the bootstrap and each peer run in their own Linux network namespace (peer/bench/netns.py),
joined by veth links shaped with ``tc ... tbf``. One process on the loopback, same model and samples, is the
baseline in the same run. Every run trains the demo's model for the same number of samples (the demo's 120
global epochs of 256) and validates every 1024 samples; "time to X" is from launching the processes (start-up
and the DHT join included) to the first validation at or above X, on the fastest peer. Needs root; without it
the scenario says why in one line and records nothing.
"""

from __future__ import annotations

import time
from typing import Any

from peer.bench.harness import Bench, Options, fmt, local, swarm, table

TARGET_ACC = 0.8  # the demo's model passes it after about half of its 120 global epochs
SAMPLES = 120 * 256  # the demo's budget
GRAD_TARGET = 256
DILOCO_H = 16  # 16 local steps of 32 per peer and outer round: 30 outer rounds in the budget
STATE_EVERY = 10  # parameters averaged every 10th global epoch, as the flagship config does over the internet
MODES: dict[str, list[str]] = {
    "fp32": ["--compression", "none"],
    "int8": ["--compression", "int8"],
    "diloco+int8": ["--averaging", "diloco", "--local-steps", str(DILOCO_H), "--compression", "int8"],
}


def run(bench: Bench, opts: Options, modes: tuple[str, ...] = tuple(MODES), samples: int = SAMPLES) -> None:
    from peer.bench.netns import Lab, LabError, unavailable

    reason = unavailable()
    if reason:
        print(f"wan: skipped, {reason}", flush=True)
        return
    stamp, batch, peers = int(time.time()), 32, 2
    epochs = max(2, samples // GRAD_TARGET)
    evals = max(1, 1024 // GRAD_TARGET)
    started = time.time()
    single = local(
        bench,
        f"bench-wan-{stamp}",
        "single",
        1,
        ["--batch-size", str(batch), "--target-batch-size", str(GRAD_TARGET), "--max-epochs", str(epochs),
         "--eval-every", str(evals)],
    )  # fmt: skip
    single_wall = single["started_at"] - started  # the run's val_curve counts from the start of training
    single_time = _first([(single_wall + t, acc) for t, _, acc in single.get("val_curve", [])])
    try:
        lab = Lab(peers + 1, opts.wan_mbit)
        lab.__enter__()
    except LabError as exc:
        print(f"wan: skipped, could not build the network namespaces: {exc}", flush=True)
        return
    try:
        for mode in modes:
            diloco = mode.startswith("diloco")
            target = peers * DILOCO_H * batch if diloco else GRAD_TARGET
            rounds = max(2, samples // target)
            args = ["--batch-size", str(batch), "--target-batch-size", str(target), "--max-epochs",
                    str(rounds), "--average-state-every", str(STATE_EVERY), *MODES[mode]]  # fmt: skip
            args += ["--eval-every", str(max(1, 1024 // target))]
            # the demo's schedule counts global epochs: DiLoCo warms up and decays over its outer rounds
            env = {"SWARM_WARMUP_EPOCHS": "1", "SWARM_SCHEDULE_EPOCHS": str(rounds)} if diloco else None
            launched = time.time()
            sums = swarm(bench, f"bench-wan-{mode.replace('+', '-')}-{stamp}", peers, args, env, lab=lab)
            wall = time.time() - launched
            per_peer = [
                _first(
                    [
                        (h["time"] - launched, h["val_acc"])
                        for h in s["history"]
                        if h.get("val_acc") is not None
                    ]
                )
                for s in sums
            ]
            reached = [t for t in per_peer if t is not None]
            accs = [s["final_val"]["acc"] for s in sums if s.get("final_val")]
            bench.record(
                {
                    "scenario": "wan",
                    "mode": mode,
                    "mbit_per_second": opts.wan_mbit,
                    "workers": peers,
                    "target_batch_size": target,
                    "local_steps": DILOCO_H if diloco else None,
                    "average_state_every": STATE_EVERY,
                    "global_epochs": max(s["final_epoch"] for s in sums),
                    "samples": samples,
                    "target_acc": TARGET_ACC,
                    "seconds_to_target": round(min(reached), 1) if reached else None,
                    "seconds_to_target_per_peer": [None if t is None else round(t, 1) for t in per_peer],
                    "single_seconds_to_target": None if single_time is None else round(single_time, 1),
                    "vs_single": round(min(reached) / single_time, 2) if reached and single_time else None,
                    "wall_seconds": round(wall, 1),
                    "single_wall_seconds": round(single_wall + single["wall_seconds"], 1)
                    if "wall_seconds" in single
                    else None,
                    "final_val_acc": round(sum(accs) / len(accs), 4) if accs else None,
                    "single_final_val_acc": single.get("best_val_acc"),
                    "bytes_sent_per_peer": round(sum(s["bytes_sent"] for s in sums) / len(sums)),
                    "loaded_epoch_per_peer": [s.get("loaded_epoch") or 0 for s in sums],
                    "local_fallback_steps": sum(s.get("local_fallback_steps", 0) for s in sums),
                }
            )
            print(line(bench.rows[-1]), flush=True)
    finally:
        lab.close()


def _first(curve: list[tuple[float, float]]) -> float | None:
    """The first time in ``curve`` (time, accuracy) at which the accuracy reached TARGET_ACC."""
    return next((t for t, acc in curve if acc >= TARGET_ACC), None)


def line(r: dict[str, Any]) -> str:
    return (
        f"wan {r['mode']:>11} at {r['mbit_per_second']:g} Mbit/s: val acc {TARGET_ACC} after "
        f"{fmt(r['seconds_to_target'], 1)} s (one process on loopback "
        f"{fmt(r['single_seconds_to_target'], 1)} s, "
        f"ratio {fmt(r['vs_single'], 2)}); {r['global_epochs']} global epochs in {r['wall_seconds']:.0f} s, "
        f"final val acc {fmt(r['final_val_acc'])}, {r['bytes_sent_per_peer'] / 1e6:.1f} MB sent per peer"
    )


def summary_table(rows: list[dict[str, Any]]) -> str:
    header = [
        "mode",
        "link",
        "target batch",
        "global epochs",
        f"s to val acc {TARGET_ACC}",
        "one process s",
        "vs one process",
        "wall s",
        "final val acc",
        "MB sent / peer",
    ]
    return table(
        rows,
        "wan",
        header,
        lambda r: [
            r["mode"].replace("diloco", f"diloco H={r['local_steps']}"),
            f"{r['mbit_per_second']:g} Mbit/s",
            r["target_batch_size"],
            r["global_epochs"],
            fmt(r["seconds_to_target"], 1),
            fmt(r["single_seconds_to_target"], 1),
            fmt(r["vs_single"], 2),
            f"{r['wall_seconds']:.0f}",
            fmt(r["final_val_acc"]),
            f"{r['bytes_sent_per_peer'] / 1e6:.1f}",
        ],  # fmt: skip
    )
