"""``volunteers`` (root only): a lab of unequal volunteers on home links, against each of them alone.

Each of ``--volunteers`` peers (default 8) runs in its own network namespace (peer/bench/netns.py), behind
its own link: upload ``--link-mbit`` Mbit/s, download 4x that, and a one-way delay to the hub of 25 to 75 ms
(given out in an order unrelated to the CPU quotas; a user-space delay line, since this kernel has no netem).
Each peer, its DHT process, p2p daemon and averagers included, runs in its own CPU budget (a cgroup quota,
peer/bench/cpubudget.py), spread evenly over ``--quotas`` (default 0.1-0.3 of a core: the fastest is 3x the
slowest). The bootstrap (a DHT node that does not train, as a cloud VM would be) has a namespace of its own
and no budget.

Baselines in the same run: each quota's lone peer (``swarm-peer local --strategy single`` in the same budget,
no swarm; all at once, as the swarm's peers run at once). The fastest lone peer trains the whole budget of
samples, the others long enough to measure their rate.

Per mode, one JSON line: ``utilisation`` (the swarm's samples/s, the sum of its peers' rates over their
training windows, averaging waits included, over the sum of the lone peers' rates), ``time_to_target_s``
(from the swarm's first step to the first validation at or above ``TARGET_ACC`` on any peer) against the
fastest lone peer's ``lone_time_to_target_s`` (from its first step), their ratio ``speedup`` and the goal
``speedup_goal`` (0.8 x the sum of the quotas over the fastest), ``bytes_per_sample`` (bytes sent in averaging
rounds per sample computed), ``stalled_rounds`` (round ends over 5 s, all peers: what a trainer waited;
with ``--overlap-rounds`` the rounds' own lengths are ``background_rounds_over_5s``), ``helper_cpu_share``
(the largest share of a peer's CPU seconds that its helpers used) and the RTT the lab measured between the
two peers furthest apart. The arithmetic behind the default link is in docs/benchmarks.md ("Volunteers").

``internet+churn`` runs the internet mode longer while the harness kills 2 of 8 peers at random every 30-60 s
and starts new ones in their places (peer/bench/harness.py ``Churn``); its line has ``goodput`` instead of
``utilisation`` (:func:`churn_fields`), and each newcomer's time from launch to its first averaged round.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from peer.bench.harness import Bench, Churn, Options, Peer, fmt, peer_rate, swarm, table

TARGET_ACC = 0.8
SAMPLES = 120 * 256  # the demo's budget of samples for the swarm (and for the fastest lone peer)
LONE_EPOCHS = 16  # the other lone peers: 16 x 256 samples, enough to measure a rate
BATCH = 32
DOWN_PER_UP = 4  # a home line's download is several times its upload
DELAYS_MS = (25.0, 75.0)
DILOCO_H = 16
ROUND_SECONDS = 5.0  # internet: an outer round per 5 s of the swarm's compute, in the background
WAITED_ROUND_SECONDS = 10.0  # internet-waited: the settings before rounds ran in the background
INTERNET_REPORT_EVERY = 1.0  # internet: one progress record per second (the default 0.25 s cost helper CPU)
# internet: the window in which a round's group forms. The demo's 2 s is for loopback; among peers 200 ms
# apart whose phases end up to a second or two apart it closed before the last ones came, and 8 peers averaged
# in groups of 2-6 with anchors that drifted apart (docs/benchmarks.md, "Groups of all 8"). A group that every
# live peer joined closes at once (close_groups), so a wider window costs only the rounds that lack a peer.
INTERNET_MATCHMAKING_S = 4.0
TIMED_ROUNDS = 12  # 2 minutes of the swarm's compute
CHURN_ROUNDS = 40  # internet+churn: long enough for several replacements (SWARM_SECONDS bounds it)
CHURN_EVERY = (30.0, 60.0)  # seconds between replacements
CHURN_FRACTION = 0.2  # one peer in five each time
STALL_S = 5.0
SWARM_SECONDS = 300.0  # a mode that has not finished by then is stopped and measured on what it did


def spread(lo: float, hi: float, n: int) -> list[float]:
    """``n`` values evenly from ``lo`` to ``hi``."""
    return [lo] if n == 1 else [round(lo + (hi - lo) * i / (n - 1), 4) for i in range(n)]


def delays(n: int) -> list[float]:
    """One-way delays of ``n`` peers over DELAYS_MS, in an order that does not follow the quotas."""
    values = spread(*DELAYS_MS, n)
    order = sorted(range(n), key=lambda i: (i * 5) % n if n % 5 else (i * 3) % n)
    return [values[order.index(i)] for i in range(n)]


def modes(peers: int) -> dict[str, tuple[list[str], dict[str, str] | None]]:
    """Each mode's flags and config environment for a swarm of ``peers``."""
    grad = 256
    diloco = peers * DILOCO_H * BATCH
    rounds = max(2, SAMPLES // diloco)
    timed = TIMED_ROUNDS

    def internet(epochs: int) -> tuple[list[str], dict[str, str]]:
        """configs/internet.yaml's swarm settings, its round time scaled to the demo's model, its group's
        window to the lab's latencies."""
        return (
            ["--averaging", "diloco", "--round-seconds", str(ROUND_SECONDS), "--overlap-rounds",
             "--match-early", "--compression", "int8", "--target-batch-size", str(diloco),
             "--matchmaking-time", str(INTERNET_MATCHMAKING_S),
             "--average-state-every", "10", "--max-epochs", str(epochs), "--eval-every", "1"],
            {"SWARM_WARMUP_EPOCHS": "1", "SWARM_SCHEDULE_EPOCHS": str(epochs),
             "SWARM_REPORT_EVERY": str(INTERNET_REPORT_EVERY)},
        )  # fmt: skip

    return {
        "grad+int8": (
            ["--compression", "int8", "--target-batch-size", str(grad), "--average-state-every", "10",
             "--max-epochs", str(SAMPLES // grad), "--eval-every", str(max(1, 2048 // grad))],
            None,
        ),
        "diloco+int8": (
            ["--averaging", "diloco", "--local-steps", str(DILOCO_H), "--compression", "int8",
             "--target-batch-size", str(diloco), "--average-state-every", "10", "--max-epochs", str(rounds),
             "--eval-every", str(max(1, 2048 // diloco))],
            {"SWARM_WARMUP_EPOCHS": "1", "SWARM_SCHEDULE_EPOCHS": str(rounds)},
        ),
        "internet": internet(timed),
        "internet+churn": internet(CHURN_ROUNDS),  # longer, with one peer in five replaced every 30-60 s
        "internet-waited": (  # its rounds waited for (no --overlap-rounds, --match-early) and twice as long
            ["--averaging", "diloco", "--round-seconds", str(WAITED_ROUND_SECONDS), "--compression", "int8",
             "--target-batch-size", str(diloco), "--average-state-every", "10", "--max-epochs", str(timed),
             "--eval-every", "1"],
            {"SWARM_WARMUP_EPOCHS": "1", "SWARM_SCHEDULE_EPOCHS": str(timed),
             "SWARM_REPORT_EVERY": str(INTERNET_REPORT_EVERY)},
        ),
    }  # fmt: skip


MODE_NAMES = {
    "grad+int8": "gradients, int8",
    "diloco+int8": f"DiLoCo H={DILOCO_H}, int8",
    "internet": f"internet: DiLoCo {ROUND_SECONDS:g} s rounds matched early, in the background, int8",
    "internet-waited": f"DiLoCo {WAITED_ROUND_SECONDS:g} s rounds waited for, int8",
    "internet+churn": "internet, one peer in five replaced every 30-60 s",
}


def run(
    bench: Bench,
    opts: Options,
    chosen: tuple[str, ...] | None = None,
    samples: int | None = None,
    seconds: float = SWARM_SECONDS,
) -> None:
    from peer.bench import cpubudget, netns

    reason = netns.unavailable() or cpubudget.unavailable()
    if reason:
        print(f"volunteers: skipped, {reason}", flush=True)
        return
    n = opts.volunteers
    quotas = spread(*opts.quotas, n)
    one_way = delays(n)
    stamp, tag = int(time.time()), f"v{int(time.time()) % 10000}"
    up = opts.link_mbit
    lab = netns.Lab(
        n + 1,
        up,
        tag=tag,
        up_mbit=[up] * (n + 1),
        down_mbit=[up * DOWN_PER_UP] * (n + 1),
        delays_ms=[DELAYS_MS[0], *one_way],
    )
    budgets = cpubudget.CpuBudgets(quotas, tag)
    try:
        lab.__enter__()
        budgets.__enter__()
    except (netns.LabError, OSError) as exc:
        lab.close()
        budgets.close()
        print(f"volunteers: skipped, could not build the lab: {exc}", flush=True)
        return
    try:
        far = max(range(n), key=lambda i: one_way[i])
        near = min(range(n), key=lambda i: one_way[i])
        rtt = lab.rtt_ms(far + 1, near + 1)
        print(
            f"volunteers: {n} peers, quotas {quotas} cores (sum {sum(quotas):.2f}), links {up:g}/"
            f"{up * DOWN_PER_UP:g} Mbit/s up/down, one-way delays {one_way} ms; measured RTT "
            f"{rtt:.0f} ms between the furthest two",
            flush=True,
        )
        lone = _lone(bench, f"bench-volunteers-{stamp}-lone", budgets, quotas)
        rates = [s["samples_per_second"] for s in lone]
        fastest = max(range(n), key=lambda i: quotas[i])
        lone_time = _lone_time(lone[fastest])
        print(
            "volunteers: lone peers "
            + ", ".join(f"{q:g} core {r:.0f} samples/s" for q, r in zip(quotas, rates, strict=True))
            + f"; the fastest reached val acc {TARGET_ACC} after {fmt(lone_time, 1)} s",
            flush=True,
        )
        all_modes = modes(n)
        for mode in chosen or tuple(all_modes):
            args, env = all_modes[mode]
            run_id = f"bench-volunteers-{mode.replace('+', '-')}-{stamp}"
            args = ["--batch-size", str(BATCH), *args]
            churn = Churn(CHURN_EVERY, CHURN_FRACTION, seed=stamp) if mode.endswith("+churn") else None
            sums = swarm(bench, run_id, n, args, env, lab=lab, budgets=budgets, seconds=seconds, churn=churn)
            row = _row(mode, sums, quotas, rates, lone_time, rtt, up, one_way)
            if churn is not None:
                # the incarnations' rates overlap in time: goodput replaces utilisation
                row.update(churn_fields(sums, churn, rates), peers=n, utilisation=None)
            bench.record(row)
            print(line(row), flush=True)
    finally:
        budgets.close()
        lab.close()


def _lone(bench: Bench, run: str, budgets: Any, quotas: list[float]) -> list[dict[str, Any]]:
    """Every quota's lone peer at once, each in its budget; their summaries (in quota order)."""
    log_dir = bench.work / "local"
    fastest = max(range(len(quotas)), key=lambda i: quotas[i])
    procs = []
    try:
        for i, _ in enumerate(quotas):
            epochs = SAMPLES // 256 if i == fastest else LONE_EPOCHS
            procs.append(
                Peer(
                    f"{run}-{i}",
                    [
                        "local",
                        "--config",
                        "demo",
                        "--run-id",
                        f"{run}-{i}",
                        "--log-dir",
                        str(log_dir),
                        "--strategy",
                        "single",
                        "--devices",
                        "1",
                        "--device",
                        "cpu",
                        "--threads",
                        "1",
                        "--batch-size",
                        str(BATCH),
                        "--target-batch-size",
                        "256",
                        "--max-epochs",
                        str(epochs),
                        "--eval-every",
                        str(2048 // 256 if i == fastest else 100000),
                    ],
                    bench.work,
                    None,
                    budgets.prefix(i),
                )  # fmt: skip
            )
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:
            p.stop()
    if any(codes):
        raise RuntimeError(f"{run}: a lone peer failed (exit codes {codes}); logs in {bench.work}")
    return [_summary(log_dir / f"{run}-{i}") for i in range(len(quotas))]


def _summary(run_dir: Path) -> dict[str, Any]:
    import json

    found = sorted(run_dir.glob("single*/summary.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text())


def _lone_time(s: dict[str, Any]) -> float | None:
    """Seconds from a lone run's first step to its first validation at or above TARGET_ACC."""
    return next((t for t, _, acc in s.get("val_curve", []) if acc >= TARGET_ACC), None)


def _row(
    mode: str,
    sums: list[dict[str, Any]],
    quotas: list[float],
    lone_rates: list[float],
    lone_time: float | None,
    rtt: float,
    up: float,
    one_way: list[float],
) -> dict[str, Any]:
    began = min(s["started_at"] for s in sums if s.get("started_at"))
    reached = [
        h["time"] - began
        for s in sums
        for h in s.get("history", [])  # none in a peer stopped while it started (under churn)
        if h.get("val_acc") is not None and h["val_acc"] >= TARGET_ACC
    ]
    swarm_rate = sum(peer_rate(s) for s in sums)
    samples = sum(h["samples"] for s in sums for h in s.get("history", []))
    shares = [c["helpers"] / max(c["self"] + c["helpers"], 1e-9) for s in sums if (c := s.get("cpu_seconds"))]
    ends = [r["end"] for s in sums for r in s.get("rounds", [])]
    flights = [r.get("flight", 0.0) for s in sums for r in s.get("rounds", [])]
    accs = [s["final_val"]["acc"] for s in sums if s.get("final_val")]
    swarm_time = min(reached) if reached else None
    goal = 0.8 * sum(quotas) / max(quotas)
    return {
        "scenario": "volunteers",
        "mode": mode,
        "peers": len(sums),
        "quotas": quotas,
        "mbit": up,
        "mbit_down": up * DOWN_PER_UP,
        "one_way_ms": one_way,
        "rtt_ms": round(rtt, 1),
        "samples_per_second": round(swarm_rate, 1),
        "lone_samples_per_second": [round(r, 1) for r in lone_rates],
        "utilisation": round(swarm_rate / sum(lone_rates), 3),
        "time_to_target_s": None if swarm_time is None else round(swarm_time, 1),
        "lone_time_to_target_s": None if lone_time is None else round(lone_time, 1),
        "speedup": round(lone_time / swarm_time, 2) if swarm_time and lone_time else None,
        "speedup_goal": round(goal, 2),
        "target_acc": TARGET_ACC,
        "global_epochs": max(s.get("final_epoch", 0) for s in sums),
        "final_val_acc": round(sum(accs) / len(accs), 4) if accs else None,
        "bytes_per_sample": round(sum(s.get("bytes_sent", 0) for s in sums) / max(samples, 1), 1),
        "stalled_rounds": sum(e > STALL_S for e in ends),
        "rounds": len(ends),
        "median_round_end_s": round(sorted(ends)[len(ends) // 2], 3) if ends else None,
        # rounds that ran in the background (--overlap-rounds): their length, though nobody waited for it
        "background_rounds_over_5s": sum(f > STALL_S for f in flights),
        "median_background_round_s": round(sorted(flights)[len(flights) // 2], 3) if any(flights) else None,
        "helper_cpu_share": round(max(shares), 3) if shares else None,
        "helper_cpu_share_mean": round(sum(shares) / len(shares), 3) if shares else None,
        "waited_s": [round(s.get("seconds_waiting_for_the_swarm", 0.0), 1) for s in sums],
        "loaded_epoch_per_peer": [s.get("loaded_epoch") or 0 for s in sums],
    }


def churn_fields(sums: list[dict[str, Any]], churn: Churn, lone_rates: list[float]) -> dict[str, Any]:
    """What churn cost: ``goodput``, the samples that reached a global epoch (each incarnation's windows
    that ended in one; what a killed peer computed after its last epoch is lost) over what the live peers
    would have computed alone in the same time (each incarnation's lone rate over the seconds it was alive,
    start-up included for a newcomer); and each newcomer's ``newcomer_seconds`` from its launch to its first
    averaged round (None: killed or stopped before one), ``startup`` to its first step."""
    by_name = {s["incarnation"]["name"]: s for s in sums}
    first = [by_name[c.name] for c in churn.incarnations if not c.newcomer and c.name in by_name]
    began = min(s["started_at"] for s in first if s.get("started_at"))
    end = max(h["time"] for s in sums for h in s.get("history", []))
    useful = sum(h["samples"] for s in sums for h in s.get("history", []) if began <= h["time"] <= end)
    alive = 0.0
    for c in churn.incarnations:
        since = max(c.launched, began) if c.newcomer else began
        alive += lone_rates[c.slot - 1] * max(0.0, min(c.killed or end, end) - since)
    joined, startup = [], []
    for c in churn.incarnations:
        if not c.newcomer:
            continue
        s = by_name.get(c.name, {})
        history = s.get("history", [])
        averaged = [h["time"] for h in history if (h.get("round") or {}).get("outcome") == "averaged"]
        first = averaged[0] if averaged else None
        joined.append(None if first is None else round(first - c.launched, 1))
        startup.append(None if not s.get("started_at") else round(s["started_at"] - c.launched, 1))
    done = sorted(t for t in joined if t is not None)
    return {
        "goodput": round(useful / max(alive, 1e-9), 3),
        "samples_per_second": round(useful / max(end - began, 1e-9), 1),  # what reached a global epoch
        "kills": sum(c.killed is not None for c in churn.incarnations),
        "incarnations": len(churn.incarnations),
        "newcomer_seconds": done[len(done) // 2] if done else None,
        "newcomer_seconds_each": joined,
        "newcomer_startup_s": startup,
        "churn_window_s": round(end - began, 1),
    }


def line(r: dict[str, Any]) -> str:
    return (
        f"volunteers {r['mode']:>11}: utilisation {fmt(r['utilisation'], 2)} ({r['samples_per_second']:.0f} "
        f"samples/s of {sum(r['lone_samples_per_second']):.0f}); val acc {TARGET_ACC} after "
        f"{fmt(r['time_to_target_s'], 1)} s (fastest alone {fmt(r['lone_time_to_target_s'], 1)} s, speedup "
        f"{fmt(r['speedup'], 2)} of goal {r['speedup_goal']}); {r['bytes_per_sample']:.0f} B/sample, "
        f"{r['stalled_rounds']} of {r['rounds']} round ends over {STALL_S:g} s, helpers up to "
        f"{fmt(r['helper_cpu_share'], 2)} of a peer's CPU"
        + (
            f"; churn: {r['kills']} peers killed and replaced, goodput {r['goodput']:.2f}, newcomers in "
            f"their first averaged round after {r['newcomer_seconds_each']} s (start-up "
            f"{r['newcomer_startup_s']} s)"
            if "goodput" in r
            else ""
        )
    )


def summary_table(rows: list[dict[str, Any]]) -> str:
    header = ["mode", "peers", "quotas", "link up/down", "RTT ms", "utilisation", f"s to {TARGET_ACC}",
              "fastest alone s", "speedup (goal)", "B/sample", "stalled rounds",
              "background rounds over 5 s (median s)", "helper CPU"]  # fmt: skip
    return table(
        rows,
        "volunteers",
        header,
        lambda r: [
            MODE_NAMES.get(r["mode"], r["mode"]),
            r["peers"],
            f"{min(r['quotas']):g}-{max(r['quotas']):g}",
            f"{r['mbit']:g}/{r['mbit_down']:g} Mbit/s",
            f"{r['rtt_ms']:.0f}",
            fmt(r["utilisation"], 2) if r.get("goodput") is None else f"goodput {r['goodput']:.2f}",
            fmt(r["time_to_target_s"], 1),
            fmt(r["lone_time_to_target_s"], 1),
            f"{fmt(r['speedup'], 2)} ({r['speedup_goal']})",
            f"{r['bytes_per_sample']:.0f}",
            f"{r['stalled_rounds']} of {r['rounds']}",
            f"{r.get('background_rounds_over_5s', 0)} (median {fmt(r.get('median_background_round_s'), 1)})",
            fmt(r["helper_cpu_share"], 2),
        ],
    )
