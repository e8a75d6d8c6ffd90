"""The DHT's RPC authorization (hivemind/utils/auth.py, dht/protocol.py): tokens bound to the channel's
PeerID.

**What hivemind does.** ``DHTProtocol`` wraps its RPCs (ping, store, find) in ``AuthRPCWrapper``
(utils/auth.py:168-204; dht/protocol.py:75 and 92-95), which hands the authorizer the request or the response
alone: ``sign_request(request, service_public_key)``, ``validate_request(request)``, and the same for
responses. The authorizer never learns which peer a message came from, so hivemind's own
``TokenAuthorizerBase`` (utils/auth.py:46-165) proves each message by a signature with the sender's key
(RSA), with a nonce and the time against replays.

**What goes wrong.** Every DHT request and response is signed by one process and verified by another: four
public-key operations per RPC, for messages that libp2p has already authenticated. The p2p daemon's secure
channel (TLS or Noise) proves the remote PeerID of every stream and unary call (``P2PContext.remote_id``,
p2p/p2p_daemon.py:582-590), which is what the averagers' fence relies on (swarm/net/fence.py). With
Ed25519, the signatures and checks were 14 % of a demo peer's DHT process and the authorizer's wrappers 30 %;
an invite-only demo spent 37 % more helper CPU than an open one.

**What this changes.** :class:`PeerBoundRPCWrapper` replaces ``AuthRPCWrapper`` in dht/protocol.py inside the
DHT process (:func:`install_in_dht_process`, called by ``swarm.patches.dht.SwarmDHT.run``). For an authorizer
that declares ``binds_peer_ids`` (swarm/net/authorizer.py's ``InviteAuthorizer``) it attaches this node's
token, made for its own PeerID, to each request and response, and has the authorizer check the other side's
token against the PeerID the channel authenticated: the caller's (``context.remote_id``) for a request, the
peer called (the stub's) for a response. Nothing is signed per message; a token copied from a message is of
no use to another peer, which cannot speak as the PeerID it names. Any other authorizer gets hivemind's
``AuthRPCWrapper`` behaviour unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from hivemind.utils.auth import AuthRole, AuthRPCWrapper


class PeerBoundRPCWrapper(AuthRPCWrapper):
    """``AuthRPCWrapper`` that gives a ``binds_peer_ids`` authorizer the PeerIDs of both ends of each RPC."""

    def __getattribute__(self, name: str) -> Any:
        authorizer = object.__getattribute__(self, "_authorizer")
        if not name.startswith("rpc_") or not getattr(authorizer, "binds_peer_ids", False):
            return super().__getattribute__(name)
        stub = object.__getattribute__(self, "_stub")
        role = object.__getattribute__(self, "_role")
        method = getattr(stub, name)

        @functools.wraps(method)
        async def wrapped_rpc(request: Any, *args: Any, **kwargs: Any) -> Any:
            if role == AuthRole.SERVICER:
                context = args[0] if args else kwargs["context"]
                if not authorizer.admits(request.auth.client_access_token, context.remote_id, "request"):
                    return None
                response = await method(request, *args, **kwargs)
                authorizer.present(response.auth.service_access_token, context.local_id)
                return response
            authorizer.present(request.auth.client_access_token, stub._p2p.peer_id)
            response = await method(request, *args, **kwargs)
            if not authorizer.admits(response.auth.service_access_token, stub._peer, "response"):
                return None
            return response

        return wrapped_rpc


def install_in_dht_process() -> None:
    """Make dht/protocol.py wrap its RPCs with :class:`PeerBoundRPCWrapper`. Call it in the DHT's own process
    (it replaces a name of hivemind's module there, for the life of that process)."""
    import hivemind.dht.protocol

    hivemind.dht.protocol.AuthRPCWrapper = PeerBoundRPCWrapper
