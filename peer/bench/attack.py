"""``attack``: an invited peer that sends wrong gradients, against the defences, row by row:

- gradients 10,000 times too large and pointing uphill (``--inject-fault big_grad``) into a swarm of one
  honest peer, with the honest peer's round screen off (``--reject-factor 0``) and on (the default)
  (swarm/averaging/screen.py);
- its honest gradient times -8 (``--inject-fault flip_grad``: uphill, of a size the screen lets through)
  into a swarm of two honest peers, with hivemind's weighted mean (``--aggregation mean``) and with the
  robust mean (the default; swarm/patches/robust.py), and the same at x -4 and x -1
  (``flip_grad:K``); random directions of its honest gradient's norm (``--inject-fault random_grad``);
  and the same two honest peers without an attacker;
- a donor that declares the newest epoch and serves random parameters of the honest norms
  (``--inject-fault bad_donor``) to a newcomer that joins once the attack began, with the newcomer's
  download check (swarm/averaging/donors.py) on (the default) and off (``--no-check-downloads``): the
  newcomer's first val acc against the honest peer's;
- random parameters of the honest norms in every state round (``--inject-fault bad_state``, which also
  tells the group it holds another state, so that the round is held);
- progress records that claim a far-future epoch (``--inject-fault claim_epoch``: its epoch + 10^6) from a
  peer that serves only its real state: whether the honest peers train on or download at every step;
- two attackers among five peers: x -8 into three honest peers, random state rounds, and two colluding bad
  donors (one state, each vouching for it) to a newcomer; and x -8 again with the honest peers' rounds also
  judged by a step on them (``--judge-steps``, swarm/averaging/screen.py ``judge_step``).

(An inner-product manipulation, a push of -e times the honest mean, is a flip: with one attacker among n
honest peers it turns the mean uphill only for e > n, the x -4 and x -8 rows.)

Each row: the honest peers' val acc before the attack and after it, what they rejected and clipped, and
how long after the attack began each honest peer banned the attacker (swarm/suspects.py). The
rows of one call run one after another on the same machine, the rows without an attacker first (one for each
number of honest peers that the chosen rows have, chosen or not): each attack row's ``val_acc_without`` is
the val acc that the same first honest peer (same seed) had in that run after the same time of training."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from peer.bench.harness import Bench, Options, Peer, fmt, summary, table

# how long an attacker takes part before everyone is told to leave (SIGTERM): the goal's window for a ban by
# every honest peer (a flip at x -1 takes 16 judged rounds to ban, and on two cores an honest peer meets an
# attacker in 11-16 rounds a minute; five peers take about 27 rounds a minute)
ATTACK_SECONDS = 60.0
# a row without an attacker trains this much longer: its honest peers start at once, where an attack row's
# window opens only when its attackers have joined and injected (with two attackers among five, attack rows
# trained up to 132 s in all on two cores), so that it covers every attack row's time of training
BASELINE_EXTRA_SECONDS = 90.0
VALIDATION = re.compile(r"Validation at global epoch (\d+): loss (\S+), acc ([\d.]+),")
ALWAYS = "x1000000000"  # every local step from the fault's epoch on


@dataclass(frozen=True)
class Row:
    attack: str  # what the attacker sends ("none": no attacker)
    fault: str | None  # its --inject-fault
    defence: str  # what the honest peers use, in words
    flags: tuple[str, ...]  # every peer's flags (a swarm setting such as --aggregation must match)
    honest_flags: tuple[str, ...] = ()  # the honest peers' own
    honest: int = 1
    newcomer: tuple[str, ...] | None = None  # a newcomer's own flags: one joins once the attack began
    attackers: int = 1

    @property
    def seconds(self) -> float:
        """How long the attack lasts before everyone is told to leave (a row without an attacker: longer,
        to serve as the attack rows' baseline)."""
        return ATTACK_SECONDS if self.fault is not None else ATTACK_SECONDS + BASELINE_EXTRA_SECONDS


ROWS = (
    Row("x -10^4 (outsized)", f"big_grad@+2{ALWAYS}", "screen off", (), ("--reject-factor", "0")),
    Row("x -10^4 (outsized)", f"big_grad@+2{ALWAYS}", "screen", ()),
    Row("x -8 (sign-flipped)", f"flip_grad@+2{ALWAYS}", "screen, mean", ("--aggregation", "mean"), honest=2),
    Row("x -8 (sign-flipped)", f"flip_grad@+2{ALWAYS}", "screen, robust mean", (), honest=2),
    Row("x -4 (sign-flipped)", f"flip_grad:4@+2{ALWAYS}", "screen, robust mean", (), honest=2),
    Row("x -1 (sign-flipped)", f"flip_grad:1@+2{ALWAYS}", "screen, robust mean", (), honest=2),
    Row("random, honest norm", f"random_grad@+2{ALWAYS}", "screen, robust mean", (), honest=2),
    Row("none", None, "screen, robust mean", (), honest=2),
    Row("none", None, "screen, robust mean", (), honest=3),
    Row("donor: random parameters", "bad_donor@+2", "download check", (), honest=2, newcomer=()),
    Row(
        "donor: random parameters",
        "bad_donor@+2",
        "no download check",
        (),
        honest=2,
        newcomer=("--no-check-downloads",),
    ),
    Row("state rounds: random parameters", "bad_state@+2", "screen, robust mean", (), honest=2),
    Row("progress: epoch + 10^6", "claim_epoch@+2", "screen, robust mean", (), honest=2),
    Row("progress: epoch + 1", "claim_epoch:1@+2", "screen, robust mean", (), honest=2),
    Row("x -8 (sign-flipped)", f"flip_grad@+2{ALWAYS}", "screen, robust mean", (), honest=3, attackers=2),
    Row("state rounds: random parameters", "bad_state@+2", "screen, robust mean", (), honest=3, attackers=2),
    Row("donor: random parameters", "bad_donor@+2", "download check", (), honest=3, attackers=2, newcomer=()),
    Row("x -1 (sign-flipped)", f"flip_grad:1@+2{ALWAYS}", "screen, robust mean", (), honest=3, attackers=2),
    Row("random, honest norm", f"random_grad@+2{ALWAYS}", "screen, robust mean", (), honest=3, attackers=2),
    Row(
        "x -8 (sign-flipped)",
        f"flip_grad@+2{ALWAYS}",
        "screen, robust mean, steps judged",
        (),
        ("--judge-steps",),
        honest=3,
        attackers=2,
    ),
)
NEWCOMER_AFTER = 8.0  # seconds from the attack's start to the newcomer's (the donor's record is paced at 5 s)


def _timed_validations(peer: Peer) -> list[tuple[float, int, float, float]]:
    """(when the line was read, global epoch, val loss, val acc) of each validation line of ``peer``."""
    found = ((when, VALIDATION.search(line)) for when, line in zip(peer.times, peer.lines, strict=False))
    return [(when, int(m.group(1)), float(m.group(2)), float(m.group(3))) for when, m in found if m]


def _validations(peer: Peer) -> list[tuple[int, float, float]]:
    return [(epoch, loss, acc) for _, epoch, loss, acc in _timed_validations(peer)]


def run(bench: Bench, opts: Options) -> None:
    stamp = int(time.time())
    baselines: dict[int, Timeline] = {}
    for n, row in run_order(opts.attacks):
        timeline = _one(bench, f"bench-attack-{stamp}-{n}", row, baselines.get(row.honest))
        if row.fault is None:
            baselines[row.honest] = timeline


def run_order(attacks: tuple[str, ...]) -> list[tuple[int, Row]]:
    """The rows whose attacker column contains one of ``attacks`` (all, if none given), each with its index
    in ROWS, after the rows without an attacker for every number of honest peers among them."""
    chosen = [(n, row) for n, row in enumerate(ROWS) if not attacks or any(w in row.attack for w in attacks)]
    counts = {row.honest for _, row in chosen}
    first = [(n, row) for n, row in enumerate(ROWS) if row.fault is None and row.honest in counts]
    return first + [(n, row) for n, row in chosen if row.fault is not None]


@dataclass(frozen=True)
class Timeline:
    """The first honest peer's validations, each as (seconds of training, global epoch, val acc), counted
    from its first training line; ``trained_s``: how long it trained until it was told to leave."""

    vals: list[tuple[float, int, float]]
    trained_s: float

    def acc_at(self, seconds: float) -> float | None:
        """Its val acc after ``seconds`` of training: the last validation by then (None if it did not train
        that long, or had not validated yet)."""
        if seconds > self.trained_s:
            return None
        done = [acc for t, _, acc in self.vals if t <= seconds]
        return done[-1] if done else None

    def acc_at_epoch(self, epoch: int) -> float | None:
        """Its val acc at global epoch ``epoch``: the last validation at or before it (None if it did not get
        that far, or had not validated yet)."""
        if not self.vals or self.vals[-1][1] < epoch:
            return None
        done = [acc for _, e, acc in self.vals if e <= epoch]
        return done[-1] if done else None


def _timeline(peer: Peer, ended: float) -> Timeline:
    start = peer.line_time(r"\| epoch \d+ \|")
    vals = [(round(when - start, 1), epoch, acc) for when, epoch, _, acc in _timed_validations(peer)]
    return Timeline(vals, round(ended - start, 1))


def _one(bench: Bench, run_id: str, row: Row, baseline: Timeline | None = None) -> Timeline:
    """Bootstrap, the honest peers, then the attacker (or a third honest peer's wait, for "none") once they
    train; everyone leaves the row's ``seconds`` after the attack began. Returns the first honest peer's
    validations over time; ``baseline``: the same from a row without an attacker and as many honest peers."""
    common = ["--config", "demo", "--run-id", run_id, "--log-dir", str(bench.work)]
    started: list[Peer] = []

    def join(name: str, *extra: str, seed: int, address: str) -> Peer:
        args = ["join", *common, *row.flags, "--initial-peers", address, "--peer-name", name,
                "--seed", str(seed), "--threads", "1", "--eval-every", "3", "--log-every", "10",
                "--max-epochs", "100000", *extra]  # fmt: skip
        started.append(Peer(f"{run_id}-{name}", args, bench.work))
        return started[-1]

    try:
        started.append(Peer(f"{run_id}-bootstrap", ["bootstrap", *common], bench.work))
        address = started[0].join_address(timeout=120)
        honest = [
            join(f"honest{i}", *row.honest_flags, seed=i, address=address) for i in range(1, row.honest + 1)
        ]
        for peer in honest:
            peer.wait_for(r"\| epoch \d+ \|", timeout=180)
        if row.fault is None:
            attack = max(_epoch(peer) for peer in honest) + 2
        else:
            attackers = [
                join(f"attacker{i}" if row.attackers > 1 else "attacker", "--inject-fault", row.fault,
                     seed=98 + i, address=address)
                for i in range(1, row.attackers + 1)
            ]  # fmt: skip
            attack = min(
                int(a.wait_for(r"FAULT INJECTED: .* from global epoch (\d+)", timeout=180).group(1))
                for a in attackers
            )
        attack_began = time.time()
        # the attackers' PeerIDs, from the join line each printed: which bans hit them
        attacker_ids = [] if row.fault is None else [_peer_id(a.join_address()) for a in attackers]
        newcomer = None
        if row.newcomer is not None:
            time.sleep(NEWCOMER_AFTER)
            newcomer = join("newcomer", *row.newcomer, seed=3, address=address)
            newcomer.wait_for(VALIDATION.pattern, timeout=180)
        time.sleep(max(0.0, attack_began + row.seconds - time.time()))
        ended = time.time()
        codes = [p.stop(grace=60) for p in started[1:]]
    finally:
        for p in started:
            p.stop()
    if any(codes):
        raise RuntimeError(f"{run_id}: a peer failed (exit codes {codes}); logs in {bench.work}")
    vals = _validations(honest[0])
    timeline = _timeline(honest[0], ended)
    at = timeline.vals[-1][0] if timeline.vals else None
    s = [summary(bench.work, run_id, f"honest{i}") for i in range(1, row.honest + 1)]
    before = [acc for epoch, _, acc in vals if epoch <= attack][-2:]
    after = [(epoch - attack, loss, acc) for epoch, loss, acc in vals if epoch > attack]
    record = {
        "scenario": "attack",
        "attack": row.attack,
        "defence": row.defence,
        "honest_peers": row.honest,
        "attackers": 0 if row.fault is None else row.attackers,
        "peers": row.honest + (0 if row.fault is None else row.attackers),
        "attack_epoch": attack,
        "attack_seconds": row.seconds,
        "val_acc_before": before,
        "val_after": after,  # of the first honest peer: (global epochs after the attack began, val loss, acc)
        # the first honest peer's last val acc, after val_acc_at_s seconds of training, and the val acc that
        # the same peer had after as long in the run without an attacker (None: no such run, or a shorter one)
        "val_acc": timeline.vals[-1][2] if timeline.vals else None,
        "val_acc_at_s": at,
        "val_acc_without": None if baseline is None or at is None else baseline.acc_at(at),
        # and at the same global epoch: what the attack did to the swarm's steps, apart from their pace (on
        # one machine the attackers' processes also take CPU that the honest peers have to themselves without)
        "val_acc_without_same_epoch": baseline.acc_at_epoch(timeline.vals[-1][1])
        if baseline is not None and timeline.vals
        else None,
        "trained_s": timeline.trained_s,
        **{key: sum(x[key] for x in s) for key in REJECTED},
        # per honest peer: seconds from the attack's first step to its ban of a groupmate (None: no ban)
        "banned_after_s": [_banned_after(x, attack_began) for x in s],
        # per honest peer: seconds to its ban of the last of the attackers (None: it did not ban them all),
        # and how many of them it banned
        "all_banned_after_s": [_banned_after(x, attack_began, attacker_ids) for x in s],
        "attackers_banned": [len(_bans(x, attacker_ids)) for x in s],
        # per honest peer: honest groupmates it banned (an attacker's published bans of honest peers lower
        # the bar they must clear, swarm/suspects.py note_published_bans)
        "honest_banned": [len(_bans(x)) - len(_bans(x, attacker_ids)) for x in s],
    }
    if newcomer is not None:
        record.update(_newcomer(bench, run_id, newcomer, vals, attack_began, attacker_ids))
    bench.record(record)
    end = f"{fmt(after[-1][2])} after {after[-1][0]} epochs (loss {fmt(after[-1][1])})" if after else "-"
    if newcomer is not None:
        print(
            f"newcomer: val acc {fmt(record['newcomer_val_acc'])} at global epoch {record['newcomer_epoch']} "
            f"(the honest peer then: {fmt(record['honest_val_acc_then'])}); downloads refused "
            f"{record['refused_downloads']}, checked {record['checked_downloads']}; every attacker banned "
            f"by it after {record['newcomer_banned_after_s']} s",
            flush=True,
        )
    print(
        f"attack {row.attack}, {row.defence}: honest val acc {before} before global epoch {attack}, "
        f"{[acc for _, _, acc in after[:3]]} in the 9 epochs after, {end}; rejected "
        + ", ".join(f"{record[key]} {key.replace('_', ' ')}" for key in REJECTED)
        + f"; attacker banned after {record['banned_after_s']} s"
        + (f", every attacker after {record['all_banned_after_s']} s" if row.attackers > 1 else "")
        + f"; val acc {fmt(record['val_acc'])} after {at} s of training, "
        f"{fmt(record['val_acc_without'])} without an attacker "
        f"({fmt(record['val_acc_without_same_epoch'])} at the same global epoch)",
        flush=True,
    )
    return timeline


def _newcomer(
    bench: Bench, run_id: str, newcomer: Peer, honest_vals: list, attack_began: float, attacker_ids: list[str]
) -> dict[str, Any]:
    """The newcomer's first validation (right after its download) against the honest peer's at or before that
    epoch, what its download check did, and when it had banned every attacker (a bad donor's refused state
    bans it: swarm/suspects.py ``served_far``)."""
    first = _validations(newcomer)[0]
    honest = [acc for epoch, _, acc in honest_vals if epoch <= first[0]] or [None]
    s = summary(bench.work, run_id, "newcomer")
    return {
        "newcomer_epoch": first[0],
        "newcomer_val_acc": first[2],
        "honest_val_acc_then": honest[-1],
        "refused_downloads": s.get("refused_downloads"),
        "checked_downloads": s.get("checked_downloads"),
        "newcomer_banned_after_s": _banned_after(s, attack_began, attacker_ids),
    }


REJECTED = (
    "rejected_gradient_rounds",
    "rejected_state_rounds",
    "rejected_downloads",
    "skipped_nonfinite_steps",
    "clipped_parts",
)


def _bans(peer_summary: dict[str, Any], among: list[str] | None = None) -> list[float]:
    """When this peer first banned each groupmate it banned (of ``among``, if given)."""
    return [
        x["first_banned"]
        for x in peer_summary.get("suspects", [])
        if x["first_banned"] and (among is None or x["peer"] in among)
    ]


def _peer_id(address: str) -> str:
    return address.rsplit("/p2p/", 1)[-1]


def _banned_after(
    peer_summary: dict[str, Any], attack_began: float, every: list[str] | None = None
) -> float | None:
    """Seconds from the attack's start to this peer's first ban; with ``every``, to its ban of the last of
    them (None if it did not ban them all)."""
    bans = _bans(peer_summary, every)
    if every is not None:
        return round(max(bans) - attack_began, 1) if every and len(bans) == len(every) else None
    return round(min(bans) - attack_began, 1) if bans else None


def _epoch(peer: Peer) -> int:
    return max(int(m.group(1)) for m in (re.search(r"\| epoch (\d+) \|", line) for line in peer.lines) if m)


def summary_table(rows: list[dict[str, Any]]) -> str:
    def cells(r: dict[str, Any]) -> list[Any]:
        after = r["val_after"]
        end = after[-1] if after else None
        return [
            r.get("attack", "x -10^4 (outsized)"),
            r.get("defence", "screen off" if not r.get("reject_factor") else "screen"),
            f"{r.get('honest_peers', 1)} / {r.get('attackers', 1)}",
            ", ".join(fmt(a) for a in r["val_acc_before"]),
            ", ".join(fmt(acc) for _, _, acc in after[:3]) or "-",
            f"{fmt(end[2])} / {fmt(end[1])} at +{end[0]}" if end else "-",
            f"{fmt(r.get('val_acc'))} / {fmt(r.get('val_acc_without'))} after {r.get('val_acc_at_s', '-')} s"
            if r.get("attackers")
            else "-",
            f"{r['rejected_gradient_rounds']} / {r['rejected_state_rounds']} / {r['rejected_downloads']}",
            r.get("clipped_parts", "-"),
            ", ".join("-" if b is None else f"{b:g}" for b in r.get("banned_after_s", [])) or "-",
        ]

    header = [
        "attacker sends",
        "honest peers use",
        "honest peers / attackers",
        "val acc, last 2 before the attack",
        "val acc at +3, +6, +9 epochs",
        "val acc / val loss at the end",
        "val acc / without an attacker, after as long",
        "rejected gradient rounds / state rounds / downloads",
        "parts clipped by the robust mean",
        "attacker banned after (s), per honest peer",
    ]
    return table(rows, "attack", header, cells)
