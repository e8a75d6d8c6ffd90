"""Helpers for tests that start real `swarm-peer` processes on 127.0.0.1."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from peer.launcher import Launcher
from swarm import layout
from swarm.procs import Child, group_members, remove_stale_sockets
from swarm.waiting import wait_until

EPOCH_RE = re.compile(r"\| epoch (\d+) \|")


class SharedLauncher:
    """One launcher (peer/launcher.py, the demo's too) per test process, started at its first use: it has
    imported the peer's modules once and forks each `python -m peer ...` asked of it."""

    _one: Launcher | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> Launcher:
        with cls._lock:
            if cls._one is None or not cls._one.alive():
                cls._one = Launcher()
            return cls._one

    @classmethod
    def close(cls) -> None:
        """End the launcher; the peers it forked are the tests' to stop."""
        with cls._lock:
            if cls._one is not None:
                cls._one.close()
                cls._one = None


class PeerProcess(Child):
    """A `python -m peer ...` process in its own process group (swarm/procs.py's Child), registered so that
    the test's fixture stops it whatever happens.

    Without a ``launcher`` it is forked from the test process's launcher (peer/launcher.py), which imported
    the peer's modules once: the same CLI, arguments, environment and process group as a fresh
    interpreter, without its 5-6 CPU seconds of imports."""

    def __init__(
        self, name: str, args: list[str], registry: list[PeerProcess], launcher: list[str] | None = None
    ) -> None:
        """``launcher`` replaces ``python`` in front of ``-m peer`` (e.g. torchrun and its flags): a fresh
        interpreter."""
        self.args = args
        cmd = [*(launcher or [sys.executable]), "-m", "peer", *args]
        super().__init__(name, cmd, launcher=None if launcher else SharedLauncher.get())
        registry.append(self)

    def epoch(self) -> int:
        """The global epoch of this peer's latest progress line (-1 before the first)."""
        for line in reversed(self.lines):
            match = EPOCH_RE.search(line)
            if match:
                return int(match.group(1))
        return -1

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not finish within {timeout}s; output:\n"
                + self.output()[-6000:]
                + "\n--- stacks (SIGUSR1) ---\n"
                + self.stacks()
            ) from None

    def stacks(self, settle: float = 3.0) -> str:
        """Every thread's stack in every process of the group (the CLI registers faulthandler on SIGUSR1)."""
        before = len(self.lines)
        for pid in group_members(self.pgid):
            try:
                if b"p2pd" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue  # Go's p2p daemon would exit on SIGUSR1
                os.kill(pid, signal.SIGUSR1)
                time.sleep(0.5)  # one process at a time, so that the dumps do not interleave
            except (ProcessLookupError, FileNotFoundError):
                pass
        time.sleep(settle)
        return "\n".join(self.lines[before:])[:30000]

    def wait_gone(self, timeout: float = 30) -> int:
        """Wait until the leader and every process of its group have exited; returns the leader's code.

        A SIGKILLed peer cannot remove its socket files: once no process of the group is left, the socket
        files that appeared since this peer started and that no one holds (within 5 s) are removed.
        """
        code = self.wait(timeout=timeout)
        wait_until(lambda: not group_members(self.pgid), timeout=timeout)
        assert not group_members(self.pgid), f"{self.name}: processes left {group_members(self.pgid)}"
        if code == -signal.SIGKILL:  # a killed process's threads may hold its sockets a moment longer
            remove_stale_sockets(since=self.started, settle=5.0)
        return code


def plain_timm_model(model_cfg):
    """The model of ``model_cfg`` built with timm alone, as a user who loads a checkpoint would."""
    import timm

    m = model_cfg
    return timm.create_model(
        m.model_name,
        pretrained=False,
        num_classes=m.num_classes,
        img_size=m.img_size,
        patch_size=m.patch_size,
        embed_dim=m.embed_dim,
        depth=m.depth,
        num_heads=m.num_heads,
    )


def read_summary(log_dir: Path, run_id: str, peer_name: str) -> dict:
    return layout.read_summary(log_dir, run_id, peer_name)


def synced_epochs(
    a: dict, b: dict, rel: float, between: tuple[float, float] = (0.0, math.inf)
) -> tuple[list[int], list[int]]:
    """The global epochs that both peers (their summaries) completed within ``between`` (wall-clock times),
    and those of them at which both held equal parameters (checksums within ``rel``, relative).

    Equality holds per successful averaging round, not at every epoch: when a round fails, hivemind goes on
    with local updates and the peers differ (by ~5e-4 in the sum of squares) until the next parameter
    averaging succeeds.
    """

    def done(s: dict) -> set[int]:
        return {h["epoch"] for h in s["history"] if between[0] <= h["time"] <= between[1]}

    common = sorted(done(a) & done(b) & {int(e) for e in a["checksums"]} & {int(e) for e in b["checksums"]})
    equal = [
        e
        for e in common
        if all(
            math.isclose(x, y, rel_tol=rel, abs_tol=rel)
            for x, y in zip(a["checksums"][str(e)], b["checksums"][str(e)], strict=True)
        )
    ]
    return common, equal


def states_kept(gone: dict, kept: dict, rel: float, before: float = math.inf) -> tuple[list[int], list[int]]:
    """The global epochs that one peer (``gone``, its summary) completed before ``before`` (wall-clock time),
    and those of them whose parameters (checksums within ``rel``, relative) the other (``kept``) also held at
    an epoch it completed before then, whatever number it gave that epoch.

    Right after a peer joins, the two can number the same averaged parameters apart: each stepped alone
    while it led by an epoch (a peer's tracker counts the peers at the newest epoch only), and a state round
    moves the one behind forward by one epoch at most (swarm/patches/state_averager.py, ``sane_epochs``), so
    a gap of k epochs closes in k averaged rounds.
    """

    def done(s: dict) -> list[int]:
        times = {h["epoch"]: h["time"] for h in s["history"]}
        return sorted(int(e) for e in s["checksums"] if times.get(int(e), math.inf) <= before)

    held = [kept["checksums"][str(e)] for e in done(kept)]
    epochs = done(gone)

    def close(x: list[float], y: list[float]) -> bool:
        return all(math.isclose(a, b, rel_tol=rel, abs_tol=rel) for a, b in zip(x, y, strict=True))

    same = [e for e in epochs if any(close(gone["checksums"][str(e)], h) for h in held)]
    return epochs, same


def port_of(maddr: str) -> int:
    return int(maddr.split("/tcp/")[1].split("/")[0])
