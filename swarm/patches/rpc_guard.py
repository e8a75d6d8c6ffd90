"""The averagers' RPCs (hivemind/averaging/averager.py and hivemind/p2p/servicer.py): who may call, and be
called.

**What hivemind does.** ``DHT(authorizer=...)`` guards the DHT's RPCs only. The averagers' handlers
(``rpc_join_group``, ``rpc_aggregate_part``, ``rpc_download_state``) are registered by
``ServicerBase.add_p2p_handlers`` (p2p/servicer.py:107-140) with no authorizer, and an averager calls other
peers through the stubs of ``ServicerBase.get_stub`` (p2p/servicer.py:142-160). Each handler receives the
caller's PeerID, which libp2p's secure channel authenticates (``P2PContext.remote_id``). A handler's exception
is logged by the p2p daemon with its traceback (p2p_daemon.py:446, ``_process_stream``).

**What goes wrong.** In an invite-only swarm, anyone who knows a peer's address could join its averaging
groups, send it parts, or download its state.

**What this changes.** :func:`guard` registers a *gate* for one DHT (an object with an async
``check(peer_id, dht, role)`` that raises :class:`Refused`); every averager built on that DHT afterwards
serves only callers that pass the gate, and calls only peers that pass it. A refusal is logged by the gate
(once per peer), not by hivemind with a traceback. swarm/net/fence.py is the gate of an invite-only swarm.
Every averager also refuses, and does not call, the groupmates that its peer banned
(swarm/suspects.py, kept by swarm/patches/robust.py), in open and invite-only swarms alike: that
keeps a banned peer out of this peer's groups and keeps this peer from downloading its state. A peer banned
in the middle of a round is dropped from that round's senders as its parts are refused
(swarm/patches/allreduce.py ``drop_sender``), or the reducer would wait ``sender_timeout`` for them; and this
peer still sends its own parts to a banned groupmate's reducer in a round already formed
(:func:`sending_to_banned`), or that reducer would wait for them, and every groupmate for its slice.
"""

from __future__ import annotations

import contextvars
import logging
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError

from swarm.patches import allreduce, robust
from swarm.patches._registry import Patch
from swarm.suspects import why_banned

log = logging.getLogger(__name__)
_GATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DHT -> gate; forked into each averager
_PROCESS: tuple[Any, Any] | None = None  # (gate, DHT) in the process of an averager built on a guarded DHT
_TO_BANNED = contextvars.ContextVar("swarm_sending_to_banned", default=False)


class Refused(P2PHandlerError, PermissionError):
    """A gate refused a peer (the caller of a handler, or the peer an averager was about to call)."""


def guard(dht: Any, gate: Any) -> None:
    """Averagers built on ``dht`` from now on serve and call only peers that ``gate`` admits. Needs
    :func:`install` (swarm.patches.install) before those averagers start."""
    _GATES[dht] = gate


def unguard(dht: Any) -> None:
    _GATES.pop(dht, None)


class Banned(Refused):
    """This peer banned the other for a while (swarm/suspects.py)."""


BANNED_BY_THIS_PEER = "is banned by this peer"  # in every refusal of a banned caller, as its caller reads it


