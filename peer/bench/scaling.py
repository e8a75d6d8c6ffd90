"""``scaling``: K swarm peers against K-rank DDP (gloo) and one process, all through the real CLI, with the
demo model, 32 samples per worker and step, and a global batch of 2048 (64 per-step batches): samples/s, the
ratios, and the time that ends each round (median, and split in summary.json). The demo's config averages
the parameters every global epoch, skipped when the whole group already holds one state
(docs/hivemind-patches.md item 16); the same with hivemind's weighted mean in place of the robust mean
(``--aggregation mean``: what the robust rule costs; with 2 peers a pair takes the weighted mean either way,
so ``--peers 3`` or more measures it); DiLoCo with H local steps follows, over 20 outer rounds; then the same
swarm with every one of those state rounds held, then with them averaged every 10th (the flagship's
``average_state_every``), then with hivemind's own matchmaking (groups wait ``matchmaking_time``), and DDP
again. All of it ``--repeats`` times; the table gives the medians."""

from __future__ import annotations

import statistics
import time
from typing import Any

from peer.bench.harness import Bench, Options, fmt, local, peer_rate, rounds, samples_per_epoch, swarm, table

EPOCHS = 20  # global epochs of each gradient-averaging run: about 10 s of training for 2 peers
DILOCO_ROUNDS = 20  # outer rounds of the DiLoCo run (the issue asks for at least 10)


def run(bench: Bench, opts: Options, batch: int = 32, per_round: int = 64) -> None:
    """K peers vs K-rank DDP vs one process: the demo model, ``batch`` per worker, ``per_round`` per-step
    batches per global epoch (so that each worker computes per_round / K steps between two averagings).

    The whole sequence runs ``opts.repeats`` times; each repeat's ratios are against that repeat's own
    one-process and DDP runs, and one more row per mode gives their median and range (this machine is
    shared: the same code's swarm read 0.99x, 0.78x and 0.76x DDP in three single runs)."""
    first = len(bench.rows)
    for repeat in range(opts.repeats):
        _one_repeat(bench, opts, batch, per_round, repeat)
    if opts.repeats > 1:
        _summarise(bench, bench.rows[first:])


