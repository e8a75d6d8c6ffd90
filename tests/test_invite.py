"""Invite-only swarms (swarm/net/invite.py, swarm/net/fence.py) on real hivemind DHTs, p2p daemons and
averagers on 127.0.0.1: invited peers average together, and an uninvited client written with hivemind's public
API alone is refused at every entry point (the DHT's RPCs, rpc_join_group, rpc_aggregate_part,
rpc_download_state), as are a peer whose invite another owner signed and one whose invite expired."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import hivemind
import pytest
import torch
from click.testing import CliRunner
from hivemind.averaging import DecentralizedAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.config import SwarmConfig
from swarm.net import authorizer, fence, metrics
from swarm.net.invite import (
    InviteError,
    load_invite,
    load_or_create_owner_key,
    make_invite,
    revoked_names,
    sign_revocation,
)
from swarm.net.node import SwarmConnectionError, SwarmNode, start_node
from swarm.patches import progress, rpc_guard
from swarm.procs import remove_stale_sockets
from swarm.waiting import wait_until

RUN = "pytest-invite"
PREFIX = f"{RUN}_state"

# An uninvited peer, written from hivemind's documentation alone (nothing of this project is imported): it
# joins the DHT through the address a peer printed and calls each entry point; prints what it got as JSON.
PLAIN_CLIENT = r"""
import asyncio, json, sys
import hivemind
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter

maddr, peer_id, prefix, run = sys.argv[1:5]
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[maddr],
                   ensure_bootstrap_success=False)
dht.store(f"{run}_note", value="an intruder was here", expiration_time=get_dht_time() + 60)
found = dht.get(f"{run}_members", latest=True)
out = {"read": "nothing" if found is None else "member records: " + str(len(found.value))}

async def first_reply(call):
    try:
        stream = await call
        message = await asyncio.wait_for(anext(stream), 20)
        return "answered: " + type(message).__name__ + " " + str(message)[:60].replace("\n", " ")
    except StopAsyncIteration:
        return "answered: end of stream"
    except Exception as exc:
        return "refused: " + str(exc)

async def calls():
    p2p = await dht.replicate_p2p()
    stub = DecentralizedAverager.get_stub(p2p, PeerID.from_base58(peer_id), namespace=prefix)
    request = averaging_pb2.JoinRequest(schema_hash=b"x", expiration=get_dht_time() + 5,
                                        group_key=prefix + ".0b")
    return {
        "join_group": await first_reply(stub.rpc_join_group(request)),
        "aggregate_part": await first_reply(
            stub.rpc_aggregate_part(as_aiter(averaging_pb2.AveragingData(group_id=b"x")))),
        "download_state": await first_reply(stub.rpc_download_state(averaging_pb2.DownloadRequest())),
    }

