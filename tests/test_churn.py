"""Churn on 127.0.0.1: peers join and leave at random (SIGKILL or SIGTERM), with at least one always alive,
against the same swarm without churn. Prints the global epochs per minute of both.

Slow (about 6 minutes): ``.ci/run --slow`` or ``pytest -m slow``. ``CHURN_SECONDS`` sets each phase's length.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from swarm.procs import group_members
from swarm.waiting import wait_until
from tests.helpers import EPOCH_RE, PeerProcess

SECONDS = float(os.environ.get("CHURN_SECONDS", 150))
STALL_LIMIT = 60.0  # no global epoch for this long would be a deadlock (averaging_timeout is 15 s)
LOSS_RE = re.compile(r"\| loss (\d+\.\d+) \|")


class Swarm:
    """Peers of one run, started and stopped by the test; each new peer joins through a random live peer."""

    def __init__(self, registry: list, run: str, log_dir: Path, seed: int) -> None:
        self.registry, self.run, self.log_dir = registry, run, log_dir
        self.rng = random.Random(seed)
        self.live: list[PeerProcess] = []
        self.all: list[PeerProcess] = []
        self.events: list[str] = []

    def spawn(self) -> PeerProcess:
        n = len(self.all)
        args = ["join", "--config", "demo", "--run-id", self.run, "--log-dir", str(self.log_dir)]
        args += ["--host-maddr", "/ip4/127.0.0.1/tcp/0", "--peer-name", f"p{n}", "--seed", str(n)]
        args += ["--max-epochs", "100000", "--log-every", "1", "--eval-every", "1000", "--threads", "1"]
        if self.live:
            args += ["--initial-peers", self.rng.choice(self.live).join_address(timeout=120)]
        peer = PeerProcess(f"p{n}", args, self.registry)
        peer.join_address(timeout=120)
        self.live.append(peer)
        self.all.append(peer)
        self.events.append(f"{time.strftime('%H:%M:%S')} join p{n} ({len(self.live)} live)")
        return peer

    def remove(self) -> None:
        peer = self.rng.choice(self.live)
        self.live.remove(peer)
        how = self.rng.choice(("SIGKILL", "SIGTERM"))
        os.killpg(peer.pgid, getattr(signal, how))
        self.events.append(f"{time.strftime('%H:%M:%S')} {how} {peer.name} ({len(self.live)} live)")
        code = peer.wait_gone(timeout=30)
        assert code == (-signal.SIGKILL if how == "SIGKILL" else 0), peer.output()[-3000:]

    def progress(self, since: float) -> list[tuple[float, int]]:
        """(time, highest global epoch any peer had shown so far) for every progress line after ``since``."""
        points = sorted(
            (t, int(m.group(1)))
            for p in self.all
            for t, line in zip(p.times, p.lines, strict=False)
            if t >= since and (m := EPOCH_RE.search(line))
        )
        best, out = -1, []
        for t, epoch in points:
            best = max(best, epoch)
            out.append((t, best))
        return out

    def losses(self, start: float, end: float) -> list[float]:
        return [
            float(m.group(1))
            for p in self.all
            for t, line in zip(p.times, p.lines, strict=False)
            if start <= t <= end and (m := LOSS_RE.search(line))
        ]

    def stop_all(self) -> None:
        for peer in list(self.live):
            os.killpg(peer.pgid, signal.SIGTERM)
        for peer in self.live:
            assert peer.wait(timeout=30) == 0, peer.output()[-3000:]
        self.live = []
        wait_until(lambda: not any(group_members(p.pgid) for p in self.all), timeout=30)


def _phase(peers: list, tmp_path: Path, run: str, churn: bool) -> dict:
    swarm = Swarm(peers, run, tmp_path, seed=7)
    for _ in range(3):
        swarm.spawn()
    swarm.all[0].wait_for(r"\| epoch \d+ \| peers 3", timeout=180)
    start = time.time()
    print(
        f"\n{time.strftime('%H:%M:%S')} {run}: 3 peers training; "
        f"{'churn' if churn else 'no churn'} for {SECONDS:.0f} s"
    )
    while time.time() - start < SECONDS:
        time.sleep(swarm.rng.uniform(10, 20))
        if not churn:
            continue
        if len(swarm.live) <= 1 or (len(swarm.live) < 4 and swarm.rng.random() < 0.5):
            swarm.spawn()
        else:
            swarm.remove()
    end = time.time()
    swarm.stop_all()
    progress = swarm.progress(start)
    assert progress, "no progress line during the phase"
    epochs = progress[-1][1] - progress[0][1]
    times = (
        [start] + [t for (t, e), (_, prev) in zip(progress[1:], progress, strict=False) if e > prev] + [end]
    )
    stall = max(b - a for a, b in zip(times, times[1:], strict=False))
    third = (end - start) / 3
    early, late = swarm.losses(start, start + third), swarm.losses(end - third, end)
    for peer in swarm.all:
        assert not group_members(peer.pgid), peer.name
    return {
        "epochs_per_minute": epochs / ((end - start) / 60),
        "epochs": epochs,
        "longest_stall_s": stall,
        "early_loss": sum(early) / len(early),
        "late_loss": sum(late) / len(late),
        "peers_started": len(swarm.all),
        "events": swarm.events,
    }


@pytest.mark.slow
def test_training_advances_under_churn(peers, tmp_path):
    steady = _phase(peers, tmp_path, "pytest-steady", churn=False)
    churned = _phase(peers, tmp_path, "pytest-churn", churn=True)
    print(f"\nchurn events: {churned['events']}")
    for name, r in (("no churn", steady), ("churn", churned)):
        print(
            f"{name}: {r['epochs_per_minute']:.1f} global epochs/min ({r['epochs']} in {SECONDS:.0f} s), "
            f"longest stall {r['longest_stall_s']:.1f} s, loss {r['early_loss']:.3f} -> "
            f"{r['late_loss']:.3f}, {r['peers_started']} peers started"
        )
    assert churned["peers_started"] > 3, churned["events"]  # there really was churn
    assert churned["epochs"] > 0 and churned["longest_stall_s"] < STALL_LIMIT, churned
    assert churned["late_loss"] < churned["early_loss"], churned
