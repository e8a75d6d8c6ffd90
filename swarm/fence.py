"""The fence of an invite-only swarm: every entry point admits only peers with an invite of the run's owner.

hivemind 1.1.12 has two kinds of entry point, fenced in two ways:

- **The DHT's RPCs** (ping, store, find) take an authorizer: ``DHT(authorizer=...)`` wraps them with
  hivemind.utils.auth.AuthRPCWrapper, which signs every request and response with the node's RSA key and
  the access token that :class:`InviteAuthorizer` makes from the invite. A node refuses requests whose
  token is not signed by an invite of the run's owner, and ignores responses from such nodes, so an
  uninvited peer can neither read nor write any record of the run (progress, metrics, config, members).
- **The averagers' RPCs** (``rpc_join_group``, ``rpc_aggregate_part``, ``rpc_download_state``) have no such
  hook. Each handler receives the caller's PeerID, which libp2p's secure channel authenticates
  (``P2PContext.remote_id``). Every invited peer stores a **member record** that ties its PeerID to its
  invite (signed with the invite's key); :func:`install` wraps the handlers of every averager built on a
  fenced DHT so that they serve only PeerIDs with a valid member record, and the stubs through which it
  calls others (the leader it asks to join, its group's reducers, a state donor) so that it talks only to
  such PeerIDs.

The refusal an uninvited peer gets is one line: "... is invite-only ...". This node logs one warning per
refused peer.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import threading
import time
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from hivemind.p2p.p2p_daemon_bindings.control import P2PHandlerError
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import AuthorizerBase
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from swarm.invite import Certificate, Invite, InviteError, revoked_names
from swarm.metrics import MemberRecord, members_key, revoked_key

log = logging.getLogger(__name__)


class NotInvited(P2PHandlerError, PermissionError):
    """A peer without a valid invite asked (or was about to be asked) for something of an invite-only run."""


def _refusal(run_id: str, who: str, reason: str) -> str:
    return (
        f"run {run_id!r} is invite-only and {who} was refused: {reason}. Ask the run's owner for an invite "
        "(swarm-peer invite) and pass it with --invite"
    )


def member_bytes(run_id: str, peer_id: str) -> bytes:
    return f"swarm-trainer member|{run_id}|{peer_id}".encode()


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
            log.warning("Refused a DHT %s: %s", what, _refusal(self.invite.run_id, "a peer", problem))
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


class Fence:
    """Which PeerIDs hold an invite of this run, learnt from their member records in the DHT.

    Lives in each averager process (forked with the averager); :meth:`check` refreshes the records when it
    meets a PeerID it does not know, at most every ``refresh_period`` seconds.
    """

    refresh_period = 0.25  # seconds between two reads of the records, when a PeerID is unknown
    recheck_period = 10.0  # seconds after which a known member is checked again (revocations)

    def __init__(self, invite: Invite) -> None:
        self.run_id, self.owner_key = invite.run_id, invite.owner_key
        self.revoked: set[str] = set()
        self.members: dict[str, tuple[float, str]] = {}  # PeerID -> (invite's expiry, invite's name)
        self._last_refresh = -float("inf")
        self._lock: asyncio.Lock | None = None
        self._warned: set[str] = set()

    def admitted(self, peer_id: str) -> bool:
        expires, name = self.members.get(peer_id, (0.0, ""))
        return expires > time.time() and name not in self.revoked

    def learn(self, entries: dict) -> None:
        """Admit the PeerIDs whose member records (DHT entries of :func:`members_key`) check out."""
        for entry in entries.values():
            try:
                record = MemberRecord.parse_obj(entry.value)
                cert = Certificate.from_text(record.certificate)
            except Exception:  # a malformed record admits no one
                continue
            if cert.problem(self.owner_key, self.run_id) is not None:
                continue
            try:
                signature = base64.b64decode(record.signature, validate=True)
            except ValueError:
                continue
            if cert.verify_by_holder(member_bytes(self.run_id, record.peer_id), signature):
                self.members[record.peer_id] = (cert.expires, cert.name)

    async def refresh(self, dht: Any) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            wait = self._last_refresh + self.refresh_period - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last_refresh = time.monotonic()
            try:
                result = await dht.get(members_key(self.run_id), latest=True, return_future=True)
                revoked = await dht.get(revoked_key(self.run_id), latest=True, return_future=True)
            except Exception as exc:
                log.debug("Could not read the member records: %r", exc)
                return
            if result is not None and isinstance(result.value, dict):
                self.learn(result.value)
            if revoked is not None and isinstance(revoked.value, dict):
                records = [entry.value for entry in revoked.value.values() if isinstance(entry.value, dict)]
                self.revoked |= revoked_names(records, self.owner_key, self.run_id)

    async def check(self, peer_id: Any, dht: Any, role: str) -> None:
        """Return if ``peer_id`` holds an invite of this run; raise NotInvited otherwise."""
        text = str(peer_id)
        if self.admitted(text) and time.monotonic() - self._last_refresh < self.recheck_period:
            return
        await self.refresh(dht)
        if self.admitted(text):
            return
        reason = "it has shown no invite of this run's owner"
        expires, name = self.members.get(text, (None, ""))
        if name in self.revoked:
            reason = f"its invite {name!r} was revoked by the owner"
        elif expires is not None:
            reason = "its invite expired"
        if text not in self._warned:
            self._warned.add(text)
            log.warning("Refused %s: %s", role, _refusal(self.run_id, f"peer {text}", reason))
        raise NotInvited(_refusal(self.run_id, f"peer {text}", reason))


def publish_member(dht: Any, invite: Invite, public_key: bytes, timeout: float = 10.0) -> bool:
    """Store this peer's member record (its PeerID signed with the invite's key), valid for 10 minutes or
    until the invite expires; True if a node took it. Call it again every few minutes."""
    from hivemind.utils import get_dht_time

    peer_id = str(dht.peer_id)
    record = MemberRecord(
        peer_id=peer_id,
        certificate=invite.certificate.to_text(),
        signature=base64.b64encode(invite.sign(member_bytes(invite.run_id, peer_id))).decode(),
    )
    expiration = min(invite.certificate.expires, get_dht_time() + 600)
    future = dht.store(
        members_key(invite.run_id),
        subkey=public_key,
        value=record.dict(),
        expiration_time=expiration,
        return_future=True,
    )
    return bool(future.result(timeout=timeout))


_PROCESS: tuple[Fence, Any] | None = None  # (fence, DHT) in the process of an averager built on a fenced DHT


class _GuardedHandlers:
    """What ServicerBase.add_p2p_handlers serves instead of the averager: each rpc_ handler (all of the
    averagers' handlers stream their replies) first checks the caller's PeerID."""

    def __init__(self, averager: Any, fence: Fence, dht: Any) -> None:
        self._averager, self._fence, self._dht = averager, fence, dht

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._averager, name)

        async def guarded(request: Any, context: Any) -> Any:
            await self._fence.check(context.remote_id, self._dht, f"a {name} request")
            async for message in method(request, context):
                yield message

        return guarded


class _GuardedStub:
    """An averager's stub to another peer that first checks that the peer holds an invite."""

    def __init__(self, stub: Any, peer: Any, fence: Fence, dht: Any) -> None:
        self._stub, self._peer, self._fence, self._dht = stub, peer, fence, dht

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if not name.startswith("rpc_"):
            return method

        async def guarded(*args: Any, **kwargs: Any) -> Any:
            await self._fence.check(self._peer, self._dht, f"to call {name} of an uninvited peer")
            return await method(*args, **kwargs)

        return guarded


class _QuietRefusals(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], NotInvited))