out.update(asyncio.run(calls()))
print(json.dumps(out), flush=True)
dht.shutdown()
"""


@pytest.fixture
def invites(tmp_path):
    owner, created = load_or_create_owner_key(tmp_path / "owner.pem")
    stranger, _ = load_or_create_owner_key(tmp_path / "stranger.pem")
    paths = {}
    for name, key, lifetime in [("alice", owner, 3600), ("bob", owner, 3600), ("eve", owner, 3600),
                                ("mallory", stranger, 3600)]:  # fmt: skip
        make_invite(key, RUN, name, lifetime).save(tmp_path / f"{name}.tok")
        paths[name] = str(tmp_path / f"{name}.tok")
    paths["owner"] = owner
    return paths


@pytest.fixture
def cleanup():
    """Shut down every DHT and averager the test registers, then remove the sockets it left."""
    started, things = time.time(), []
    yield things
    for thing in reversed(things):
        thing.stop() if isinstance(thing, SwarmNode) else thing.shutdown()
    remove_stale_sockets(since=started, settle=1.0)


@dataclass
class Peer:
    """A node of this project and the key its records are signed with."""

    node: SwarmNode
    key: bytes

    @property
    def dht(self) -> hivemind.DHT:
        return self.node.dht


def _peer(
    invite: str | None,
    initial: list[str],
    cleanup: list,
    key: RSAPrivateKey | None = None,
    member: bool = True,
) -> Peer:
    """A node of this project (started as every role starts it), its member record published under ``key``
    (a new one by default) unless not ``member``."""
    cfg = SwarmConfig(
        run_id=RUN,
        host_maddrs=("/ip4/127.0.0.1/tcp/0",),
        initial_peers=tuple(initial),
        invite=invite,
        bootstrap_timeout=5.0,
    )
    validators, public_key = metrics.make_validators(RUN, key or RSAPrivateKey())
    node = start_node(cfg, validators)
    cleanup.append(node)
    if member:
        node.fence_averagers(public_key)
    return Peer(node, public_key)


def _averager(dht: hivemind.DHT, value: float, cleanup: list) -> DecentralizedAverager:
    averager = DecentralizedAverager(
        [torch.full((1000,), value)],
        dht=dht,
        prefix=PREFIX,
        target_group_size=2,
        min_group_size=2,
        min_matchmaking_time=2.0,
        request_timeout=1.0,
        start=True,
    )
    cleanup.append(averager)
    return averager


def _record(peer_name: str, epoch: int) -> metrics.LocalMetrics:
    return metrics.LocalMetrics(peer_name=peer_name, global_epoch=epoch, samples_per_second=1.0, loss=1.0,
                                samples_accumulated=0, mini_steps=0, time=time.time())  # fmt: skip


def _plain_client(dht: hivemind.DHT) -> dict:
    """Run PLAIN_CLIENT against ``dht``'s peer; what it saw at each entry point."""
    address = str(dht.get_visible_maddrs()[0])
    proc = subprocess.run(
        [sys.executable, "-c", PLAIN_CLIENT, address, str(dht.peer_id), PREFIX, RUN],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_invite_file_is_checked_before_use(tmp_path, invites):
    mode = stat.S_IMODE(os.stat(tmp_path / "owner.pem").st_mode)
    assert mode == 0o600 and stat.S_IMODE(os.stat(invites["alice"]).st_mode) == 0o600
    assert load_invite(invites["alice"], RUN).certificate.name == "alice"
    with pytest.raises(InviteError, match="is for run 'pytest-invite', not 'other-run'"):
        load_invite(invites["alice"], "other-run")
    with pytest.raises(InviteError, match="does not exist"):
        load_invite(tmp_path / "missing.tok")
    body = json.loads(open(invites["alice"]).read())
    body["certificate"]["expires"] += 86400 * 365  # a holder who extends the invite breaks the signature
    (tmp_path / "altered.tok").write_text(json.dumps(body))
    with pytest.raises(InviteError, match="signature is invalid"):
        load_invite(tmp_path / "altered.tok")
    (tmp_path / "junk.tok").write_text("not json")
    with pytest.raises(InviteError, match="not a swarm-trainer invite"):
        load_invite(tmp_path / "junk.tok")
    owner_key = load_invite(invites["alice"]).owner_key
    stranger, _ = load_or_create_owner_key(tmp_path / "stranger.pem")
    signed = sign_revocation(invites["owner"], RUN, ["bob"])
    assert revoked_names([signed], owner_key, RUN) == {"bob"}
    assert revoked_names([sign_revocation(stranger, RUN, ["alice"])], owner_key, RUN) == set()
    assert revoked_names([{**signed, "names": ["alice", "bob"]}], owner_key, RUN) == set()  # altered
    assert revoked_names([signed], owner_key, "other-run") == set()
    make_invite(invites["owner"], RUN, "late", 0.01).save(tmp_path / "late.tok")
    time.sleep(0.05)
    with pytest.raises(InviteError, match="expired at"):
        load_invite(tmp_path / "late.tok")


def test_invite_command_creates_the_key_once_and_join_refuses_a_bad_invite(tmp_path):
    from peer.cli import main

    runner = CliRunner()
    args = ["invite", "--owner-key", str(tmp_path / "o.pem"), "--run-id", RUN, "--name", "carol"]
    first = runner.invoke(main, [*args, "--out", str(tmp_path / "c1.tok"), "--expires", "2h"])
    assert first.exit_code == 0, first.output
    assert "Created the owner key" in first.output and "'carol'" in first.output
    second = runner.invoke(main, [*args, "--out", str(tmp_path / "c2.tok")])
    assert second.exit_code == 0 and "Created" not in second.output
    owners = {json.loads(open(tmp_path / f).read())["certificate"]["owner_key"] for f in ("c1.tok", "c2.tok")}
    assert len(owners) == 1  # both signed by the one key the first call created
    bad = runner.invoke(main, [*args, "--out", str(tmp_path / "c3.tok"), "--expires", "soon"])
    assert bad.exit_code != 0 and "is not a duration" in bad.output
    (tmp_path / "junk.tok").write_text("{}")
    joined = runner.invoke(main, ["join", "--config", "demo", "--invite", str(tmp_path / "junk.tok")])
    assert joined.exit_code == 1
    assert joined.output.strip().splitlines() == [
        f"Error: {tmp_path / 'junk.tok'} is not a swarm-trainer invite (damaged or another file); ask the "
        "run's owner for a new one"
    ]


def test_invited_peers_average_and_an_uninvited_client_is_refused_everywhere(invites, cleanup):
    a = _peer(invites["alice"], [], cleanup)
    b = _peer(invites["bob"], [str(m) for m in a.dht.get_visible_maddrs()], cleanup)
    first, second = _averager(a.dht, 1.0, cleanup), _averager(b.dht, 3.0, cleanup)
    for control in [first.step(wait=False), second.step(wait=False)]:
        assert control.result(timeout=60) is not None, "the two invited peers did not average"
    for averager in (first, second):
        with averager.get_tensors() as (tensor,):
            assert torch.allclose(tensor, torch.full((1000,), 2.0))

    # what the monitor names a banned peer by: the invite it joined with, from the member records
    alice = load_invite(invites["alice"])
    assert fence.invite_name(a.dht, alice, str(b.dht.peer_id)) == "bob"
    assert fence.invite_name(a.dht, alice, "12D3KooWnobody") is None

    seen = _plain_client(a.dht)
    assert seen["read"] == "nothing"  # the member records of a and b are there, but not for it
    for entry in ("join_group", "aggregate_part", "download_state"):
        assert seen[entry].startswith("refused: ") and "is invite-only" in seen[entry], (entry, seen[entry])
    assert a.dht.get(f"{RUN}_note", latest=True) is None and b.dht.get(f"{RUN}_note", latest=True) is None
    with first.get_tensors() as (tensor,):
        assert torch.allclose(tensor, torch.full((1000,), 2.0))


def test_the_same_client_is_served_by_an_open_swarm(cleanup):
    """The control for the test above: what the uninvited client gets where no fence stands."""
    open_peer = _peer(None, [], cleanup)
    _averager(open_peer.dht, 1.0, cleanup)
    seen = _plain_client(open_peer.dht)
    assert wait_until(lambda: open_peer.dht.get(f"{RUN}_note", latest=True) is not None, timeout=5)
    assert seen["join_group"].startswith("answered: MessageFromLeader")
    # an unknown group id makes hivemind's handler wait for a group to register (averager.py:588), so the
    # reply varies (BAD_GROUP_ID, or the stream breaks when the client gives up); never a refusal, though
    assert "invite" not in seen["aggregate_part"]
    assert seen["download_state"].startswith("answered: DownloadData")  # the state itself


def test_invites_of_another_owner_and_expired_ones_are_refused(tmp_path, invites, cleanup):
    a = _peer(invites["alice"], [], cleanup)
    address = [str(m) for m in a.dht.get_visible_maddrs()]
    with pytest.raises(SwarmConnectionError, match="refuses an invite of another run or owner"):
        _peer(invites["mallory"], address, cleanup)
    with pytest.raises(SwarmConnectionError, match="If the swarm is invite-only, pass the invite"):
        _peer(None, address, cleanup)

    make_invite(invites["owner"], RUN, "dave", 6.0).save(tmp_path / "dave.tok")
    dave = _peer(str(tmp_path / "dave.tok"), address, cleanup)
    gate = fence.Fence(load_invite(invites["alice"]))

    def check(peer: hivemind.DHT) -> str:
        try:
            asyncio.run(gate.check(peer.dht.peer_id, a.dht, "a test"))
            return "admitted"
        except fence.NotInvited as exc:
            return str(exc)

    assert check(dave) == "admitted"
    record = _record("dave", 1)
    assert metrics.publish(dave.dht, RUN, dave.key, record, 60).result(timeout=10)
    assert wait_until(lambda: len(metrics.fetch(a.dht, RUN)) == 1, timeout=10)
    expires = load_invite(tmp_path / "dave.tok").certificate.expires
    time.sleep(max(0.0, expires - time.time()) + 0.5)
    assert "its invite expired" in check(dave)
    metrics.publish(dave.dht, RUN, dave.key, record.copy(update={"global_epoch": 2}), 60).result(timeout=10)
    time.sleep(1.0)
    # its new record never reached A
    assert [r.global_epoch for r in metrics.fetch(a.dht, RUN).values()] == [1]


def test_a_revoked_invite_stops_working(tmp_path, invites, cleanup, monkeypatch):
    monkeypatch.setattr(authorizer.RevocationWatcher, "period", 1.0)
    a = _peer(invites["alice"], [], cleanup)
    bob = _peer(invites["bob"], [str(m) for m in a.dht.get_visible_maddrs()], cleanup)
    gate = fence.Fence(load_invite(invites["alice"]))
    asyncio.run(gate.check(bob.dht.peer_id, a.dht, "a test"))  # admitted
    revoked = subprocess.run(
        [sys.executable, "-m", "peer", "revoke", "--owner-key", str(tmp_path / "owner.pem"), "--run-id", RUN,
         "--name", "bob", "--initial-peers", str(a.dht.get_visible_maddrs()[0])],
        capture_output=True, text=True, timeout=120, start_new_session=True,
    )  # fmt: skip
    assert revoked.returncode == 0, revoked.stderr[-2000:]
    assert "Revoked 'bob' in run 'pytest-invite'" in revoked.stdout
    assert wait_until(lambda: bob.node.revocations.self_revoked.is_set(), timeout=15)
    assert wait_until(lambda: "bob" in a.node.revocations.revoked, timeout=15)
    gate.recheck_period = 0.0
    with pytest.raises(fence.NotInvited, match="its invite 'bob' was revoked by the owner"):
        asyncio.run(gate.check(bob.dht.peer_id, a.dht, "a test"))
    record = _record("bob", 3)
    metrics.publish(bob.dht, RUN, bob.key, record, 60).result(timeout=10)
    time.sleep(1.0)
    assert metrics.fetch(a.dht, RUN) == {}  # what bob writes now never reaches a

    forged = subprocess.run(  # a revocation signed with another key revokes nothing
        [sys.executable, "-m", "peer", "revoke", "--owner-key", str(tmp_path / "stranger.pem"),
         "--run-id", RUN, "--name", "alice", "--initial-peers", str(a.dht.get_visible_maddrs()[0])],
        capture_output=True, text=True, timeout=120, start_new_session=True,
    )  # fmt: skip
    assert forged.returncode == 1 and "refuses an invite of another run or owner" in forged.stderr


def test_an_invited_averager_never_calls_an_uninvited_peer(invites, cleanup, monkeypatch):
    """The other direction: the stubs through which an averager asks a leader to take it, sends its parts to
    reducers or downloads a state check the other peer first (in the averager's process; here in this one)."""
    from hivemind.proto import averaging_pb2

    a = _peer(invites["alice"], [], cleanup)
    stranger = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    cleanup.append(stranger)
    monkeypatch.setattr(rpc_guard, "_PROCESS", (fence.Fence(load_invite(invites["alice"])), a.dht))
    # hivemind caches a servicer's handlers on the first class that asks (p2p/servicer.py,
    # _collect_rpc_handlers), and subclasses inherit that cache: asking on DecentralizedAverager here would
    # give every averager class later forked from this process its handler names (test_rounds failed so)
    for name in ("_rpc_handlers", "_stub_type"):
        monkeypatch.setattr(DecentralizedAverager, name, None)

    async def download() -> None:
        p2p = await a.dht.replicate_p2p()
        stub = DecentralizedAverager.get_stub(p2p, stranger.peer_id, namespace=PREFIX)
        await stub.rpc_download_state(averaging_pb2.DownloadRequest())

    refused = f"peer {stranger.peer_id} was refused: it has shown no invite"
    with pytest.raises(fence.NotInvited, match=refused):
        asyncio.run(download())


class _Presenting(authorizer.InviteAuthorizer):
    """A DHT authorizer that presents ``shown`` as its token whatever its own PeerID (if given; else its own
    token, made from its invite) and reads every response."""

    def __init__(self, invite, shown=None):
        super().__init__(invite)
        self.shown = shown

    def token(self, peer_id):
        return self.shown if self.shown is not None else super().token(peer_id)

    def admits(self, token, peer_id, what):
        return True


def test_a_token_copied_from_an_invited_peer_is_refused_from_another_peer(invites, cleanup):
    """A DHT message carries no signature of its own: its token is bound to the PeerID that libp2p's secure
    channel authenticates. Every peer that b talks to sees b's token; presented by another PeerID it admits
    nothing, while a token the same code makes from an invite for its own PeerID is admitted (the control)."""
    from swarm.patches.dht import SwarmDHT

    a = _peer(invites["alice"], [], cleanup)
    b = _peer(invites["bob"], [str(m) for m in a.dht.get_visible_maddrs()], cleanup)
    bob = load_invite(invites["bob"])
    seen_from_b = authorizer.InviteAuthorizer(bob).token(b.dht.peer_id)  # what b puts into every message

    def store_through(presenting: _Presenting, key: str) -> None:
        """Store ``key`` from a new node (a DHT of this project) that presents what ``presenting`` does; its
        store returns once the nodes it reached answered (True even if none did: it keeps a copy itself)."""
        other = SwarmDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], authorizer=presenting,
                         initial_peers=[str(m) for m in a.dht.get_visible_maddrs()],
                         ensure_bootstrap_success=False)  # fmt: skip
        cleanup.append(other)
        assert other.peer_id != b.dht.peer_id
        other.store(key, "written", expiration_time=get_dht_time() + 60)

    store_through(_Presenting(bob), f"{RUN}_own_token")  # the control: a token for its own PeerID
    assert a.dht.get(f"{RUN}_own_token", latest=True) is not None

    store_through(_Presenting(bob, shown=seen_from_b), f"{RUN}_copied_token")
    assert a.dht.get(f"{RUN}_copied_token", latest=True) is None
    assert b.dht.get(f"{RUN}_copied_token", latest=True) is None


