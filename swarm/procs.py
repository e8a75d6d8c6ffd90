"""Starting and stopping peer processes: each in its own process group, stopped as a group, no leftovers.

A hivemind peer is several processes (the trainer, its DHT process, averagers and the p2p daemon).
Killing only the main PID leaves the rest running, so every peer starts with ``start_new_session=True``
and is stopped through its process group. The p2p client leaves ``/tmp/hivemind-p2p*.sock`` files behind;
:func:`remove_stale_sockets` deletes the ones that no live process holds any more.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0

SOCKET_GLOB = "/tmp/hivemind-p2p*.sock"


def start_group(cmd: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new process group (session), with one thread per process."""
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("MKL_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(list(cmd), env=full_env, start_new_session=True, **kwargs)


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` exists (zombies excluded)."""
    return bool(group_members(pgid))


def group_members(pgid: int) -> list[int]:
    """PIDs of live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.split("/")[2]))
    return members


def stop_group(proc: subprocess.Popen, grace: float = 15.0, sig: int = signal.SIGTERM,
               whole_group: bool = False) -> int | None:
    """Send ``sig`` to the leader of ``proc``'s group (to every member with ``whole_group``), so that it
    shuts its children down in order; SIGKILL the whole group if anything is left after ``grace``.

    Returns the leader's exit code (None if it had to be killed and could not be reaped).
    """
    pgid = proc.pid
    try:
        if whole_group:
            os.killpg(pgid, sig)
        elif proc.poll() is None:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass
    deadline = time.time() + grace
    while time.time() < deadline:
        if proc.poll() is not None and not group_alive(pgid):
            return proc.returncode
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None
    deadline = time.time() + 5
    while group_alive(pgid) and time.time() < deadline:
        time.sleep(0.1)
    return proc.returncode


def wait_group(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait until the leader exited and its group is gone; False on timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None and not group_alive(proc.pid):
            return True
        time.sleep(0.2)
    return False


def _bound_unix_paths() -> set[str]:
    paths = set()
    try:
        with open("/proc/net/unix") as f:
            next(f)
            for line in f:
                parts = line.split()
                if len(parts) >= 8:
                    paths.add(parts[7])
    except OSError:
        pass
    return paths


def stale_sockets(since: float = 0.0) -> list[str]:
    """hivemind socket files modified after ``since`` that no live process is bound to."""
    bound = _bound_unix_paths()
    out = []
    for path in glob.glob(SOCKET_GLOB):
        try:
            if os.stat(path).st_mtime >= since and path not in bound:
                out.append(path)
        except FileNotFoundError:
            continue
    return out


def remove_stale_sockets(since: float = 0.0) -> int:
    """Delete stale hivemind socket files created after ``since``; returns how many were removed."""
    removed = 0
    for path in stale_sockets(since):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


class GracefulStop:
    """SIGINT/SIGTERM handler: the first signal asks the peer to leave after the current step; if the step
    is still blocked (e.g. in an all-reduce) after SHUTDOWN_GRACE_S, or on a second signal, it interrupts."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    def install(self) -> None:
        self.owner_pid = os.getpid()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Cancel the pending interrupt and put the previous handlers back (call in ``finally``)."""
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.owner_pid:  # a forked hivemind child inherited this handler
            if signum == signal.SIGTERM:  # its parent stops it with SIGTERM: die as by default
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return  # Ctrl-C reaches the whole group; the parent shuts children down in order
        if self.event.is_set():
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        self.event.set()
        log.info("Received %s: leaving the swarm after the current step", self.signal_name)
        self._timer = threading.Timer(SHUTDOWN_GRACE_S, signal.raise_signal, args=(signal.SIGINT,))
        self._timer.daemon = True
        self._timer.start()
