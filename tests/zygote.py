"""A process that has imported the peer's modules once and forks a `python -m peer ...` process per request.

A fresh `python -m peer join` spends 5-6 CPU seconds importing torch, Lightning (with torchmetrics,
torchvision and, through them, ``torch._dynamo``), timm and hivemind before it does anything; the suite starts
about fifty peers. A test's peer forked from here is a process of its own that runs the same
``peer.cli.main`` with its own arguments, environment, working directory, process group (a new session, as
:func:`swarm.procs.start_group` makes) and output pipe; only the imports are shared. Tests of the start itself
(the CLI's errors, torchrun, the demo's own launcher) still start fresh interpreters.

Protocol, over one SOCK_SEQPACKET socket from the test process (``tests/helpers.py``, ``Zygote``):
- request: a pickled ``{"args", "env", "cwd"}`` (``args``: what follows ``python -m peer``), with the
  write end of the output pipe attached (SCM_RIGHTS);
- answers: pickled ``("pid", pid)`` for each request, in order, and ``("exit", pid, wait_status)`` when a
  forked process ends (this process is its parent and reaps it at once).

The file is run by path, not as ``tests.zygote``: importing pytest would change what the CLI does when it
exits (peer/cli.py, ``_exit_quietly``).
"""

from __future__ import annotations

import os
import pickle
import runpy
import select
import socket
import sys

PRELOAD = ("peer.cli", "peer.volunteer", "monitor.role", "peer.evaluate")


def main(fd: int) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    request = serve(sock)
    if request is not None:  # in a forked child: become the peer; its exit ends this process as usual
        run_peer(*request)


def serve(sock: socket.socket) -> tuple[dict, int] | None:
    """Answer requests until the test process closes its end; returns a request in a forked child."""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        reap(sock, children)
        if not readable:
            continue
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
        if not message:  # the test process has gone: the peers it started are its to stop
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
            sock.send(pickle.dumps(("exit", pid, status)))


def fresh_process_locks() -> None:
    """Give this forked peer the process-wide locks that a fresh interpreter creates when it imports hivemind.

    hivemind makes them at import (``multiprocessing.Lock``, a semaphore in shared memory): ``MPFuture``'s
    initialisation and pipe-update locks, ``SharedBytes``' lock (utils/mpfuture.py:40, 82-83) and the async
    context executor's lock (utils/asyncio.py:171). Inherited from the zygote, one lock would be shared by
    every peer it forks: a peer killed while holding it (SIGKILL in a fault test) would leave the next
    peer's DHT process waiting for it forever, in ``MPFuture._send_update``. ``reset_backend`` is hivemind's
    own way to renew the first three."""
    import multiprocessing as mp

    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()
    _AsyncContextWrapper.EXECUTOR_LOCK = mp.Lock()


def run_peer(request: dict, out: int) -> None:
    os.setsid()
    fresh_process_locks()
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
