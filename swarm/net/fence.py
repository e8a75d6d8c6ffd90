"""The averagers' side of an invite-only swarm: they serve and call only peers invited by the run's owner.

hivemind 1.1.12's averager RPCs (``rpc_join_group``, ``rpc_aggregate_part``, ``rpc_download_state``) take no
authorizer, unlike the DHT's (swarm/net/authorizer.py). Each handler receives the caller's PeerID, which
libp2p's secure channel authenticates (``P2PContext.remote_id``). So every invited peer stores a **member
record** that ties its PeerID to its invite (signed with the invite's key), and :func:`fence_averagers` makes
a :class:`Fence` the gate of swarm/patches/rpc_guard.py for the averagers built on this peer's DHT: they serve
only PeerIDs with a valid, unrevoked member record, and call (the leader they ask to join, their group's
reducers, a state donor) only such PeerIDs.

The refusal an uninvited peer gets is one line: "run ... is invite-only and peer ... was refused: ...".
This node logs one warning per refused peer.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from swarm.net.invite import Certificate, Invite, InviteError, refusal, revoked_names
from swarm.net.metrics import MemberRecord, members_key, revocation_records, revoked_key
from swarm.patches import rpc_guard
from swarm.patches.rpc_guard import Refused

log = logging.getLogger(__name__)


class NotInvited(Refused):
    """A peer without a valid invite asked (or was about to be asked) for something of an invite-only run."""


def member_bytes(run_id: str, peer_id: str) -> bytes:
    return f"swarm-trainer member|{run_id}|{peer_id}".encode()


@dataclass(frozen=True)
class Member:
    """A member record that checks out: the PeerID it ties to an invite, the invite's name and expiry."""

    peer_id: str
    name: str
    expires: float


def verified_member(value: Any, owner_key: bytes, run_id: str) -> Member | None:
    """The member that a member record (a DHT value of :func:`members_key`) proves, or None: malformed, an
    invite of another owner or run, expired, or a signature that is not the invite's over the PeerID."""
    try:
        record = MemberRecord.parse_obj(value)
        cert = Certificate.from_text(record.certificate)
        signature = base64.b64decode(record.signature, validate=True)
    except Exception:  # a malformed record proves nothing
        return None
    if cert.problem(owner_key, run_id) is not None:
        return None
    if not cert.verify_by_holder(member_bytes(run_id, record.peer_id), signature):
        return None
    return Member(record.peer_id, cert.name, cert.expires)


def _member_reads(dht: Any, invite: Invite) -> list[Any]:
    """Futures of the two DHT reads that :func:`_members` judges: the member records and the revocations."""
    return [
        dht.get(key, latest=True, return_future=True)
        for key in (members_key(invite.run_id), revoked_key(invite.run_id))
    ]


def _members(found: Any, revoked: Any, invite: Invite) -> dict[bytes, Member]:
    gone = revoked_names(revocation_records(revoked), invite.owner_key, invite.run_id)
    out = {}
    if found is not None and isinstance(found.value, dict):
        for subkey, entry in found.value.items():
            member = verified_member(entry.value, invite.owner_key, invite.run_id)
            if member is not None and member.name not in gone:
                out[subkey] = member
    return out


def members_by_key(dht: Any, invite: Invite, timeout: float = 5.0) -> dict[bytes, Member]:
    """The members of ``invite``'s run by the DHT key that signed their member record (the key that signs
    their other records too), revoked invites left out. Raises on a failed read."""
    found, revoked = (future.result(timeout) for future in _member_reads(dht, invite))
    return _members(found, revoked, invite)