class _ClaimingTracker(ProgressTracker):
    """A progress tracker changed as an invited attacker would change it: its records claim ``claim``'s
    PeerID, not its own."""

    claim: Any = None

    def _get_local_progress(self, *args: Any, **kwargs: Any) -> Any:
        found = super()._get_local_progress(*args, **kwargs)
        return found if self.claim is None else found.copy(update={"peer_id": self.claim.to_bytes()})


def test_progress_records_count_only_under_the_peer_id_of_their_signers_member_record(
    invites, cleanup, caplog
):
    """Item 26 (swarm/patches/progress.py ``vouched_by``, ``keep_only``). Honest a and b, and eve, invited
    too, whose records claim b's PeerID (a ban of eve, or a refusal, would then miss them, and one of b hit
    them), plus a node of eve's whose key has no member record (a DHT process signs with one key). Plain
    hivemind counts every record: 4 peers. With the member book, a's reads count a and b, and a warns once
    about eve's invite."""
    keys = {name: RSAPrivateKey() for name in ("alice", "bob", "eve", "eve2")}
    a = _peer(invites["alice"], [], cleanup, keys["alice"])
    address = [str(m) for m in a.dht.get_visible_maddrs()]
    b = _peer(invites["bob"], address, cleanup, keys["bob"])
    eve = _peer(invites["eve"], address, cleanup, keys["eve"])
    eve_unlisted = _peer(invites["eve"], address, cleanup, keys["eve2"], member=False)
    trackers = []
    for node, key, cls, samples in [(a, keys["alice"], ProgressTracker, 5),
                                    (b, keys["bob"], ProgressTracker, 7),
                                    (eve, keys["eve"], _ClaimingTracker, 100),
                                    (eve_unlisted, keys["eve2"], ProgressTracker, 1000)]:  # fmt: skip
        tracker = cls(node.dht, RUN, 10**6, max_refresh_period=60.0, private_key=key, start=False)
        tracker.claim = b.dht.peer_id
        tracker.report_local_progress(0, samples)
        trackers.append(tracker)
    a_tracker = trackers[0]
    plain = a_tracker._parse_swarm_progress_data  # hivemind's own
    book = fence.MemberBook(a.dht, load_invite(invites["alice"]))
    progress.keep_only(a_tracker, progress.vouched_by(book, a_tracker._local_public_key))
    for tracker in trackers:
        tracker.start()
        cleanup.append(tracker)
    assert wait_until(lambda: len(book.current() or {}) == 3, timeout=20)

    def read() -> tuple:
        found = a.dht.get(a_tracker.training_progress_key, latest=True)
        raw = plain(found.value if found is not None else None)
        a_tracker.global_progress.next_fetch_time = get_dht_time()  # a's own read, now
        a_tracker.global_state_updated.set()
        vouched = a_tracker.global_progress
        return (raw.num_peers, raw.samples_accumulated), (vouched.num_peers, vouched.samples_accumulated)

    assert wait_until(lambda: read() == ((4, 1112), (2, 12)), timeout=20, interval=0.25), read()
    trackers[1].shutdown()  # b leaves: hivemind withdraws its record (stores None), which is no claim at all
    assert wait_until(lambda: read() == ((3, 1105), (1, 5)), timeout=20, interval=0.25), read()
    warned = [r.getMessage() for r in caplog.records if "Ignored the progress records" in r.getMessage()]
    assert warned == [
        f"Ignored the progress records of invite 'eve', which claim PeerID {b.dht.peer_id} while its member "
        f"record names {eve.dht.peer_id}"
    ]