def _one_repeat(bench: Bench, opts: Options, batch: int, per_round: int, repeat: int) -> None:
    """One of each run. DDP runs first and again last, and the ratios are against the mean of the two, so
    that a load that changes over the repeat's 4 minutes weighs on both sides (one repeat read DDP at 4172
    samples/s, the next at 4648, the third at 5619, on the same code)."""
    peers, local_steps = opts.peers, opts.local_steps
    target = per_round * batch
    stamp = int(time.time())
    fixed = ["--batch-size", str(batch), "--target-batch-size", str(target)]
    shared = [*fixed, "--max-epochs", str(EPOCHS)]
    single = local(bench, f"bench-scaling-{stamp}", "single", 1, shared)
    ddp = local(bench, f"bench-scaling-{stamp}", "ddp", peers, shared)
    grads = swarm(bench, f"bench-scaling-swarm-{stamp}", peers, shared)
    mean = swarm(bench, f"bench-scaling-mean-{stamp}", peers, [*shared, "--aggregation", "mean"])
    diloco_target = peers * local_steps * batch
    diloco = swarm(
        bench,
        f"bench-scaling-diloco-{stamp}",
        peers,
        ["--batch-size", str(batch), "--target-batch-size", str(diloco_target), "--max-epochs",
         str(DILOCO_ROUNDS), "--averaging", "diloco", "--local-steps", str(local_steps)],
    )  # fmt: skip
    # every state round held, even where the group holds one state already (before item 16)
    held = {"SWARM_SKIP_AGREED_STATE_ROUNDS": "0"}
    allstate = swarm(bench, f"bench-scaling-allstate-{stamp}", peers, shared, held)
    state10 = swarm(bench, f"bench-scaling-state10-{stamp}", peers, [*shared, "--average-state-every", "10"])
    # the same with hivemind's own matchmaking: a group waits the whole matchmaking_time before it averages
    # (1.5 s a round: 10 global epochs are enough)
    wait_args = [*fixed, "--max-epochs", "10"]
    waiting = swarm(bench, f"bench-scaling-wait-{stamp}", peers, wait_args, {"SWARM_CLOSE_GROUPS": "0"})
    ddp_after = local(bench, f"bench-scaling-{stamp}-after", "ddp", peers, shared)
    ddp_each = [ddp["samples_per_second"], ddp_after["samples_per_second"]]
    single_sps, ddp_sps = single["samples_per_second"], sum(ddp_each) / 2
    ddp_cpu = _mean([_local_cpu_per_sample(ddp), _local_cpu_per_sample(ddp_after)])
    runs = (
        ("swarm", grads, target),
        ("swarm-mean", mean, target),
        ("swarm-allstate", allstate, target),
        ("swarm-state10", state10, target),
        ("swarm-wait", waiting, target),
        ("diloco", diloco, diloco_target),
    )
    mean_sps = sum(peer_rate(s) for s in mean)
    for name, sums, tgt in runs:
        sps = sum(peer_rate(s) for s in sums)
        together = sum(_averaged_rate(s) for s in sums)
        rounds_done = max(rounds(s) for s in sums)
        train = sum(s["train_seconds"] for s in sums) / len(sums)
        ends = sum(s["round_end_seconds"] for s in sums) / len(sums)
        cpu = _swarm_cpu(sums)
        bench.record(
            {
                "scenario": "scaling",
                "mode": name,
                "repeat": repeat,
                "workers": peers,
                "batch_per_worker": batch,
                "target_batch_size": tgt,
                "local_steps": local_steps if name == "diloco" else None,
                "global_epochs": rounds_done,
                "samples_per_second": round(sps, 1),
                "samples_per_second_per_peer": [round(peer_rate(s), 1) for s in sums],
                "ddp_samples_per_second": round(ddp_sps, 1),  # the mean of the repeat's two DDP runs
                "ddp_samples_per_second_each": [round(x, 1) for x in ddp_each],
                "single_samples_per_second": round(single_sps, 1),
                "vs_ddp": round(sps / ddp_sps, 3),
                # the robust mean (the default) against hivemind's weighted mean, same flags otherwise
                "vs_mean_aggregation": round(sps / mean_sps, 3) if name == "swarm" else None,
                "vs_k_single": round(sps / (peers * single_sps), 3),
                # the same over the global epochs whose round averaged (not those a peer stepped alone: the
                # first second or so, until the progress trackers see each other)
                "samples_per_second_averaged_rounds": round(together, 1),
                "vs_ddp_averaged_rounds": round(together / ddp_sps, 3),
                "alone_rounds_per_peer": [s.get("round_ends", {}).get("alone") for s in sums],
                "ddp_vs_k_single": round(ddp_sps / (peers * single_sps), 3),
                # CPU microseconds per trained sample, all processes of the run while it trained (a peer's
                # DHT process, p2p daemon and averagers included; the bootstrap not): on a machine whose
                # cores are all busy, samples/s follows from these (swarm/training/sysmetrics.py)
                "cpu_us_per_sample": cpu["per_sample"],
                "helpers_cpu_share": cpu["helpers_share"],
                "cores_busy": cpu["cores"],
                "ddp_cpu_us_per_sample": ddp_cpu,
                "single_cpu_us_per_sample": _local_cpu_per_sample(single),
                "cpu_vs_ddp": _ratio(cpu["per_sample"], ddp_cpu),
                # what all peers computed per global epoch: about the target when the peers' trackers count
                # each other's samples, a multiple of it when each peer reaches the target alone
                "samples_per_global_epoch": round(samples_per_epoch(sums), 1),
                # per global epoch and peer: the steps that ended a round (waiting for the swarm, matchmaking,
                # all-reduce, update) against all the rest (forward, backward, local optimizer steps)
                "seconds_per_round": round(train / rounds_done, 3),
                "round_end_seconds_per_round": round(ends / rounds_done, 3),
                "single_seconds_per_round": round(tgt / single_sps, 3),
                "round_end_seconds_median": _median_end(sums),
                "local_fallback_steps": sum(s.get("local_fallback_steps", 0) for s in sums),
                # state rounds skipped because the group held one state (item 16), per peer
                "state_rounds_skipped": [
                    (s.get("round_ends") or {}).get("state_skipped_in_agreement") for s in sums
                ],
                "close_groups": name != "swarm-wait",
                "diloco_waiting_seconds_per_round": round(
                    sum(s.get("seconds_waiting_for_the_swarm", 0.0) for s in sums) / len(sums) / rounds_done,
                    3,
                )
                if name == "diloco"
                else None,
            }
        )
        print(line(bench.rows[-1]), flush=True)


