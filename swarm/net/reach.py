"""Can peers elsewhere dial this one? A dial-back check, and the switch to client mode when they cannot.

A peer behind NAT (a Colab or Kaggle notebook, a home PC) or a closed firewall can dial out but cannot be
dialled. As a full peer it would be named in matchmaking and all-reduce groups that then wait for it in vain,
so it must run in client mode. Users rarely know which case they are in, so the swarm finds out:

1. Every peer that is not in client mode serves :data:`HANDLER` on its DHT's p2p node (:func:`serve`, run in
   the DHT process). A caller sends the addresses it announces; the server starts a **fresh** p2p daemon
   (no listening address, no relay, so no existing connection or circuit can answer for the caller) and
   dials the caller's PeerID at those addresses, within :data:`DIAL_TIMEOUT` seconds.
2. After joining, a new peer asks up to :data:`MAX_ASKED` of the peers it knows (:func:`check`), one after
   another: the next is asked once those asked so far have all answered without dialling it, or after
   :data:`STAGGER` seconds. The first that could dial it settles the check, so a peer that can be dialled
   usually costs the swarm one dial-back (each starts a p2p daemon, about 0.6 s of CPU), not one per peer
   asked. If some answered and none could dial it,
   :func:`swarm.net.node.start_node` restarts its DHT in client mode and logs
   one line that says why. If nobody could answer (an old version, or the first peer), nothing changes.

Abuse: a dial-back makes the server open one connection to addresses of the caller's choosing. So a server
answers each PeerID at most once per :data:`PER_PEER_PERIOD` seconds, runs at most :data:`MAX_CONCURRENT`
checks at once, dials at most
:data:`MAX_ADDRESSES` TCP addresses and only the PeerID that asked (libp2p's handshake fails for any other).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from google.protobuf.wrappers_pb2 import BytesValue

log = logging.getLogger(__name__)

HANDLER = "swarm.reach.DialBack"  # the p2p protocol name other peers call: keep it
DIAL_TIMEOUT = 5.0  # seconds for one dial-back (a TCP and TLS handshake across the internet)
MAX_ASKED = 3  # peers asked, at most
STAGGER = 2.0  # seconds a dial-back question has before the next peer is asked too
MAX_ADDRESSES = 4  # addresses dialled per check
PER_PEER_PERIOD = 30.0  # seconds between two checks for the same PeerID
MAX_CONCURRENT = 4  # dial-backs a server runs at once (each starts a p2p daemon for a few seconds)
_PENDING: set = set()  # dial-backs and questions that outlive their caller (kept referenced until they end)


@dataclass
class Verdict:
    """What the peers asked said about this peer's announced addresses."""

    addresses: list[str]
    sent: int = 0  # peers asked, answered or not
    asked: int = 0  # peers that gave an answer
    reached: int = 0  # of those, how many could dial us
    why_not: list[str] = field(default_factory=list)  # what the peers that could not dial us saw
    errors: list[str] = field(default_factory=list)  # one line per peer that could not answer
    seconds: float = 0.0  # how long the check took

    @property
    def unreachable(self) -> bool:
        """True only when someone answered and nobody could dial us."""
        return self.asked > 0 and self.reached == 0

    def describe(self) -> str:
        if not self.asked:
            return "not checked: no peer could answer a dial-back request"
        return f"{self.reached} of {self.asked} peers could dial {', '.join(self.addresses) or 'no address'}"


def _dialable(maddrs: list[str]) -> list[str]:
    """TCP addresses without the /p2p/ suffix and without relay circuits."""
    out = []
    for maddr in maddrs:
        if "/tcp/" not in maddr or "/p2p-circuit" in maddr:
            continue
        out.append(maddr.split("/p2p/")[0])
    return out[:MAX_ADDRESSES]


async def _dial(peer_id: Any, maddrs: list[str]) -> tuple[bool, str]:
    """Dial ``peer_id`` at ``maddrs`` from a fresh p2p daemon; (reached, why not)."""
    from hivemind.p2p import P2P
    from hivemind.utils.multiaddr import Multiaddr

    probe = await P2P.create(
        host_maddrs=[], no_listen=True, use_relay=False, auto_nat=False, nat_port_map=False, dht_mode="client"
    )
    try:
        await asyncio.wait_for(probe._client.connect(peer_id, [Multiaddr(m) for m in maddrs]), DIAL_TIMEOUT)
        return True, ""
    except TimeoutError:
        return False, f"no answer within {DIAL_TIMEOUT:.0f} s"
    except Exception as exc:  # "Connect failed. msg=failed to dial: failed to dial <id>: all dials failed"
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return False, text.rsplit(": ", 1)[-1][:200]
    finally:
        await probe.shutdown()