def test_the_member_book_reads_quietly_until_it_meets_a_key_without_a_member_record(
    invites, cleanup, monkeypatch
):
    """The member records change when a peer joins or an invite is revoked: the book reads them (and the
    revocations) every ``quiet_period``, and after ``period`` once a progress record signed by a key without a
    member record was met (a newcomer), which then counts before the next quiet read would have come."""
    reads: list[float] = []
    real = fence._member_reads

    def counted(dht: Any, invite: Any) -> Any:
        reads.append(time.monotonic())
        return real(dht, invite)

    monkeypatch.setattr(fence, "_member_reads", counted)
    a = _peer(invites["alice"], [], cleanup)
    book = fence.MemberBook(a.dht, load_invite(invites["alice"]))
    book.period, book.quiet_period = 0.5, 30.0
    keep = progress.vouched_by(book, a.key)
    assert wait_until(lambda: len(book.current() or {}) == 1, timeout=20)
    known = len(reads)
    until = time.monotonic() + 2.5
    while time.monotonic() < until:  # the tracker's reads ask the book at every parse
        assert book.current() is not None
        time.sleep(0.05)
    assert len(reads) == known, "the book read again though every key it met was a member's"

    b = _peer(invites["bob"], [str(m) for m in a.dht.get_visible_maddrs()], cleanup)
    record = SimpleNamespace(value={"peer_id": b.dht.peer_id.to_bytes()})  # b's first progress record
    assert not keep(b.key, record)  # not read yet: left out, and the book told
    assert wait_until(lambda: keep(b.key, record), timeout=20, interval=0.05)
    assert time.monotonic() < reads[known - 1] + book.quiet_period, "b waited for the quiet read"
    assert len(reads) in (known + 1, known + 2), len(reads)


