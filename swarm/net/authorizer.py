"""The DHT side of an invite-only swarm: hivemind's DHT authorizer made from an invite, and revocations.

``DHT(authorizer=...)`` wraps the DHT's RPCs (ping, store, find) so that every request and response carries an
access token that the other side checks. :class:`InviteAuthorizer` makes the token from the invite and binds
it to this node's PeerID (through swarm/patches/auth.py's wrapper, which every node's DHT process uses), so a
node refuses requests whose token is not signed by an invite of the run's owner for the PeerID that sent
them, and ignores such responses: an uninvited peer can neither read nor write any record of the run
(progress, metrics, config, members). swarm.net.node.start_node installs it; the averagers' side is
swarm/net/fence.py.

The owner revokes invites by name (``swarm-peer revoke``): a list signed with the owner's key, stored in the
DHT, which :class:`RevocationWatcher` of every peer reads every few seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import AuthorizerBase

from swarm.net.invite import Certificate, Invite, InviteError, refusal, revoked_names
from swarm.net.metrics import revocation_records, revoked_key

log = logging.getLogger(__name__)
_ED25519_KEY_BYTES = 32  # a raw Ed25519 public key; a PeerID's bytes (a multihash) are longer
_WARN_AT_MOST = 4096  # refused senders that get a warning line of their own


def _token_bytes(token: AccessToken) -> bytes:
    return (
        b"swarm-trainer token|"
        + token.username.encode()
        + b"|"
        + token.public_key
        + b"|"
        + token.expiration_time.encode()
    )


class InviteAuthorizer(AuthorizerBase):
    """Access tokens for the DHT's requests and responses, made from an invite and bound to PeerIDs.

    A token holds the invite's certificate (``username``), the PeerID of the node that presents it
    (``public_key``) and the invite's expiry, and is signed with the invite's private key. The other side
    admits it if the certificate is the run owner's, for this run, unexpired and not revoked, the signature is
    the invite holder's, and the PeerID is the one that libp2p's secure channel authenticated for the message
    (swarm/patches/auth.py hands it over). So no message needs a signature of its own: a copied token names a
    PeerID that only its holder can speak as. (hivemind's ``TokenAuthorizerBase`` signs and checks every
    request and response instead; with Ed25519 that was 14 % of a demo peer's DHT process.)

    A token's signature is verified once, then remembered; expiry and revocation are checked each time.
    """

    binds_peer_ids = True  # swarm/patches/auth.py: present() and admits() replace the per-message methods

    def __init__(self, invite: Invite, revoked: frozenset[str] = frozenset()) -> None:
        self.invite, self.revoked = invite, set(revoked)
        self._tokens: dict[bytes, AccessToken] = {}
        self._verdicts: dict[bytes, tuple[str | None, Certificate | None]] = {}
        self._warned: set[bytes] = set()

    def token(self, peer_id: Any) -> AccessToken:
        """This node's token for its PeerID ``peer_id`` (made and signed once)."""
        key = peer_id.to_bytes()
        if key not in self._tokens:
            cert = self.invite.certificate
            token = AccessToken(username=cert.to_text(), public_key=key, expiration_time=repr(cert.expires))
            token.signature = self.invite.sign(_token_bytes(token))
            self._tokens[key] = token
        return self._tokens[key]

    def present(self, field: AccessToken, peer_id: Any) -> None:
        """Put this node's token for ``peer_id`` (its own PeerID) into a message's token ``field``."""
        field.CopyFrom(self.token(peer_id))

    def admits(self, token: AccessToken, peer_id: Any, what: str) -> bool:
        """Whether ``token`` admits the peer that the channel authenticated as ``peer_id``; ``what`` (request
        or response) names the message in the one warning logged per refused peer."""
        problem = self._problem(token)
        if problem is None and len(token.public_key) == _ED25519_KEY_BYTES:  # what tokens held before PeerIDs
            problem = (
                "it runs an older swarm trainer, whose access tokens name no PeerID: every peer of an "
                "invite-only swarm needs a release that binds them (upgrade it)"
            )
        elif problem is None and token.public_key != peer_id.to_bytes():
            problem = "its access token was made for another peer"
        if problem is None:
            return True
        sender = token.public_key or b"anonymous"
        if sender not in self._warned and len(self._warned) < _WARN_AT_MOST:  # a flood must not grow it
            self._warned.add(sender)
            log.warning("Refused a DHT %s: %s", what, refusal(self.invite.run_id, "a peer", problem))
        return False

    def _problem(self, token: AccessToken) -> str | None:
        """None if ``token`` is a valid, unexpired, unrevoked token of the run, else why not."""
        key = token.SerializeToString()
        if key not in self._verdicts:
            if len(self._verdicts) >= 4096:  # one token per node; a flood of forged ones must not grow this
                self._verdicts.pop(next(iter(self._verdicts)))
            self._verdicts[key] = self._judge(token)
        problem, cert = self._verdicts[key]
        if problem is None and cert is not None:  # expiry and revocation may change after the first check
            if cert.expires <= time.time():
                problem = f"its invite {cert.name!r} expired"
            elif cert.name in self.revoked:
                problem = f"its invite {cert.name!r} was revoked by the owner"
        return problem

    def _judge(self, token: AccessToken) -> tuple[str | None, Certificate | None]:
        if not token.username:
            return "it shows no invite", None
        try:
            cert = Certificate.from_text(token.username)
        except (InviteError, ValueError):
            return "its invite is malformed", None
        problem = cert.problem(self.invite.owner_key, self.invite.run_id, time.time())
        if problem is None and not cert.verify_by_holder(_token_bytes(token), token.signature):
            problem = "its access token is not signed by the invite's holder"
        return problem, cert

    # hivemind's per-message interface: without swarm/patches/auth.py's wrapper the authorizer cannot see the
    # PeerIDs its tokens are bound to, so it admits nothing rather than something unchecked
    async def sign_request(self, request: Any, service_public_key: Any) -> None:
        raise RuntimeError(_NEEDS_WRAPPER)

    async def validate_request(self, request: Any) -> bool:
        log.error(_NEEDS_WRAPPER)
        return False

    async def sign_response(self, response: Any, request: Any) -> None:
        raise RuntimeError(_NEEDS_WRAPPER)

    async def validate_response(self, response: Any, request: Any) -> bool:
        log.error(_NEEDS_WRAPPER)
        return False


_NEEDS_WRAPPER = (
    "InviteAuthorizer binds tokens to PeerIDs and needs the DHT of swarm.patches.dht.SwarmDHT (which "
    "installs swarm.patches.auth's RPC wrapper); start the node with swarm.net.node.start_node"
)


async def _revoke_in_dht_process(names: set[str], dht: Any, node: Any) -> None:
    node.protocol.authorizer.revoked.update(names)


class RevocationWatcher(threading.Thread):
    """Reads the owner's revocation records every ``period`` seconds and hands new names to this node's
    DHT authorizer (in the DHT process); ``self_revoked`` is set once this peer's own invite is revoked."""

    period = 10.0

    def __init__(self, dht: Any, invite: Invite) -> None:
        super().__init__(name="swarm-revocations", daemon=True)
        self.dht, self.invite = dht, invite
        self.revoked: set[str] = set()
        self.self_revoked = threading.Event()
        self._stop_event = threading.Event()

    def run(self) -> None:
        from functools import partial

        while not self._stop_event.wait(self.period) and self.dht.is_alive():
            try:
                found = self.dht.get(revoked_key(self.invite.run_id), latest=True, return_future=True).result(
                    10
                )
                records = revocation_records(found)
                new = revoked_names(records, self.invite.owner_key, self.invite.run_id) - self.revoked
                if new:
                    self.dht.run_coroutine(partial(_revoke_in_dht_process, new))
                    self.revoked |= new
                    log.warning(
                        "The run's owner revoked the invites %s; peers that hold them are refused",
                        sorted(new),
                    )
                    if self.invite.certificate.name in new:
                        self.self_revoked.set()
            except Exception as exc:  # the next turn tries again
                log.debug("Could not read the revocations: %r", exc)

    def stop(self) -> None:
        self._stop_event.set()


def revoke(
    dht: Any, owner: Any, run_id: str, names: list[str], public_key: bytes, timeout: float = 10.0
) -> list[str]:
    """Publish a revocation record (the owner's signature over ``names`` and those revoked before); the
    names now revoked. ``dht`` must be started with an invite of ``owner``."""
    from hivemind.utils import get_dht_time

    from swarm.net.invite import sign_revocation
    from swarm.net.metrics import RevocationRecord

    found = dht.get(revoked_key(run_id), latest=True, return_future=True).result(timeout)
    records = revocation_records(found)
    owner_key = owner.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    every = sorted(revoked_names(records, owner_key, run_id) | set(names))
    record = RevocationRecord(**sign_revocation(owner, run_id, every))
    stored = dht.store(
        revoked_key(run_id),
        subkey=public_key,
        value=record.dict(),
        expiration_time=get_dht_time() + 30 * 86400,
        return_future=True,
    ).result(timeout)
    if not stored:
        raise InviteError(f"no peer of run {run_id!r} took the revocation; check --initial-peers")
    return every
