"""A launcher that has imported the peer's modules once and forks a `python -m peer ...` process per request.

A fresh `swarm-peer join` spends 5-6 CPU seconds importing torch, Lightning (with torchmetrics, torchvision
and, through them, ``torch._dynamo``), timm and hivemind before it does anything. Where one program starts
several peers on one machine (`swarm-peer demo`, the tests), they are forked from this launcher instead: each
is a process of its own that runs the same ``peer.cli.main`` with its own arguments, environment, working
directory, process group (a new session, as :func:`swarm.procs.start_group` makes) and output pipe; only the
imports are shared.

Protocol, over one SOCK_SEQPACKET socket from the program that started the launcher (:class:`Launcher`):
- request: a pickled ``{"args", "env", "cwd"}`` (``args``: what follows ``python -m peer``), with the
  write end of the output pipe attached (SCM_RIGHTS);
- answers: pickled ``("pid", pid)`` for each request, in order, and ``("exit", pid, wait_status)`` when a
  forked process ends (the launcher is its parent and reaps it at once).

The launcher ends when that socket closes (its owner ended or called :meth:`Launcher.close`); the processes
it forked are their owner's to stop.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

PRELOAD = ("peer.cli", "peer.volunteer", "monitor.role", "peer.evaluate")


class Launcher:
    """The owner's end of a launcher process (``python -m peer.launcher``), started at once; it imports in
    the background, and the first :meth:`spawn` waits for that."""

    def __init__(self) -> None:
        from swarm.procs import start_group

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server = start_group(
            [sys.executable, "-m", "peer.launcher", str(theirs.fileno())], pass_fds=[theirs.fileno()]
        )
        theirs.close()
        self.sock, self.send_lock = ours, threading.Lock()
        self.pids: queue.Queue[int] = queue.Queue()
        self.statuses: dict[int, int] = {}
        self.ended = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def close(self, timeout: float = 30.0) -> None:
        """End the launcher (it exits when its socket closes); the processes it forked are the owner's."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.server.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()

    def alive(self) -> bool:
        return self.server.poll() is None

    def _read(self) -> None:
        while True:
            try:
                message = self.sock.recv(4096)
            except OSError:
                message = b""
            if not message:  # the launcher has gone
                with self.ended:
                    self.ended.notify_all()
                return
            kind, *rest = pickle.loads(message)
            if kind == "pid":
                self.pids.put(rest[0])
            else:
                with self.ended:
                    self.statuses[rest[0]] = rest[1]
                    self.ended.notify_all()

    def spawn(self, cmd: list[str], env: dict[str, str], cwd: str) -> ForkedProcess:
        """``cmd`` (``[python, "-m", "peer", ...]``) forked from the launcher, its output on a pipe."""
        if cmd[1:3] != ["-m", "peer"]:
            raise ValueError(f"the launcher runs `python -m peer ...` only, not {cmd}")
        read, write = os.pipe()
        try:
            with self.send_lock:
                request = pickle.dumps({"args": cmd[3:], "env": env, "cwd": cwd})
                try:
                    socket.send_fds(self.sock, [request], [write])
                except OSError as exc:  # its end of the socket is closed
                    raise RuntimeError(f"the launcher has exited (code {self.server.poll()}): {exc}") from exc
                pid = self._pid(timeout=120)
        finally:
            os.close(write)
        out = os.fdopen(read, "r", buffering=1, encoding="utf-8", errors="replace")
        return ForkedProcess(pid, out, self, list(cmd))

    def _pid(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.pids.get(timeout=0.5)
            except queue.Empty:
                if self.server.poll() is not None:
                    break
        raise RuntimeError(f"the launcher forked nothing (exit code {self.server.poll()})")

    def status(self, pid: int, timeout: float | None) -> int | None:
        """The wait status of ``pid`` once it has ended, within ``timeout`` (None: no limit). If the launcher
        itself has gone, a process that no longer exists counts as killed (its status was lost with it)."""
        from swarm.procs import running

        with self.ended:
            self.ended.wait_for(lambda: pid in self.statuses or self.server.poll() is not None, timeout)
            if pid in self.statuses:
                return self.statuses[pid]
        if self.server.poll() is not None and not running(pid):
            return signal.SIGKILL  # as os.waitpid reports a process killed by SIGKILL
        return None


class ForkedProcess:
    """What the owner needs of ``subprocess.Popen`` for a process that the launcher forked."""

    def __init__(self, pid: int, stdout: Any, launcher: Launcher, args: list[str]) -> None:
        self.pid, self.stdout, self.launcher, self.args = pid, stdout, launcher, args
        self.returncode: int | None = None

    def poll(self, timeout: float | None = 0) -> int | None:
        """The exit code once the process has ended (within ``timeout``), else None."""
        if self.returncode is None:
            status = self.launcher.status(self.pid, timeout)
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


# -- the launcher process ------------------------------------------------------------------------------
def main(fd: int) -> None:
    import importlib

    from swarm.log import quiet_libraries

    quiet_libraries()  # the imports' own warnings, as the CLI silences them
    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    request = serve(sock)
    if request is not None:  # in a forked child: become the peer; its exit ends this process as usual
        run_peer(*request)


def serve(sock: socket.socket) -> tuple[dict, int] | None:
    """Answer requests until the owner closes its end; returns a request in a forked child."""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        reap(sock, children)
        if not readable:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
        except OSError:
            message = b""
        if not message:  # the owner has gone: the processes it started are its to stop
            return None
        request = pickle.loads(message)
        pid = os.fork()
        if pid == 0:
            sock.close()
            return request, fds[0]
        os.close(fds[0])
        children.add(pid)
        sock.send(pickle.dumps(("pid", pid)))


def reap(sock: socket.socket, children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            try:
                sock.send(pickle.dumps(("exit", pid, status)))
            except OSError:  # the owner has gone
                pass


def fresh_process_locks() -> None:
    """Give this forked process the process-wide locks that a fresh interpreter creates when it imports
    hivemind.

    hivemind makes them at import (``multiprocessing.Lock``, a semaphore in shared memory): ``MPFuture``'s
    initialisation and pipe-update locks, ``SharedBytes``' lock (utils/mpfuture.py:40, 82-83) and the async
    context executor's lock (utils/asyncio.py:171). Inherited from the launcher, one lock would be shared by
    every process it forks: a peer killed while holding it would leave the next peer's DHT process waiting
    for it forever, in ``MPFuture._send_update``. ``reset_backend`` is hivemind's own way to renew the first
    three."""
    import multiprocessing as mp

    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()
    _AsyncContextWrapper.EXECUTOR_LOCK = mp.Lock()


def shared_memory_manager() -> None:
    """Start torch's shared-memory manager before this process takes its output pipe.

    hivemind shares tensors between a peer's processes through files in shared memory (utils/mpfuture.py:22,
    torch's ``file_system`` strategy). The first such tensor starts ``torch_shm_manager``, which runs in a
    session of its own and keeps the standard error of the process that started it until the last of that
    peer's processes has gone, and a moment after (about 2 s). Started from the peer itself it would hold
    the peer's output pipe open that long after the peer ended, and whoever reads the pipe to its end (the
    demo, the tests) would wait for it. Started here, it holds the launcher's instead; the peer and the
    processes it forks use it as they would have used their own."""
    import torch

    torch.empty(1).share_memory_()


def run_peer(request: dict, out: int) -> None:
    import runpy

    os.setsid()
    fresh_process_locks()
    if request["args"][:1] in (["join"], ["monitor"]):  # the roles whose processes share tensors
        os.set_inheritable(out, False)
        shared_memory_manager()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["peer", *request["args"]]  # runpy puts peer/__main__.py's path in front
    sys.path[0] = request["cwd"]  # as `python -m` has it
    runpy.run_module("peer", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