def install() -> None:
    """Fence every averager (in its own process) whose DHT carries a ``swarm_fence``. Idempotent; call
    before the averagers start: their processes are forked with the class as it is then."""
    from hivemind.averaging.averager import DecentralizedAverager as Averager

    if getattr(Averager, "_swarm_fenced", False):
        return
    run, add_handlers, get_stub = Averager.run, Averager.add_p2p_handlers, Averager.get_stub.__func__

    def fenced_run(self: Any) -> None:
        global _PROCESS
        fence = getattr(self.dht, "swarm_fence", None)
        if fence is not None:
            _PROCESS = (fence, self.dht)
        run(self)

    async def fenced_add_handlers(self: Any, p2p: Any, wrapper: Any = None, **kwargs: Any) -> None:
        if wrapper is None and _PROCESS is not None:
            wrapper = _GuardedHandlers(self, *_PROCESS)
        await add_handlers(self, p2p, wrapper, **kwargs)

    def fenced_get_stub(cls: type, p2p: Any, peer: Any, **kwargs: Any) -> Any:
        stub = get_stub(cls, p2p, peer, **kwargs)
        return stub if _PROCESS is None else _GuardedStub(stub, peer, *_PROCESS)

    # hivemind logs each handler's exception with its traceback (p2p_daemon.py, _process_stream); a refusal
    # is logged once per peer by Fence.check instead
    logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_QuietRefusals())
    Averager.run, Averager.add_p2p_handlers = fenced_run, fenced_add_handlers
    Averager.get_stub = classmethod(fenced_get_stub)
    Averager._swarm_fenced = True


class MemberKeeper(threading.Thread):
    """Re-stores this peer's member record every ``period`` seconds until :meth:`stop`."""

    def __init__(self, dht: Any, invite: Invite, public_key: bytes, period: float = 120.0) -> None:
        super().__init__(name="swarm-member-keeper", daemon=True)
        self.dht, self.invite, self.public_key, self.period = dht, invite, public_key, period
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.period):
            if time.time() >= self.invite.certificate.expires:
                return
            try:
                publish_member(self.dht, self.invite, self.public_key)
            except Exception as exc:  # the next turn tries again; an expired invite ends the loop above
                log.debug("Could not renew the member record: %r", exc)

    def stop(self) -> None:
        self._stop_event.set()


def attach(dht: Any, public_key: bytes) -> MemberKeeper | None:
    """Fence the averagers that will be built on ``dht`` (started by swarm.dht.start_dht with an invite) and
    publish this peer's member record; None for an open swarm. Call before any averager is built."""
    invite = getattr(dht, "swarm_invite", None)
    if invite is None:
        return None
    install()
    dht.swarm_fence = Fence(invite)
    if not publish_member(dht, invite, public_key):
        raise InviteError(
            f"no peer of run {invite.run_id!r} accepted this peer's member record; check that the invite is "
            "for this swarm"
        )
    keeper = MemberKeeper(dht, invite, public_key)
    keeper.start()
    return keeper


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
                records = (
                    [e.value for e in found.value.values()] if found and isinstance(found.value, dict) else []
                )
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

    from swarm.invite import sign_revocation
    from swarm.metrics import RevocationRecord

    found = dht.get(revoked_key(run_id), latest=True, return_future=True).result(timeout)
    records = [e.value for e in found.value.values()] if found and isinstance(found.value, dict) else []
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