def _summarise(bench: Bench, rows: list[dict[str, Any]]) -> None:
    """One row per mode: the median over the repeats of its ratios and round ends, with their range."""
    for name in dict.fromkeys(r["mode"] for r in rows if r["scenario"] == "scaling"):
        mine = [r for r in rows if r["scenario"] == "scaling" and r["mode"] == name]
        each = {k: [r.get(k) for r in mine] for k in MEDIAN_FIELDS}
        row = {
            "scenario": "scaling",
            "mode": name,
            "repeat": "median",
            "repeats": len(mine),
            **{k: mine[0][k] for k in ("workers", "batch_per_worker", "target_batch_size", "local_steps")},
            **{k: _median(v) for k, v in each.items()},
            "vs_ddp_each": each["vs_ddp"],
            "vs_ddp_min": min(each["vs_ddp"]),
            "vs_ddp_max": max(each["vs_ddp"]),
        }
        bench.record(row)
        print(
            f"scaling {name:>13} x{row['workers']}: median of {len(mine)} repeats, vs DDP {_vs_ddp(row)}; "
            f"median round end {fmt(row['round_end_seconds_median'], 2)} s"
            + (f"; vs the weighted mean {fmt(row['vs_mean_aggregation'], 2)}" if name == "swarm" else ""),
            flush=True,
        )


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 1) if known else None


def _local_cpu_per_sample(summary: dict[str, Any]) -> float | None:
    """CPU microseconds per sample of a ``swarm-peer local`` run (all ranks), None if not measured."""
    cpu = summary.get("cpu_seconds")
    if not cpu or not summary.get("samples"):
        return None
    return round(1e6 * cpu["self"] / summary["samples"], 1)


def _swarm_cpu(sums: list[dict[str, Any]]) -> dict[str, float | None]:
    """CPU microseconds per sample of a swarm run's peers (trainers and their helper processes), the helpers'
    share of it, and the cores the peers kept busy; None where a peer did not measure."""
    cpus = [s.get("cpu_seconds") for s in sums]
    samples = sum(h["samples"] for s in sums for h in s["history"] if h["mini_steps"])
    if any(c is None for c in cpus) or not samples:
        return {"per_sample": None, "helpers_share": None, "cores": None}
    helpers = sum(c["helpers"] for c in cpus)
    total = sum(c["self"] for c in cpus) + helpers
    return {
        "per_sample": round(1e6 * total / samples, 1),
        "helpers_share": round(helpers / total, 3) if total else None,
        "cores": round(total / max(c["wall"] for c in cpus), 2),
    }


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


MEDIAN_FIELDS = (
    "samples_per_second",
    "ddp_samples_per_second",
    "single_samples_per_second",
    "vs_ddp",
    "vs_mean_aggregation",
    "vs_ddp_averaged_rounds",
    "vs_k_single",
    "seconds_per_round",
    "round_end_seconds_per_round",
    "round_end_seconds_median",
    "cpu_us_per_sample",
    "ddp_cpu_us_per_sample",
    "single_cpu_us_per_sample",
    "cpu_vs_ddp",
    "helpers_cpu_share",
)