def test_a_token_of_an_older_release_is_refused_with_what_to_do(invites, caplog):
    """Before tokens were bound to PeerIDs they named a 32-byte Ed25519 key of the node's own: such a peer
    is refused, and the refusing peer says that it runs an older release."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    from hivemind.p2p import PeerID
    from hivemind.proto.auth_pb2 import AccessToken

    bob = load_invite(invites["bob"])
    key = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    old = AccessToken(username=bob.certificate.to_text(), public_key=key,
                      expiration_time=repr(bob.certificate.expires))  # fmt: skip
    old.signature = bob.sign(authorizer._token_bytes(old))
    gate = authorizer.InviteAuthorizer(load_invite(invites["alice"]))
    sender = PeerID.from_base58("12D3KooWH1z6BfU1JbWHDHZyU8g6F1GD6j6DiMr5S4pKGBudadzN")
    with caplog.at_level("WARNING", logger="swarm.net.authorizer"):
        assert not gate.admits(old, sender, "request")
        assert gate.admits(authorizer.InviteAuthorizer(bob).token(sender), sender, "request")  # the control
    (line,) = [r.getMessage() for r in caplog.records]
    assert "it runs an older swarm trainer, whose access tokens name no PeerID" in line, line
    # a flood of forged senders: refused, and remembered for their one warning only up to a bound
    for n in range(authorizer._WARN_AT_MOST + 10):
        forged = AccessToken(username="", public_key=n.to_bytes(38, "big"))
        assert not gate.admits(forged, sender, "request")
    assert len(gate._warned) == authorizer._WARN_AT_MOST
