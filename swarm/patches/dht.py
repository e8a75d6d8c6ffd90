"""The DHT process (hivemind/dht/dht.py): requests from processes that exit while they are read, and the
reply pipe that every request carries.

**What hivemind does.** ``DHT.run`` (dht.py:89-140) serves requests from its pipe; every request carries the
pipe for its reply, handed over through the *sender's* resource-sharer thread. It catches ``OSError``,
``ConnectionError`` and ``RuntimeError`` while it reads one, logs them with a traceback and sleeps
``wait_timeout`` (dht.py:127-132).

**What goes wrong.** If the sender (an averager process at shutdown) exits between sending and the DHT's read,
unpickling raises ``EOFError``, which hivemind does not catch: the DHT process dies with a traceback. A reset
or refused connection costs a logged traceback and a 3 s pause.

Handing that reply pipe over was about half of the CPU that a request to a lone node cost both processes:
the sender duplicates its pipe's descriptor and registers it with its resource sharer, and the DHT process
connects to that sharer's socket, receives the descriptor and builds a new connection, for every request, and
closes it once it has answered (``multiprocessing.resource_sharer``, ``connection.rebuild_connection``).

**What this changes.** :class:`SwarmDHT` reads its pipe through :class:`RequestPipe`, which skips such a
request (nobody waits for its answer). Its requests are written by :class:`RequestSender`, which hands a
process's reply pipe over once: its first request carries the pipe, later ones only name it, and
:class:`RequestPipe` keeps the pipes it received, one per sending process. It is a subclass, used wherever
swarm/net/node.py starts a DHT; nothing is replaced in the process that starts it. In its own process it also
installs swarm/patches/auth.py's RPC wrapper and swarm/patches/dht_store.py's stores without a search.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import hivemind
from hivemind.utils.mpfuture import MPFuture

log = logging.getLogger(__name__)


REPLY_PIPE = "swarm-reply-pipe"  # the persistent id under which a request names its sender's reply pipe
KEPT_PIPES = 32  # above this many kept reply pipes, those of processes that ended are closed


class _ReplyPipePickler(ForkingPickler):
    """Pickles a request; this process's reply pipe (hivemind's ``MPFuture._global_sender_pipe``) goes as a
    name, with the pipe itself attached the first time."""

    def __init__(self, buffer: io.BytesIO, told: dict[tuple[int, int], Connection]) -> None:
        super().__init__(buffer, pickle.HIGHEST_PROTOCOL)
        self.told, self.fresh, self.carrying = told, {}, None

    def persistent_id(self, obj: Any) -> Any:
        if obj is self.carrying:  # the pipe inside its own first name: pickled as multiprocessing does
            self.carrying = None
            return None
        if not isinstance(obj, Connection) or obj is not MPFuture._global_sender_pipe:
            return None
        key = (os.getpid(), id(obj))
        if key in self.told:
            return (REPLY_PIPE, key)
        self.fresh[key] = obj
        self.carrying = obj
        return (REPLY_PIPE, key, obj)


class RequestSender:
    """The requesting end of a DHT's request pipe: hands each process's reply pipe over once.

    A pipe counts as handed over once a request that carried it was written whole; the request pipe keeps
    order, so every later request that only names it is read after it. (Two threads that write their first
    requests at once both attach it.) A forked process has a reply pipe of its own, under its own PID. The
    pipes named are held here, so that no later pipe of this process takes the same ``id``."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._told: dict[tuple[int, int], Connection] = {}

    def send(self, obj: Any) -> None:
        buffer = io.BytesIO()
        pickler = _ReplyPipePickler(buffer, self._told)
        pickler.dump(obj)
        self._conn.send_bytes(buffer.getbuffer())
        self._told.update(pickler.fresh)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _RequestUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, pipes: dict[tuple[int, int], Any]) -> None:
        super().__init__(io.BytesIO(data))
        self.pipes = pipes

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == REPLY_PIPE):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        if len(pid) == 3:
            self.pipes[pid[1]] = pid[2]
            return pid[2]
        try:
            return self.pipes[pid[1]]
        except KeyError:  # its first request was skipped: only if that sender's resource sharer had gone
            raise OSError(f"a request named the reply pipe of process {pid[1][0]}, never received") from None


class RequestPipe:
    """The DHT process's end of its request pipe, tolerant of senders that exit mid-request; keeps the reply
    pipes that :class:`RequestSender` hands over once."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.pipes: dict[tuple[int, int], Any] = {}

    def recv(self) -> Any:
        data = self._conn.recv_bytes()  # EOFError here means our own pipe closed: let hivemind see it
        try:
            request = _RequestUnpickler(data, self.pipes).load()
        except (EOFError, OSError) as e:  # reset, refused or closed: the sender's resource sharer is gone
            log.debug("Skipped a DHT request whose sender exited before it was read (%s)", e)
            return ("_skip_request", [], {})
        if len(self.pipes) > KEPT_PIPES:
            self._close_pipes_of_ended_processes()
        return request

    def _close_pipes_of_ended_processes(self) -> None:
        for key in list(self.pipes):
            try:
                os.kill(key[0], 0)
            except ProcessLookupError:
                self.pipes.pop(key).close()
            except PermissionError:
                pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class SwarmDHT(hivemind.DHT):
    """hivemind.DHT whose background process survives requests from processes that exited meanwhile, and
    whose RPCs bind access tokens to PeerIDs (swarm/patches/auth.py), and whose requests hand each process's
    reply pipe over once."""

    narrow_reads = True
    """Reads in a small swarm ask the nodes nearest the key, and push no copy (swarm/patches/dht_store.py);
    False gives hivemind's reads (the ``dht`` bench's baseline)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # no copy of what a read found pushed to another node (swarm/patches/dht_store.py)
        kwargs.setdefault("cache_nearest", 0 if self.narrow_reads else 1)
        super().__init__(*args, **kwargs)
        # the DHT process (started above, or later by run_in_background) reads the other end, _inner_pipe
        self._outer_pipe = RequestSender(self._outer_pipe)

    def run(self) -> None:
        from swarm.patches import auth, dht_store

        auth.install_in_dht_process()  # this process's DHT RPCs check tokens against the channel's PeerID
        # a store in a small swarm goes to the known nodes, unsearched; a read asks the nodes nearest its key
        dht_store.install_in_dht_process(reads=self.narrow_reads)
        self._inner_pipe = RequestPipe(self._inner_pipe)
        super().run()

    async def _skip_request(self) -> None:
        return None