def line(r: dict[str, Any]) -> str:
    return (
        f"scaling {r['mode']:>13} x{r['workers']}: {r['samples_per_second']:.1f} samples/s; DDP "
        f"{r['ddp_samples_per_second']:.1f}, one process {r['single_samples_per_second']:.1f}; "
        f"vs DDP {r['vs_ddp']:.2f}x ({r['vs_ddp_averaged_rounds']:.2f}x over averaged rounds), vs "
        f"{r['workers']} x single {r['vs_k_single']:.2f}x; per round "
        f"{r['seconds_per_round']:.2f} s of which {r['round_end_seconds_per_round']:.2f} s ending it (median "
        f"{fmt(r['round_end_seconds_median'], 2)} s); {r['samples_per_global_epoch']:.0f} samples per global "
        f"epoch (target {r['target_batch_size']}); {_cpu(r)}"
        + (f"; vs the weighted mean {r['vs_mean_aggregation']:.2f}x" if r.get("vs_mean_aggregation") else "")
    )


def _cpu(r: dict[str, Any]) -> str:
    """CPU per sample against DDP's, and the helper processes' share of it."""
    if r.get("cpu_us_per_sample") is None:
        return "CPU not measured"
    ddp, single = fmt(r.get("ddp_cpu_us_per_sample"), 0), fmt(r.get("single_cpu_us_per_sample"), 0)
    helpers = 100 * (r.get("helpers_cpu_share") or 0)
    mine = r["cpu_us_per_sample"]
    return f"CPU {mine:.0f} us/sample (DDP {ddp}, one process {single}), helpers {helpers:.0f} %"


def summary_table(rows: list[dict[str, Any]]) -> str:
    """One line per mode; with several repeats, their medians (vs DDP: median, then each repeat's)."""
    medians = [r for r in rows if r["scenario"] == "scaling" and r.get("repeat") == "median"]
    if medians:
        rows = medians
    names = {
        "swarm-mean": "swarm, hivemind's weighted mean (`--aggregation mean`)",
        "swarm-allstate": "swarm, every state round held (none skipped in agreement)",
        "swarm-state10": "swarm, parameters averaged every 10th epoch (the flagship's config)",
        "swarm-wait": "swarm, groups wait matchmaking_time (hivemind's default)",
    }
    header = [
        "mode",
        "workers",
        "target batch",
        "samples/s",
        "DDP samples/s",
        "one process samples/s",
        "vs DDP (with repeats: median (each))",
        "vs DDP, averaged rounds only",
        "vs K x one",
        "s per round",
        "of which ending the round",
        "median round end",
        "CPU per sample (DDP, one process), helpers' share",
    ]
    return table(
        rows,
        "scaling",
        header,
        lambda r: [
            f"diloco H={r['local_steps']}" if r["mode"] == "diloco" else names.get(r["mode"], r["mode"]),
            r["workers"],
            r["target_batch_size"],
            r["samples_per_second"],
            r["ddp_samples_per_second"],
            r["single_samples_per_second"],
            _vs_ddp(r),
            fmt(r["vs_ddp_averaged_rounds"], 2),
            fmt(r["vs_k_single"], 2),
            fmt(r["seconds_per_round"], 2),
            fmt(r["round_end_seconds_per_round"], 2),
            fmt(r["round_end_seconds_median"], 2),
            _cpu(r).removeprefix("CPU "),
        ],  # fmt: skip
    )


def _vs_ddp(r: dict[str, Any]) -> str:
    each = r.get("vs_ddp_each")
    return f"{r['vs_ddp']:.2f}" + (f" ({', '.join(f'{x:.2f}' for x in each)})" if each else "")


def _averaged_rate(s: dict[str, Any]) -> float:
    """A peer's samples/s over the global epochs whose round averaged with others (0 if none)."""
    done = [
        h
        for h in s["history"]
        if (h.get("round") or {}).get("outcome") == "averaged" and h["mini_steps"] and h["samples_per_second"]
    ]
    seconds = sum(h["samples"] / h["samples_per_second"] for h in done)
    return sum(h["samples"] for h in done) / seconds if seconds else 0.0


def _median_end(sums: list[dict[str, Any]]) -> float | None:
    """The median over all peers' rounds of the time that ended a round (swarm/averaging/rounds.py)."""
    return _median([r["end"] for s in sums for r in s.get("rounds", [])])
