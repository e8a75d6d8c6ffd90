"""What swarm/patches/auth.py changes: a DHT authorizer learns the PeerIDs of both ends of each RPC.

Two DHT nodes with a recording authorizer store and read a record. On plain hivemind (``hivemind.DHT``, whose
RPCs ``AuthRPCWrapper`` wraps) the authorizer is handed each message alone, so it has to sign every request
and response and check every signature. On the DHT of a swarm node (``SwarmDHT``) an authorizer that binds
its tokens to PeerIDs is handed the PeerID that libp2p's secure channel authenticated (the caller's for a
request, the peer called for a response) and its own, and nothing is signed per message."""

from __future__ import annotations

import multiprocessing as mp
import time
from contextlib import ExitStack

import hivemind
from hivemind.utils import get_dht_time
from hivemind.utils.auth import AuthorizerBase

from swarm.patches.dht import SwarmDHT
from swarm.procs import remove_stale_sockets
from tests.patches.common import PLAIN_OR_PATCHED


class Recording(AuthorizerBase):
    """Admits everything and puts every call it gets, with the PeerID it was handed, into ``calls``."""

    binds_peer_ids = True

    def __init__(self, node: str, calls) -> None:
        self.node, self.calls = node, calls

    def _record(self, call: str, peer_id=None) -> None:
        self.calls.put((self.node, call, None if peer_id is None else peer_id.to_base58()))

    async def sign_request(self, request, service_public_key) -> None:
        self._record("sign_request")

    async def validate_request(self, request) -> bool:
        self._record("validate_request")
        return True

    async def sign_response(self, response, request) -> None:
        self._record("sign_response")

    async def validate_response(self, response, request) -> bool:
        self._record("validate_response")
        return True

    def present(self, field, peer_id) -> None:
        field.username = self.node
        self._record("present", peer_id)

    def admits(self, token, peer_id, what: str) -> bool:
        self._record(f"admits a {what} from {token.username}", peer_id)
        return True


@PLAIN_OR_PATCHED
def test_the_authorizer_is_handed_the_peer_ids_the_channel_authenticated(patched):
    calls = mp.get_context("fork").Queue()
    kind = SwarmDHT if patched else hivemind.DHT
    started = time.time()
    with ExitStack() as stack:
        a = kind(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], authorizer=Recording("a", calls))
        stack.callback(a.shutdown)
        b = kind(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], authorizer=Recording("b", calls),
                 initial_peers=[str(m) for m in a.get_visible_maddrs()])  # fmt: skip
        stack.callback(b.shutdown)
        a_id, b_id = a.peer_id.to_base58(), b.peer_id.to_base58()
        assert b.store("key", "value", expiration_time=get_dht_time() + 60)
        assert a.get("key", latest=True).value == "value"
        if patched:
            wanted = {("a", "admits a request from b", b_id), ("b", "admits a response from a", a_id),
                      ("b", "present", b_id), ("a", "present", a_id)}  # fmt: skip
        else:
            wanted = {("b", "sign_request", None), ("a", "validate_request", None),
                      ("a", "sign_response", None), ("b", "validate_response", None)}  # fmt: skip
        seen = set()
        while not wanted <= seen:  # the DHT processes' queue feeders write a moment after each call
            seen.add(calls.get(timeout=10))
        while not calls.empty():
            seen.add(calls.get(timeout=10))
    remove_stale_sockets(since=started, exclude_own=True, settle=1.0)

    if not patched:  # every message signed and checked, no PeerID anywhere
        assert {peer for _, _, peer in seen} == {None}
        return
    # b's request to a: b's PeerID, from the channel; a's answer: the peer b called; each presents its own
    assert {call for _, call, _ in seen if not call.startswith(("present", "admits"))} == set()
    assert {peer for _, _, peer in seen} == {a_id, b_id}
