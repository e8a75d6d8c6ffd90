"""The DHT process (hivemind/dht/dht.py): requests from processes that exit while they are read.

**What hivemind does.** ``DHT.run`` (dht.py:89-140) serves requests from its pipe; every request carries the
pipe for its reply, handed over through the *sender's* resource-sharer thread. It catches ``OSError``,
``ConnectionError`` and ``RuntimeError`` while it reads one, logs them with a traceback and sleeps
``wait_timeout`` (dht.py:127-132).

**What goes wrong.** If the sender (an averager process at shutdown) exits between sending and the DHT's read,
unpickling raises ``EOFError``, which hivemind does not catch: the DHT process dies with a traceback. A reset
or refused connection costs a logged traceback and a 3 s pause.

**What this changes.** :class:`SwarmDHT` reads its pipe through :class:`RequestPipe`, which skips such a
request (nobody waits for its answer). It is a subclass, used wherever swarm/net/node.py starts a DHT; nothing
is replaced in the process that starts it. In its own process it also installs swarm/patches/auth.py's RPC
wrapper.
"""

from __future__ import annotations

import logging
from multiprocessing.reduction import ForkingPickler
from typing import Any

import hivemind

log = logging.getLogger(__name__)


class RequestPipe:
    """The DHT process's end of its request pipe, tolerant of senders that exit mid-request."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def recv(self) -> Any:
        data = self._conn.recv_bytes()  # EOFError here means our own pipe closed: let hivemind see it
        try:
            return ForkingPickler.loads(data)
        except (EOFError, OSError):  # reset, refused or closed: the sender's resource sharer is gone
            log.debug("Skipped a DHT request whose sender exited before it was read")
            return ("_skip_request", [], {})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class SwarmDHT(hivemind.DHT):
    """hivemind.DHT whose background process survives requests from processes that exited meanwhile, and
    whose RPCs bind access tokens to PeerIDs (swarm/patches/auth.py)."""

    def run(self) -> None:
        from swarm.patches import auth

        auth.install_in_dht_process()  # this process's DHT RPCs check tokens against the channel's PeerID
        self._inner_pipe = RequestPipe(self._inner_pipe)
        super().run()

    async def _skip_request(self) -> None:
        return None
