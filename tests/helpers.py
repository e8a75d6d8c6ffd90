"""Helpers for tests that start real `swarm-peer` processes on 127.0.0.1."""

from __future__ import annotations

import math
import os
import pickle
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from swarm import layout
from swarm.procs import Child, group_env, group_members, remove_stale_sockets, start_group
from swarm.waiting import wait_until

EPOCH_RE = re.compile(r"\| epoch (\d+) \|")


class Zygote:
    """The test process's end of tests/zygote.py: a process that imported the peer's modules once and forks
    each `python -m peer ...` asked of it. One per test process, started at its first use."""

    _one: Zygote | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> Zygote:
        with cls._lock:
            if cls._one is None or cls._one.server.poll() is not None:
                cls._one = cls()
            return cls._one

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server = start_group(
            [sys.executable, str(Path(__file__).with_name("zygote.py")), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.sock, self.send_lock = ours, threading.Lock()
        self.pids: queue.Queue[int] = queue.Queue()
        self.statuses: dict[int, int] = {}
        self.ended = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    @classmethod
    def close(cls) -> None:
        """End the zygote (it exits when its socket closes); the peers it forked are the tests' to stop."""
        with cls._lock:
            if cls._one is not None:
                cls._one.sock.shutdown(socket.SHUT_RDWR)
                cls._one.server.wait(timeout=30)
                cls._one = None

    def _read(self) -> None:
        while True:
            message = self.sock.recv(4096)
            if not message:  # the zygote has gone
                return
            kind, *rest = pickle.loads(message)
            if kind == "pid":
                self.pids.put(rest[0])
            else:
                with self.ended:
                    self.statuses[rest[0]] = rest[1]
                    self.ended.notify_all()

    def spawn(self, args: list[str], env: dict[str, str], cwd: str) -> ForkedPeer:
        read, write = os.pipe()
        try:
            with self.send_lock:
                request = pickle.dumps({"args": args, "env": env, "cwd": cwd})
                socket.send_fds(self.sock, [request], [write])
                pid = self._pid(timeout=120)
        finally:
            os.close(write)
        out = os.fdopen(read, "r", buffering=1, encoding="utf-8", errors="replace")
        return ForkedPeer(pid, out, self, [sys.executable, "-m", "peer", *args])

    def _pid(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.pids.get(timeout=0.5)
            except queue.Empty:
                if self.server.poll() is not None:
                    break
        raise RuntimeError(f"the zygote (tests/zygote.py) forked nothing; exit code {self.server.poll()}")

    def status(self, pid: int, timeout: float | None) -> int | None:
        """The wait status of ``pid`` once it has ended, within ``timeout`` (None: no limit)."""
        with self.ended:
            self.ended.wait_for(lambda: pid in self.statuses or self.server.poll() is not None, timeout)
            return self.statuses.get(pid)


class ForkedPeer:
    """What a test needs of ``subprocess.Popen`` for a process that the zygote forked (it is the parent)."""

    def __init__(self, pid: int, stdout, zygote: Zygote, args: list[str]) -> None:
        self.pid, self.stdout, self.zygote, self.args = pid, stdout, zygote, args
        self.returncode: int | None = None

    def poll(self, timeout: float | None = 0) -> int | None:
        """The exit code once the process has ended (within ``timeout``), else None."""
        if self.returncode is None:
            status = self.zygote.status(self.pid, timeout)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self.poll(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class PeerProcess(Child):
    """A `python -m peer ...` process in its own process group (swarm/procs.py's Child), registered so that
    the test's fixture stops it whatever happens.

    Without a ``launcher`` it is forked from the test process's zygote (tests/zygote.py), which imported
    the peer's modules once: the same CLI, arguments, environment and process group as a fresh
    interpreter, without its 5-6 CPU seconds of imports."""

    def __init__(
        self, name: str, args: list[str], registry: list[PeerProcess], launcher: list[str] | None = None
    ) -> None:
        """``launcher`` replaces ``python`` in front of ``-m peer`` (e.g. torchrun and its flags): a fresh
        interpreter."""
        self.args, self.launcher = args, launcher
        super().__init__(name, [*(launcher or [sys.executable]), "-m", "peer", *args])
        registry.append(self)

    def _start(self, env: dict[str, str] | None):
        if self.launcher is not None:
            return super()._start(env)
        return Zygote.get().spawn(self.args, group_env(env), os.getcwd())

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
