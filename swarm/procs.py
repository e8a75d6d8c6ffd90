"""Starting and stopping peer processes: each in its own process group, stopped as a group, no leftovers.

A hivemind peer is several processes (the trainer, its DHT process, averagers and the p2p daemon).
Killing only the main PID leaves the rest running, so every peer starts with ``start_new_session=True``
and is stopped through its process group. The p2p client leaves ``/tmp/hivemind-p2p*.sock`` files behind;
:func:`remove_stale_sockets` deletes the ones that no live process holds any more.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0

SOCKET_GLOB = "/tmp/hivemind-p2p*.sock"


def group_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for a child of :func:`start_group`: one thread per process unless
    set, and unbuffered output."""
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("MKL_NUM_THREADS", "1")
    full_env["PYTHONUNBUFFERED"] = "1"
    return full_env


def start_group(cmd: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new process group (session), with one thread per process."""
    return subprocess.Popen(list(cmd), env=group_env(env), start_new_session=True, **kwargs)


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` exists (zombies excluded)."""
    return bool(group_members(pgid))


def _live_processes() -> dict[int, tuple[int, int]]:
    """{pid: (parent pid, process group)} of every live, non-zombie process, read from /proc."""
    out = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()  # state, ppid, pgrp, ...
        pid = int(stat.split("/")[2])
        if len(fields) > 2 and (fields[0] != "Z" or _threads_left(pid)):
            out[pid] = (int(fields[1]), int(fields[2]))
    return out


def _threads_left(pid: int) -> bool:
    """Whether a process whose main thread is a zombie still has other threads. Killed (SIGKILL), the main
    thread of a process with many threads often ends first and shows as a zombie while the others are
    still exiting (16 of 30 times, 8 busy threads, on a 2-core machine): until the last has gone, they hold
    the process's files, its sockets among them, and the process has not gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (one with threads still exiting is not)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2 :][:1] != "Z" or _threads_left(pid)


def group_members(pgid: int) -> list[int]:
    """PIDs of live (non-zombie) processes whose process group is ``pgid``."""
    return [pid for pid, (_, group) in _live_processes().items() if group == pgid]


def stop_group(proc: subprocess.Popen, grace: float = 15.0, sig: int = signal.SIGTERM) -> int | None:
    """Send ``sig`` to the leader of ``proc``'s group, so that it shuts its children down in order;
    SIGKILL the whole group if anything is left after ``grace``.

    Returns the leader's exit code (None if it had to be killed and could not be reaped).

    Descendants that left the group (torchrun starts its workers in sessions of their own) are SIGKILLed at
    the end if still alive: a hung worker would otherwise outlive its agent, orphaned. Not torch's
    shared-memory manager (:func:`_shared_memory_manager`), which unlinks the group's shared-memory files once
    their last user has gone and then exits by itself: killed, it left them in /dev/shm for good.
    """
    pgid = proc.pid
    members = set(group_members(pgid))
    strays = [
        (pid, _start_time(pid))
        for pid in descendants(pgid)
        if pid not in members and not _shared_memory_manager(pid)
    ]
    try:
        if proc.poll() is None:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass
    try:
        return _stop_group(proc, pgid, grace)
    finally:
        for pid, started in strays:
            if started is not None and _start_time(pid) == started:  # the same process, not a reused PID
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _shared_memory_manager(pid: int) -> bool:
    """Whether ``pid`` is torch's ``torch_shm_manager``: hivemind shares tensors between a peer's processes
    through files in /dev/shm (torch's ``file_system`` strategy), and the peer's first shared tensor starts
    this manager in a session of its own. It unlinks each file once no process that registered it is left
    (about 2 s after the peer's last process), then exits."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return os.path.basename(argv0) == b"torch_shm_manager"


def _start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat), None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rfind(")") + 2 :].split()[19])


def _stop_group(proc: subprocess.Popen, pgid: int, grace: float) -> int | None:
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


def descendants(pid: int) -> list[int]:
    """PIDs of all live descendants of ``pid`` (children, grandchildren, ...)."""
    parents = {child: parent for child, (parent, _) in _live_processes().items()}
    found, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [child for child, parent in parents.items() if parent == current]
        found.extend(children)
        frontier.extend(children)
    return found


def control_socket(pid: int) -> str | None:
    """The control socket file of the p2p daemon ``pid`` (its ``-listen=/unix/<path>``), if it names one."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for arg in args:
        if arg.startswith(b"-listen=/unix/"):
            return arg[len(b"-listen=/unix") :].decode(errors="replace")
    return None


def _control_socket_open(pid: int) -> bool:
    """Whether the p2p daemon ``pid`` still has its control socket (``-listen=/unix/<path>``). A daemon that
    got SIGINT removes it first and exits a moment later: in that moment hivemind's graceful shutdown fails
    with a traceback (FileNotFoundError on the socket), so such a daemon counts as gone."""
    path = control_socket(pid)
    return path is None or os.path.exists(path)  # no unix control socket named: judged by the process alone


def is_p2p_daemon(pid: int) -> bool:
    """Whether process ``pid`` is a hivemind p2p daemon (p2pd)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "p2pd"
    except OSError:
        return False