class MemberBook:
    """:func:`members_by_key`, read in the background for a caller that must not wait on the DHT (the
    progress tracker's reads): :meth:`current` returns the newest read that has come back (None before the
    first) and starts another when the last was asked for ``quiet_period`` seconds ago or more, or ``period``
    seconds once a caller met a signing key without a member record since (:meth:`note_unknown`: a newcomer,
    counted within a read or two of its first record). The records change when a peer joins or an invite is
    revoked; read both every ``period``, they were 1.1 of the 4.9 DHT requests a second of a DiLoCo peer with
    rounds every 5 s (docs/benchmarks.md)."""

    period = 2.0  # seconds between two reads while a signing key without a member record was met
    quiet_period = 10.0  # otherwise; a revocation reaches the tracker within it (RevocationWatcher.period)

    def __init__(self, dht: Any, invite: Invite) -> None:
        self.dht, self.invite = dht, invite
        self._members: dict[bytes, Member] | None = None
        self._pending: list[Any] | None = None
        self._asked = -float("inf")
        self._unknown = False  # a key without a member record was met since the last read was asked
        self._lock = threading.Lock()

    def note_unknown(self) -> None:
        """A record signed by a key that no member record names was met: read again after ``period``."""
        self._unknown = True

    def current(self) -> dict[bytes, Member] | None:
        with self._lock:
            if self._pending is not None and all(future.done() for future in self._pending):
                try:
                    self._members = _members(*(future.result() for future in self._pending), self.invite)
                except Exception as exc:  # a failed read: the last one stands until the next
                    log.debug("Could not read the member records: %r", exc)
                self._pending = None
            wait = self.period if self._unknown else self.quiet_period
            if self._pending is None and time.monotonic() - self._asked >= wait:
                try:
                    self._pending, self._asked = _member_reads(self.dht, self.invite), time.monotonic()
                    self._unknown = False
                except Exception as exc:  # a DHT that is shutting down
                    log.debug("Could not read the member records: %r", exc)
            return self._members


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
            member = verified_member(entry.value, self.owner_key, self.run_id)
            if member is not None:
                self.members[member.peer_id] = (member.expires, member.name)

    async def refresh(self, dht: Any) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            wait = self._last_refresh + self.refresh_period - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last_refresh = time.monotonic()
            try:
                result, revoked = await asyncio.gather(
                    dht.get(members_key(self.run_id), latest=True, return_future=True),
                    dht.get(revoked_key(self.run_id), latest=True, return_future=True),
                )
            except Exception as exc:
                log.debug("Could not read the member records: %r", exc)
                return
            if result is not None and isinstance(result.value, dict):
                self.learn(result.value)
            self.revoked |= revoked_names(revocation_records(revoked), self.owner_key, self.run_id)

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
            log.warning("Refused %s: %s", role, refusal(self.run_id, f"peer {text}", reason))
        raise NotInvited(refusal(self.run_id, f"peer {text}", reason))


def invite_name(dht: Any, invite: Invite, peer_id: str, timeout: float = 5.0) -> str | None:
    """The name of the invite that ``peer_id`` joined run ``invite.run_id`` with, read from the member
    records; None if it has no valid record (or the read failed)."""
    fence = Fence(invite)
    try:
        found = dht.get(members_key(invite.run_id), latest=True, return_future=True).result(timeout)
    except Exception as exc:
        log.debug("Could not read the member records: %r", exc)
        return None
    if found is not None and isinstance(found.value, dict):
        fence.learn(found.value)
    return fence.members.get(peer_id, (None, None))[1]


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


def fence_averagers(dht: Any, invite: Invite, public_key: bytes | None = None) -> tuple[Fence, MemberKeeper]:
    """Fence the averagers that will be built on ``dht`` (this peer's fence becomes the gate of
    swarm/patches/rpc_guard.py; this installs swarm's patches, which those averagers need when they start)
    and publish this peer's member record, signed under ``public_key`` (default: the key of hivemind's
    process-wide RSASignatureValidator, as swarm.net.metrics.make_validators uses). Returns the fence and the
    started thread that renews the record. Call before any averager is built."""
    from swarm import patches

    patches.install()
    if public_key is None:
        from hivemind.dht.crypto import RSASignatureValidator

        public_key = RSASignatureValidator().local_public_key
    fence = Fence(invite)
    rpc_guard.guard(dht, fence)
    if not publish_member(dht, invite, public_key):
        rpc_guard.unguard(dht)
        raise InviteError(
            f"no peer of run {invite.run_id!r} accepted this peer's member record; check that the invite is "
            "for this swarm"
        )
    keeper = MemberKeeper(dht, invite, public_key)
    keeper.start()
    return fence, keeper