class _Server:
    """The dial-back handler of one DHT process."""

    def __init__(self) -> None:
        self.slots = asyncio.Semaphore(MAX_CONCURRENT)
        self.last: dict[str, float] = {}

    async def handle(self, request: BytesValue, context: Any) -> BytesValue:
        caller = context.remote_id
        now = time.monotonic()
        if now - self.last.get(caller.to_base58(), -PER_PEER_PERIOD) < PER_PEER_PERIOD:
            return _reply(None, "asked again too soon")
        self.last[caller.to_base58()] = now
        try:
            maddrs = _dialable([str(m) for m in json.loads(request.value.decode())])
        except (ValueError, TypeError, UnicodeDecodeError):
            return _reply(None, "malformed request")
        if not maddrs:
            return _reply(False, "no TCP address to dial")
        async with self.slots:
            try:
                # shielded: a caller that gives up (its timeout, its process stopped) closes the stream, and
                # hivemind cancels this handler; the dial must still end and shut its probe daemon down
                dial = asyncio.ensure_future(_dial(caller, maddrs))
                _PENDING.add(dial)
                dial.add_done_callback(_PENDING.discard)
                reached, why = await asyncio.shield(dial)
            except Exception as exc:  # our own probe daemon failed to start: we cannot judge
                return _reply(None, f"probe failed: {type(exc).__name__}")
        log.debug("Dial-back to %s at %s: %s", caller, maddrs, "reached" if reached else why)
        return _reply(reached, why)


def _reply(reached: bool | None, why: str) -> BytesValue:
    return BytesValue(value=json.dumps({"reached": reached, "why": why}).encode())


async def serve(_dht: Any, node: Any) -> None:
    """Register the dial-back handler on this DHT node's p2p (runs in the DHT process)."""
    await node.p2p.add_protobuf_handler(HANDLER, _Server().handle, BytesValue)


async def _ask(addresses: list[str], initial: list[str], every: bool, _dht: Any, node: Any) -> Verdict:
    from hivemind.p2p import PeerID

    verdict = Verdict(addresses=_dialable(addresses))
    peers: list[Any] = []
    for maddr in initial:
        if "/p2p/" in maddr:
            peers.append(PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1]))
    peers += [p for p in node.protocol.routing_table.peer_id_to_uid if p not in peers]
    peers = [p for p in peers if p != node.peer_id][:MAX_ASKED]
    request = BytesValue(value=json.dumps(addresses).encode())

    async def one(peer: Any) -> None:
        try:
            call = node.p2p.call_protobuf_handler(peer, HANDLER, request, BytesValue)
            answer = json.loads((await asyncio.wait_for(call, DIAL_TIMEOUT + 5.0)).value.decode())
        except Exception as exc:  # an old peer without the handler, a peer that left, a timeout
            verdict.errors.append(f"{peer}: {type(exc).__name__}")
            return
        if answer.get("reached") is None:
            verdict.errors.append(f"{peer}: {answer.get('why')}")
            return
        verdict.asked += 1
        verdict.reached += bool(answer["reached"])
        if not answer["reached"]:
            verdict.why_not.append(str(answer.get("why")))

    # one peer that dialled this one settles it (reachable, whatever the others say); only a verdict of
    # unreachable needs every answer. The peers are asked one after another, each once the earlier ones have
    # all answered without settling it or STAGGER seconds after the last question (every: all at once), so
    # a small volunteer's start does not wait long for a slow peer. The other questions are left to end by
    # themselves (within DIAL_TIMEOUT + 5 s), not cancelled: a call given up closes its stream, and the asked
    # peer's handler would be cancelled in the middle of its dial-back
    started, tasks = time.monotonic(), []
    for peer in peers:
        if verdict.reached and not every:
            break
        tasks.append(asyncio.create_task(one(peer)))
        verdict.sent += 1
        deadline = time.monotonic() + (0.0 if every else STAGGER)
        while not verdict.reached:
            unanswered, left = [t for t in tasks if not t.done()], deadline - time.monotonic()
            if not unanswered or left <= 0:
                break
            await asyncio.wait(unanswered, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    for answered in asyncio.as_completed(tasks):
        await answered
        if verdict.reached and not every:
            break
    _PENDING.update(t for t in tasks if not t.done())
    for task in tasks:
        task.add_done_callback(_PENDING.discard)
    settled = copy.deepcopy(verdict)  # the answers still to come do not change what was returned
    settled.seconds = time.monotonic() - started
    return settled


def check(dht: Any, every: bool = False) -> Verdict:
    """Ask up to :data:`MAX_ASKED` known peers (the DHT's initial peers first), one after another, to dial its
    addresses, until one could (``every``: ask them all at once and wait for every answer, as ``swarm-peer
    status`` does to show them all)."""
    addresses = [str(a) for a in dht.get_visible_maddrs()]
    return dht.run_coroutine(partial(_ask, addresses, [str(m) for m in dht.initial_peers or ()], every))