def p2p_daemons(pid: int | None = None) -> list[int]:
    """PIDs of the hivemind p2p daemons (p2pd) below process ``pid`` (default: this process)."""
    return [child for child in descendants(os.getpid() if pid is None else pid) if is_p2p_daemon(child)]


def p2p_daemon_alive(pid: int | None = None) -> bool:
    """True if a hivemind p2p daemon (p2pd) still runs below process ``pid`` (default: this process).

    Ctrl-C in a terminal signals the whole process group, and p2pd exits on SIGINT. Without it, hivemind's
    graceful shutdown can only fail noisily, so roles check this first and stop their helpers directly.
    """
    for child in p2p_daemons(pid):
        try:
            if _control_socket_open(child):
                return True
        except OSError:
            continue
    return False


def _socket_inodes(pids: list[int | str]) -> set[str]:
    """Inodes of the sockets that the processes ``pids`` ("self" for this one) hold open."""
    inodes: set[str] = set()
    for pid in pids:
        for fd in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def _bound_unix_paths(exclude_own: bool = False, mine: set[str] = frozenset()) -> tuple[set[str], set[str]]:
    """Paths of bound unix sockets, and of those among them held by this very process; with ``exclude_own``,
    the latter are left out of the former. Sockets whose inode is in ``mine`` count as this process's too."""
    own_inodes = (_socket_inodes(["self"]) if exclude_own else set()) | mine
    paths, own = set(), set()
    for table in _unix_tables():
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if len(parts) >= 8:
                        (own if parts[6] in own_inodes else paths).add(parts[7])
        except (OSError, StopIteration):
            continue
    return paths, own


