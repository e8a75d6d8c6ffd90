"""``attack``: a peer sends gradients 10,000 times too large and pointing uphill (``--inject-fault big_grad``)
into a swarm of one honest peer, once with the honest peer's screen off (``--reject-factor 0``, the baseline
of the same run) and once on (the default): the honest peer's val acc before the attack and after it, and
what it rejected (swarm/averaging/screen.py)."""

from __future__ import annotations

import re
import time
from typing import Any

from peer.bench.harness import Bench, Options, Peer, fmt, summary, table

ATTACK_SECONDS = 30.0  # how long the attacker takes part before both are told to leave (SIGTERM)
VALIDATION = re.compile(r"Validation at global epoch (\d+): loss (\S+), acc ([\d.]+),")


def _validations(peer: Peer) -> list[tuple[int, float, float]]:
    found = (VALIDATION.search(line) for line in peer.lines)
    return [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in found if m]


def run(bench: Bench, opts: Options) -> None:
    stamp = int(time.time())
    for factor in (0.0, 10.0):
        _one(bench, f"bench-attack-{stamp}-{int(factor)}", factor)


def _one(bench: Bench, run_id: str, factor: float) -> None:
    """Bootstrap, the honest peer (``--reject-factor factor``), then the attacker once it trains."""
    common = ["--config", "demo", "--run-id", run_id, "--log-dir", str(bench.work)]
    started: list[Peer] = []

    def join(name: str, *extra: str, seed: int, address: str) -> Peer:
        args = ["join", *common, "--initial-peers", address, "--peer-name", name, "--seed", str(seed),
                "--threads", "1", "--eval-every", "3", "--log-every", "10", "--max-epochs", "100000",
                *extra]  # fmt: skip
        started.append(Peer(f"{run_id}-{name}", args, bench.work))
        return started[-1]

    try:
        started.append(Peer(f"{run_id}-bootstrap", ["bootstrap", *common], bench.work))
        address = started[0].join_address(timeout=120)
        honest = join("honest", "--reject-factor", str(factor), seed=1, address=address)
        honest.wait_for(r"\| epoch \d+ \|", timeout=180)
        attacker = join("attacker", "--inject-fault", "big_grad@+2x1000000000", seed=2, address=address)
        attack = int(attacker.wait_for(r"FAULT INJECTED: .* from global epoch (\d+)", timeout=180).group(1))
        time.sleep(ATTACK_SECONDS)
        codes = [p.stop(grace=60) for p in (honest, attacker)]
    finally:
        for p in started:
            p.stop()
    if any(codes):
        raise RuntimeError(f"{run_id}: a peer failed (exit codes {codes}); logs in {bench.work}")
    vals = _validations(honest)
    s = summary(bench.work, run_id, "honest")
    before = [acc for epoch, _, acc in vals if epoch <= attack][-2:]
    after = [(epoch - attack, loss, acc) for epoch, loss, acc in vals if epoch > attack]
    bench.record(
        {
            "scenario": "attack",
            "reject_factor": factor,
            "attack_epoch": attack,
            "attack_seconds": ATTACK_SECONDS,
            "val_acc_before": before,
            "val_after": after,  # (global epochs after the attack began, val loss, val acc)
            "rejected_gradient_rounds": s["rejected_gradient_rounds"],
            "rejected_state_rounds": s["rejected_state_rounds"],
            "rejected_downloads": s["rejected_downloads"],
            "skipped_nonfinite_steps": s["skipped_nonfinite_steps"],
        }
    )
    end = f"{fmt(after[-1][2])} after {after[-1][0]} epochs (loss {fmt(after[-1][1])})" if after else "-"
    print(
        f"attack, reject_factor {factor:g}: honest val acc {before} before global epoch {attack}, "
        f"{[acc for _, _, acc in after[:3]]} in the 9 epochs after, {end}; rejected "
        f"{s['rejected_gradient_rounds']} gradient rounds, {s['rejected_state_rounds']} state rounds, "
        f"{s['rejected_downloads']} downloads",
        flush=True,
    )


def summary_table(rows: list[dict[str, Any]]) -> str:
    def cells(r: dict[str, Any]) -> list[Any]:
        after = r["val_after"]
        end = after[-1] if after else None
        return [
            "off (0)" if not r["reject_factor"] else f"on ({r['reject_factor']:g})",
            ", ".join(fmt(a) for a in r["val_acc_before"]),
            ", ".join(fmt(acc) for _, _, acc in after[:3]) or "-",
            f"{fmt(end[2])} / {fmt(end[1])} at +{end[0]}" if end else "-",
            f"{r['rejected_gradient_rounds']} / {r['rejected_state_rounds']} / {r['rejected_downloads']}",
        ]

    header = [
        "honest peer's screen",
        "val acc, last 2 before the attack",
        "val acc at +3, +6, +9 epochs",
        "val acc / val loss at the end",
        "rejected gradient rounds / state rounds / downloads",
    ]
    return table(rows, "attack", header, cells)
