"""``parity``: a 2-peer swarm with target batch B against one process with batch B, for the same samples and
global batch, over several seeds."""

from __future__ import annotations

import time
from typing import Any

from peer.bench.harness import Bench, Options, fmt, local, samples_per_epoch, swarm, table
from swarm.config import build_config


def run(bench: Bench, opts: Options, target: int = 128, batch: int = 32) -> None:
    """Two peers with target batch B (``batch`` per step each) against one process with batch B, for the
    same number of samples, once per seed (the initial weights and the data order); validation accuracy of
    the final parameters on the whole validation set, mean and standard deviation over the seeds."""
    # 16384 samples (128 epochs of 128, 11 passes over the digits): both reach about 0.91, where seeds differ
    # by 2 to 3 points. At 4096 (32 epochs) both were near 0.7 with seeds 4 to 11 points apart, and the
    # difference of the means could not tell 1 point from noise (+2.8 +- 7.8 points in one run)
    epochs = max(2, (opts.samples or 16384) // target)
    stamp = int(time.time())
    shared = ["--target-batch-size", str(target), "--max-epochs", str(epochs)]
    # the learning rate's cosine ends with the run, as in the demo config (which ends it at its 160 epochs):
    # with the demo's schedule of 155 epochs a 32-epoch run ended near the peak learning rate, and its final
    # accuracy was a snapshot of a noisy phase (sd 4 to 11 points between seeds)
    warmup = build_config("demo").train.warmup_epochs
    schedule = {"SWARM_SCHEDULE_EPOCHS": str(max(1, epochs - warmup))}
    swarm_accs, single_accs, computed = [], [], []
    for seed in range(opts.seeds):
        # the same initial weights for the swarm and the process
        init = {"SWARM_INIT_SEED": str(seed), **schedule}
        run = f"bench-parity-{stamp}-{seed}"
        peers = swarm(bench, f"{run}-swarm", 2, ["--batch-size", str(batch), *shared], init, seed=seed)
        alone = ["--batch-size", str(target), *shared, "--seed", str(seed)]
        single = local(bench, run, "single", 1, alone, init)
        accs = [s["final_val"]["acc"] for s in peers if s.get("final_val")]
        computed.append(samples_per_epoch(peers))
        curve = single.get("val_curve") or []
        swarm_accs.append(sum(accs) / len(accs) if accs else float("nan"))
        single_accs.append(curve[-1][2] if curve else float("nan"))
        print(
            f"parity seed {seed}: 2-peer swarm val acc {fmt(swarm_accs[-1])}, "
            f"one process {fmt(single_accs[-1])}",
            flush=True,
        )
    paired = [a - b for a, b in zip(swarm_accs, single_accs, strict=True)]
    bench.record(
        {
            "scenario": "parity",
            "target_batch_size": target,
            "swarm_batch_per_step": batch,
            "global_epochs": epochs,
            "samples": epochs * target,
            "seeds": opts.seeds,
            # what the two peers computed per global epoch together (the target when each counts the other's
            # samples; up to twice it when each reaches the target alone, as with epochs shorter than the
            # progress tracker's 0.5 s between reads)
            "swarm_samples_per_global_epoch": round(_mean(computed), 1),
            "swarm_val_acc": _mean(swarm_accs),
            "swarm_val_acc_std": _std(swarm_accs),
            "swarm_val_acc_per_seed": swarm_accs,
            "single_val_acc": _mean(single_accs),
            "single_val_acc_std": _std(single_accs),
            "single_val_acc_per_seed": single_accs,
            "schedule_epochs": int(schedule["SWARM_SCHEDULE_EPOCHS"]),
            # per seed, swarm minus one process (same initial weights): their mean and its standard error
            "paired_difference": _mean(paired),
            "paired_difference_sem": _std(paired) / len(paired) ** 0.5,
        }
    )
    r = bench.rows[-1]
    print(
        f"parity: {r['samples']} samples in {epochs} global epochs of {target}, {opts.seeds} seeds; "
        f"2-peer swarm val acc {fmt(r['swarm_val_acc'])} +- {fmt(r['swarm_val_acc_std'])}, "
        f"one process (batch {target}) {fmt(r['single_val_acc'])} +- {fmt(r['single_val_acc_std'])}; the "
        f"swarm computed {r['swarm_samples_per_global_epoch']:.0f} samples per global epoch (target "
        f"{target}); per seed the swarm minus one process: {100 * r['paired_difference']:+.1f} +- "
        f"{100 * r['paired_difference_sem']:.1f} points (mean +- standard error)",
        flush=True,
    )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: list[float]) -> float:
    import statistics

    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def summary_table(rows: list[dict[str, Any]]) -> str:
    def diff(r: dict[str, Any]) -> str:
        if r["swarm_val_acc"] is None or r["single_val_acc"] is None:
            return "-"
        text = f"{100 * (r['swarm_val_acc'] - r['single_val_acc']):+.1f} points"
        if r.get("paired_difference_sem") is not None:  # rows that carry the paired difference
            paired, sem = 100 * r["paired_difference"], 100 * r["paired_difference_sem"]
            text += f" (per seed {paired:+.1f} +- {sem:.1f})"
        return text

    header = [
        "target batch B",
        "samples",
        "seeds",
        "2-peer swarm val acc (mean +- sd)",
        "one process (batch B) val acc (mean +- sd)",
        "difference",
    ]
    return table(
        rows,
        "parity",
        header,
        lambda r: [
            r["target_batch_size"],
            r["samples"],
            r.get("seeds", 1),
            f"{fmt(r['swarm_val_acc'])} +- {fmt(r.get('swarm_val_acc_std'))}",
            f"{fmt(r['single_val_acc'])} +- {fmt(r.get('single_val_acc_std'))}",
            diff(r),
        ],
    )