def refused_as_banned(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a call to another peer's handler, says that the other peer refused this one
    because it bans it (its :class:`Banned`, which reaches the caller as the text of a P2PHandlerError)."""
    return isinstance(exc, P2PHandlerError) and BANNED_BY_THIS_PEER in str(exc)


def banned_here(peer_id: Any) -> bool:
    """Whether this peer has banned ``peer_id`` (in any process that shares its suspects table)."""
    table = robust.suspects()
    return table is not None and table.banned_for(str(peer_id)) > 0


@contextmanager
def sending_to_banned() -> Iterator[None]:
    """Within the block (the task that runs it, and what it awaits), this peer's ban does not stop a call to
    a peer it banned; an invite-only swarm's gate still does. For this peer's parts of a round, sent to a
    banned groupmate's reducer (swarm/patches/allreduce.py)."""
    token = _TO_BANNED.set(True)
    try:
        yield
    finally:
        _TO_BANNED.reset(token)


class _Banning:
    """The gate of an averager process: refuses the peers that this peer banned, then asks ``gate`` (an
    invite-only swarm's; None in an open swarm)."""

    def __init__(self, gate: Any, suspects: Any) -> None:
        self._gate, self._suspects = gate, suspects
        self._warned: set[tuple[str, int]] = set()

    async def check(self, peer_id: Any, dht: Any, role: str) -> None:
        text = str(peer_id)
        found = None if _TO_BANNED.get() else self._suspects.get(text)
        if found is not None and found.banned_for > 0:
            why = f"peer {text} {BANNED_BY_THIS_PEER}: {why_banned(found)}"
            if (text, found.bans) not in self._warned:  # once per ban
                self._warned.add((text, found.bans))
                log.warning("Refused %s: %s", role, why)
            raise Banned(why)
        if self._gate is not None:
            await self._gate.check(peer_id, dht, role)


class _GuardedHandlers:
    """What ServicerBase.add_p2p_handlers serves instead of the averager: each rpc_ handler (all of the
    averagers' handlers stream their replies) first checks the caller's PeerID."""

    def __init__(self, averager: Any, gate: Any, dht: Any) -> None:
        self._averager, self._gate, self._dht = averager, gate, dht

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._averager, name)

        async def guarded(request: Any, context: Any) -> Any:
            try:
                await self._gate.check(context.remote_id, self._dht, f"a {name} request")
            except Banned:
                if name == "rpc_aggregate_part":  # banned during a round whose group counts on its parts
                    await allreduce.drop_sender(self._averager, context.remote_id)
                raise
            async for message in method(request, context):
                yield message

        return guarded


class _GuardedStub:
    """An averager's stub to another peer that first checks that the gate admits the peer."""

    def __init__(self, stub: Any, peer: Any, gate: Any, dht: Any) -> None:
        self._stub, self._peer, self._gate, self._dht = stub, peer, gate, dht

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if not name.startswith("rpc_"):
            return method

        async def guarded(*args: Any, **kwargs: Any) -> Any:
            await self._gate.check(self._peer, self._dht, f"to call {name} of another peer")
            return await method(*args, **kwargs)

        return guarded


class _QuietRefusals(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], Refused))


_FILTER = _QuietRefusals()


def _targets() -> list[tuple[Any, str, Any]]:
    from hivemind.averaging.averager import DecentralizedAverager as Averager

    run, add_handlers, get_stub = Averager.run, Averager.add_p2p_handlers, Averager.get_stub.__func__

    def guarded_run(self: Any) -> None:
        global _PROCESS
        gate, suspects = _GATES.get(self.dht), robust.suspects()
        if suspects is not None:
            gate = _Banning(gate, suspects)
        if gate is not None:
            _PROCESS = (gate, self.dht)
        run(self)

    async def guarded_add_handlers(self: Any, p2p: Any, wrapper: Any = None, **kwargs: Any) -> None:
        if wrapper is None and _PROCESS is not None:
            wrapper = _GuardedHandlers(self, *_PROCESS)
        await add_handlers(self, p2p, wrapper, **kwargs)

    def guarded_get_stub(cls: type, p2p: Any, peer: Any, **kwargs: Any) -> Any:
        stub = get_stub(cls, p2p, peer, **kwargs)
        return stub if _PROCESS is None else _GuardedStub(stub, peer, *_PROCESS)

    # hivemind logs each handler's exception with its traceback (p2p_daemon.py, _process_stream); a refusal
    # is logged once per peer by the gate instead
    logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_FILTER)
    return [
        (Averager, "run", guarded_run),
        (Averager, "add_p2p_handlers", guarded_add_handlers),
        (Averager, "get_stub", classmethod(guarded_get_stub)),
    ]


PATCH = Patch("rpc_guard", _targets)
