"""The DHT side of an invite-only swarm: hivemind's DHT authorizer made from an invite, and revocations.

``DHT(authorizer=...)`` wraps the DHT's RPCs (ping, store, find) with hivemind.utils.auth.AuthRPCWrapper,
which signs every request and response and has the other side check them. :class:`InviteAuthorizer` makes
the access token from the invite, so a node refuses requests whose token is not signed by an invite of the
run's owner and ignores responses from such nodes: an uninvited peer can neither read nor write any record of
the run (progress, metrics, config, members). swarm.net.node.start_node installs it; the averagers' side is
swarm/net/fence.py.

The owner revokes invites by name (``swarm-peer revoke``): a list signed with the owner's key, stored in the
DHT, which :class:`RevocationWatcher` of every peer reads every few seconds.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from swarm.net.invite import Certificate, Invite, InviteError, refusal, revoked_names
from swarm.net.metrics import revocation_records, revoked_key

log = logging.getLogger(__name__)


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
    """Signs and checks the DHT's requests and responses with access tokens made from an invite.

    The protocol is hivemind's TokenAuthorizerBase (hivemind/utils/auth.py): each request carries the
    sender's access token, the time, a nonce and a signature over the whole request, and each response the
    responder's token and signature and the request's nonce. What differs:

    - The token holds the invite's certificate (``username``), a key this node made for itself
      (``public_key``) and the invite's expiry, and is signed with the invite's private key. It is valid if
      the certificate is the run owner's, for this run, unexpired and not revoked, and its signature is the
      invite holder's.
    - Requests and responses are signed with Ed25519, not RSA-2048: a store among 3 nodes took 19 ms of the
      DHT processes' CPU with RSA signatures and repeated certificate checks, against 4 ms unfenced.
    - A token's signatures are verified once, then remembered; expiry and revocation are checked each time.
    """

    MAX_CLOCK_SKEW = 60.0  # seconds; hivemind's _MAX_CLIENT_SERVICER_TIME_DIFF

    def __init__(self, invite: Invite, revoked: frozenset[str] = frozenset()) -> None:
        self.invite, self.revoked = invite, set(revoked)
        self._key = Ed25519PrivateKey.generate()
        cert = invite.certificate
        self.token = AccessToken(
            username=cert.to_text(),
            public_key=self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
            expiration_time=repr(cert.expires),
        )
        self.token.signature = invite.sign(_token_bytes(self.token))
        self._verdicts: dict[bytes, tuple[str | None, Certificate | None, Ed25519PublicKey | None]] = {}
        self._nonces = TimedStorage()
        self._warned: set[bytes] = set()

    def _verdict(self, token: AccessToken) -> tuple[str | None, Ed25519PublicKey | None]:
        """(None, the sender's key) if ``token`` admits its sender, else (why not, None)."""
        key = token.SerializeToString()
        if key not in self._verdicts:
            if len(self._verdicts) >= 4096:  # one token per node; a flood of forged ones must not grow this
                self._verdicts.pop(next(iter(self._verdicts)))
            self._verdicts[key] = self._judge(token)
        problem, cert, sender = self._verdicts[key]
        if problem is None and cert is not None:  # expiry and revocation may change after the first check
            if cert.expires <= time.time():
                problem = f"its invite {cert.name!r} expired"
            elif cert.name in self.revoked:
                problem = f"its invite {cert.name!r} was revoked by the owner"
        return problem, (sender if problem is None else None)

    def _judge(self, token: AccessToken) -> tuple[str | None, Certificate | None, Ed25519PublicKey | None]:
        if not token.username:
            return "it shows no invite", None, None
        try:
            cert = Certificate.from_text(token.username)
            sender = Ed25519PublicKey.from_public_bytes(token.public_key)
        except (InviteError, ValueError):
            return "its invite is malformed", None, None
        problem = cert.problem(self.invite.owner_key, self.invite.run_id, time.time())
        if problem is None and not cert.verify_by_holder(_token_bytes(token), token.signature):
            problem = "its access token is not signed by the invite's holder"
        return problem, cert, sender

    def _refuse(self, token: AccessToken, problem: str, what: str) -> bool:
        sender = token.public_key or b"anonymous"
        if sender not in self._warned:
            self._warned.add(sender)
            log.warning("Refused a DHT %s: %s", what, refusal(self.invite.run_id, "a peer", problem))
        return False

    @staticmethod
    def _signed_by(message: Any, auth: Any, sender: Ed25519PublicKey) -> bool:
        signature, auth.signature = auth.signature, b""
        try:
            sender.verify(signature, message.SerializeToString())
            return True
        except InvalidSignature:
            return False

    async def sign_request(self, request: Any, service_public_key: Any) -> None:
        auth = request.auth
        auth.client_access_token.CopyFrom(self.token)
        if service_public_key is not None:
            auth.service_public_key = service_public_key.to_bytes()
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(8)
        auth.signature = self._key.sign(request.SerializeToString())

    async def validate_request(self, request: Any) -> bool:
        auth = request.auth
        problem, sender = self._verdict(auth.client_access_token)
        if sender is None:
            return self._refuse(auth.client_access_token, problem or "", "request")
        if not self._signed_by(request, auth, sender):
            return self._refuse(auth.client_access_token, "its request's signature is invalid", "request")
        now = get_dht_time()
        with self._nonces.freeze():
            if abs(auth.time - now) > self.MAX_CLOCK_SKEW or auth.nonce in self._nonces:
                log.debug("A DHT request was replayed, or the clocks differ by more than a minute")
                return False
        self._nonces.store(auth.nonce, None, now + 3 * self.MAX_CLOCK_SKEW)
        return True

    async def sign_response(self, response: Any, request: Any) -> None:
        auth = response.auth
        auth.service_access_token.CopyFrom(self.token)
        auth.nonce = request.auth.nonce
        auth.signature = self._key.sign(response.SerializeToString())

    async def validate_response(self, response: Any, request: Any) -> bool:
        auth = response.auth
        problem, sender = self._verdict(auth.service_access_token)
        if sender is None:
            return self._refuse(auth.service_access_token, problem or "", "response")
        return self._signed_by(response, auth, sender) and auth.nonce == request.auth.nonce


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