def _accepts(path: str) -> bool:
    """Whether a process accepts connections on the unix socket ``path`` (not when refused or missing)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:  # a full backlog, a timeout: someone is there
            return True
    return True


def _unix_tables() -> list[str]:
    """One ``/proc/<pid>/net/unix`` per network namespace that a live process is in.

    /proc/net/unix lists only the sockets of the reader's own namespace, but socket files live in the shared
    /tmp: a peer that judged by its own table alone would delete the sockets of peers in other namespaces
    (containers, or the wan bench's namespaces) and cut them off from their p2p daemons."""
    tables, seen = ["/proc/self/net/unix"], set()
    try:
        seen.add(os.readlink("/proc/self/ns/net"))
    except OSError:
        return tables
    for ns in glob.glob("/proc/[0-9]*/ns/net"):
        try:
            name = os.readlink(ns)
        except OSError:
            continue
        if name not in seen:
            seen.add(name)
            tables.append(ns[: -len("ns/net")] + "net/unix")
    return tables


def stale_sockets(since: float = 0.0, exclude_own: bool = False) -> list[str]:
    """hivemind socket files modified after ``since`` that no live process is bound to.

    With ``exclude_own``, sockets held by this process count as stale too (for a process about to exit).
    """
    bound, own = _bound_unix_paths(exclude_own)
    out = []
    for path in glob.glob(SOCKET_GLOB):
        try:
            if os.stat(path).st_mtime < since or path in bound:
                continue
        except FileNotFoundError:
            continue
        # /proc/net/unix is read a page at a time, and while other sockets come and go a read skips live
        # entries (300 listening sockets, 100 others bound and closed over and over: 63 misses in 7,561
        # reads). A socket file missing from it is stale only if nobody accepts a connection on it: deleting a
        # live one cut a peer's averager off from its p2p daemon (every download from it: Connection lost)
        if path in own or not _accepts(path):
            out.append(path)
    return out


def remove_stale_sockets(since: float = 0.0, exclude_own: bool = False, settle: float = 0.0) -> int:
    """Delete stale hivemind socket files created after ``since``; returns how many were removed.

    With ``settle``, keep looking for up to that many seconds while newer socket files are still bound by
    this process's descendants or its process group (a p2p daemon whose DHT process died is an orphan, still
    in the group), since a p2p daemon that is being stopped releases its socket a moment later. Other
    processes on the machine (the demo's other peers, a test's) hold newer sockets too: waiting for those
    cost every leaving peer the whole ``settle``.
    """
    removed, deadline = 0, time.time() + settle
    waited: set[str] = set()  # files that this process's own were seen to hold
    while True:
        # decided before the clean-up below, so that the last pass sees what a released socket left behind
        finished = time.time() >= deadline or not _held_by_ours(since, waited)
        for path in stale_sockets(since, exclude_own):
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
        if finished:
            return removed
        time.sleep(0.2)


def _held_by_ours(since: float, waited: set[str]) -> bool:
    """Whether a hivemind socket file newer than ``since`` is bound by this process's descendants or its
    process group (which adds such files to ``waited``), or, being in ``waited``, is still bound at all: a
    child that is exiting has closed its descriptors a moment before the kernel drops its sockets."""
    pending = [p for p in glob.glob(SOCKET_GLOB) if _mtime(p) >= since]
    if not pending:
        return False
    ours = (set(descendants(os.getpid())) | set(group_members(os.getpgid(0)))) - {os.getpid()}
    others, held = _bound_unix_paths(mine=_socket_inodes(sorted(ours)))
    waited |= {p for p in pending if p in held}
    return any(p in held or (p in waited and p in others) for p in pending)


def remove_own_temp_dir() -> None:
    """Remove the folder that ``multiprocessing`` made for this process in the temporary directory
    (``pymp-*``, which holds the listening socket through which its resource sharer hands pipes to other
    processes: every hivemind request to a DHT or averager process carries one). multiprocessing removes it
    at a normal exit; a role that leaves through ``os._exit`` calls this first, or every run leaves one such
    folder behind. A folder inherited from the parent (a peer forked by the launcher) stays: multiprocessing's
    finalizer runs only in the process that made it."""
    from multiprocessing import util

    for finalizer in list(getattr(util, "_finalizer_registry", {}).values()):
        if getattr(finalizer, "_callback", None) is getattr(util, "_remove_temp_dir", object()):
            try:
                finalizer()
            except Exception as exc:  # a temporary folder is not worth a traceback at exit
                log.debug("Could not remove multiprocessing's temporary folder: %r", exc)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except FileNotFoundError:
        return 0.0


class GracefulStop:
    """SIGINT/SIGTERM handler: the first signal asks the peer to leave after the current step; if the step
    is still blocked (e.g. in an all-reduce) after SHUTDOWN_GRACE_S, or on a second signal, it interrupts.
    Once the role's orderly shutdown has begun (:meth:`disarm`), a further signal changes nothing: the
    force-exit deadline still bounds it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason: str | None = None  # why the peer leaves ("Received SIGTERM")
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        self._disarmed = False
        self._interrupted = False
        self.started = time.time()

    def install(self) -> None:
        """Handle SIGINT and SIGTERM in this process (again, if a library replaced the handlers)."""
        self.owner_pid = os.getpid()
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def disarm(self) -> None:
        """The role has begun its orderly shutdown: never interrupt it (the force-exit deadline stays)."""
        self._disarmed = True
        if self._timer is not None:
            self._timer.cancel()

    def restore(self) -> None:
        """Disarm, and put the previous handlers back (call in ``finally``)."""
        self.disarm()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.owner_pid:  # a forked hivemind child inherited this handler
            if signum == signal.SIGTERM:  # its parent stops it with SIGTERM: die as by default
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return  # Ctrl-C reaches the whole group; the parent shuts children down in order
        if self.event.is_set():
            if self._disarmed:  # the orderly shutdown is under way: cut short, it would strand its helpers
                log.info("Received %s again: already leaving", signal.Signals(signum).name)
                return
            raise KeyboardInterrupt
        self._begin(f"Received {signal.Signals(signum).name}")

    def request(self, reason: str) -> None:
        """Leave as on a first signal, for ``reason`` (from any thread; once)."""
        if not self.event.is_set():
            self._begin(reason)

    def _begin(self, reason: str) -> None:
        self.reason = reason
        # said before the event wakes the main thread: a role with little to stop (a bootstrap peer) had left,
        # and os._exit-ed, before this thread wrote the line
        log.info("%s: leaving the swarm after the current step", reason)
        self.event.set()
        # pthread_kill, not raise_signal: only a signal aimed at the main thread interrupts its blocking wait.
        # SIGTERM, not SIGINT: libraries (hivemind's averagers) may set SIGINT to be ignored.
        self._deadline = time.time() + SHUTDOWN_GRACE_S
        self._timer = threading.Timer(0.5, self._watch)
        self._timer.daemon = True
        self._timer.start()
        # last resort: if even the orderly shutdown hangs, stop our children and leave
        force = threading.Timer(4 * SHUTDOWN_GRACE_S, self._force_exit)
        force.daemon = True
        force.start()

    def _watch(self) -> None:
        """Interrupt the main thread once the grace period is over, or at once if the p2p daemon is gone
        (the signal reached the whole group), because then a pending averaging round can never finish.
        Repeat every second until the role starts its shutdown: hivemind swallows some interrupts
        (``except BaseException`` around an averaging round) and then waits on the next one."""
        if self._disarmed:
            return
        if time.time() >= self._deadline or not p2p_daemon_alive(self.owner_pid):
            if not self._interrupted:
                log.info("Interrupting the current step to leave now")
            self._interrupted = True
            signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
        self._timer = threading.Timer(1.0 if self._interrupted else 0.5, self._watch)
        self._timer.daemon = True
        self._timer.start()

    def _force_exit(self) -> None:
        log.error("Leaving did not finish within %.0f s; killing this peer's processes", 4 * SHUTDOWN_GRACE_S)
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        remove_stale_sockets(since=self.started, exclude_own=True, settle=2.0)
        remove_own_temp_dir()
        os._exit(0)


def own_children() -> set:
    """This process's live ``multiprocessing`` children: note them before a role starts, for
    :func:`stop_strays`."""
    import multiprocessing

    return set(multiprocessing.active_children())


def stop_strays(before: set, grace: float = 5.0) -> int:
    """Stop this process's ``multiprocessing`` children that were not in ``before`` (:func:`own_children`)
    and are still alive: call once a role has shut down what it holds (or when its DHT process died, and
    hivemind's shutdown would wait on it). A signal that reaches the process
    group while hivemind forks an averager (its Optimizer under construction) misses the new child, and the
    interrupted constructor never hands the averager to its owner: it ran on, orphaned, waiting for a parent
    that had left. SIGTERM, then SIGKILL after ``grace`` seconds; returns how many were stopped."""
    import multiprocessing

    strays = [child for child in multiprocessing.active_children() if child not in before]
    for child in strays:
        child.terminate()
    for child in strays:
        child.join(grace)
        if child.is_alive():
            child.kill()
            child.join(1.0)
    if strays:
        log.info("Stopped %d helper process(es) left running without an owner", len(strays))
    return len(strays)


class ChildError(RuntimeError):
    """A child process did not do what was waited for; the message ends with its latest output."""


class Child:
    """``cmd`` in its own process group (:func:`start_group`), its output collected line by line with the
    time each line was read, and passed to ``echo`` (print it with a name in front, write it to a log).

    The one launcher of the demo, the bench and the tests. With a ``launcher`` (peer/launcher.py's, which
    has the peer's modules imported), a ``python -m peer ...`` command is forked from it instead of started
    as a fresh interpreter."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        echo: Callable[[str], None] | None = None,
        env: dict[str, str] | None = None,
        launcher: Any = None,
    ) -> None:
        self.name, self.cmd, self.echo, self.launcher = name, list(cmd), echo, launcher
        self.started = time.time()
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line was read (wall clock, as in the peers' summaries)
        self.proc = self._start(env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _start(self, env: dict[str, str] | None) -> Any:
        """The process (a ``subprocess.Popen``, or an object with its ``pid``, ``stdout``, ``poll``, ``wait``,
        ``returncode`` and ``send_signal``) leading a new process group, its output on ``stdout``."""
        if self.launcher is not None:
            return self.launcher.spawn(self.cmd, group_env(env), os.getcwd())
        return start_group(
            self.cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.times.append(time.time())
            self.lines.append(line)
            if self.echo is not None:
                self.echo(line)

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float, after: float | None = None) -> re.Match:
        """The first line matching ``pattern`` (of those read after the time ``after``, if given); raises
        ChildError with the latest output if none comes within ``timeout`` or the process ends first."""
        from swarm.waiting import wait_until

        regex, seen = re.compile(pattern), 0

        def match() -> re.Match | None:
            nonlocal seen
            lines = list(zip(self.times, self.lines, strict=False))
            for when, line in lines[seen:]:
                found = regex.search(line)
                if found and (after is None or when >= after):
                    return found
            seen = len(lines)
            if self.proc.poll() is not None and not self._reader.is_alive():
                tail = self.output()[-6000:]
                raise ChildError(f"{self.name} exited; no line matching {pattern!r}:\n{tail}")
            return None

        found = wait_until(match, timeout)
        if not found:
            tail = self.output()[-6000:]
            raise ChildError(f"{self.name}: no line matching {pattern!r} within {timeout}s; output:\n{tail}")
        return found

    def line_time(self, pattern: str) -> float:
        """Wall-clock time at which the first line matching ``pattern`` was read."""
        regex = re.compile(pattern)
        for when, line in zip(self.times, self.lines, strict=False):
            if regex.search(line):
                return when
        raise ChildError(f"{self.name}: no line matching {pattern!r}; output:\n{self.output()[-4000:]}")

    def join_address(self, timeout: float = 120) -> str:
        """The address of the join line this process prints (swarm/layout.py)."""
        from swarm.layout import JOIN_RE

        return self.wait_for(JOIN_RE.pattern, timeout).group(1)

    def stop(self, grace: float = 15.0) -> int | None:
        """Stop the whole group (:func:`stop_group`); the leader's exit code."""
        code = stop_group(self.proc, grace=grace)
        self._reader.join(timeout=5)
        return code
