"""Checking a downloaded state against what the rest of the swarm holds (docs/hivemind-patches.md item 23).

A newcomer, and a peer that fell behind, takes the whole model from one donor. hivemind takes it from the
donor that declares the newest epoch, and a donor may declare any epoch and serve any numbers: the screen
(swarm/averaging/screen.py) refuses outsized ones, but random numbers of the right size, or a model trained
with its signs flipped, would pass it and then be this peer's model, and the state it serves to the next
newcomer.

So every training peer publishes, in its metrics record, the sketch of the state it held at each of its last
``SKETCHES_KEPT`` global epochs (swarm/patches/state_averager.py ``state_sketch``: the norm and 4 random
projections; equal states give equal sketches). While a download runs, :class:`DonorCheck` reads the swarm's
records every ``WATCH_EVERY`` seconds and keeps every sketch it sees. When the download ends, it compares
the downloaded parameters' sketch with the sketches that the peers published for the same epoch. Each record
is one vote (the donor's own included, this peer's left out): for
the downloaded state if its sketch is within ``NEAR`` of it (a fraction of the norm; honest peers at one
epoch hold the same state to about 1e-7, a peer whose round failed differs by about 1e-4, and peers that
stepped alone while the swarm started by up to 0.05), else for another state; votes within ``NEAR`` of
each other are for the same other state.

- at least as many votes for the downloaded state as for any one other state: accepted (honest peers that
  have not averaged yet, each from its own initialisation, hold one state each and outvote nobody);
- no peer but the donor published that epoch: accepted unchecked if no other peer is known (a swarm of
  two), or if the others went past it without publishing it (they jumped over it by downloads of their own,
  as peers do while a swarm starts), within the ``SKETCHES_KEPT`` epochs their records still carry;
- otherwise refused: more peers hold one other state (colluding donors that serve and vouch for one bad
  state are outvoted by more honest peers), or an epoch that no peer but the donor reached within
  ``WAIT_FOR_SKETCHES`` seconds (a donor that claims a future epoch to be asked first), or one older than
  the records can check. The state averager then undoes the download and asks the next donor.

Before it counts, the check reads the records once itself (a download can end before its watcher's first
read), then waits up to ``WAIT_FOR_SKETCHES`` seconds for the live peers that have not yet reached the epoch
(a colluder publishes first).

Who votes. In an invite-only swarm a vote is an invite's: a record counts only if a valid, unrevoked member
record (swarm/net/fence.py) ties its PeerID to an invite and was signed by the same DHT key as the record, and
records under one invite count once (the newest epoch's). An invited attacker can mint as many PeerIDs, keys
and member records as it likes, but they all carry its one invite; nor can it vote in an honest peer's name.
Peers that share one invite (a lab that hands one file to all its machines) therefore count as one peer: give
each volunteer an invite of its own (``swarm-peer invite``; the demo does). In an open swarm a vote is a
record's PeerID, which is its own claim.

The same vote serves a peer whose state round was rejected for lying far from its own parameters
(swarm/averaging/screen.py ``STATE_RADIUS``): :meth:`DonorCheck.astray` says whether its own state is the
one astray (most other peers, two at least, hold one other state), and the peer then downloads the swarm's.

What it cannot catch: a change too small to tell from an honest peer's drift (under ``NEAR`` of the norm, for
which the robust mean of the next rounds is the defence), and attackers with as many votes as the honest
peers that hold one state (invites in an invite-only swarm, records in an open one): one honest peer and one
attacker tie, and the download is kept. A peer that refused every donor keeps its own state and asks again at
its next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from swarm.net import metrics
from swarm.net.fence import members_by_key
from swarm.patches.state_averager import sketch_distance

if TYPE_CHECKING:
    import hivemind

    from swarm.net.invite import Invite

log = logging.getLogger(__name__)
SKETCHES_KEPT = 8  # global epochs whose sketches a peer's record carries
WATCH_EVERY = 1.0  # seconds between two reads of the swarm's records while a download runs
WAIT_FOR_SKETCHES = 5.0  # seconds to wait, after a download, for the other peers' sketches of its epoch
# a downloaded state this close (a fraction of its norm) to another peer's counts as the same: honest peers
# that stepped alone while a swarm started were 0.048 apart at one epoch; random numbers of the right norm, or
# signs flipped, are 1 or more away
NEAR = 0.1
# the reason of a refusal for an epoch that no other peer has reached: not evidence of a bad donor (an honest
# peer ahead of the others while a swarm starts is refused too), so it is told as news, not as a warning
AHEAD = "is ahead of every other peer's"
ASTRAY_VOTES = 2  # other peers, at the least, that must hold one other state for this peer's to be astray


class DonorCheck:
    """The check of item 23 for one peer: ``dht`` and ``run_id`` to read the swarm's records, ``own`` this
    peer's PeerID (base58), ``invite`` the invite it joined with (None in an open swarm: one vote per PeerID,
    else one per invite)."""

    def __init__(self, dht: hivemind.DHT, run_id: str, own: str, invite: Invite | None = None) -> None:
        self.dht, self.run_id, self.own, self.invite = dht, run_id, own, invite
        self.voters: dict[str, str] = {own: invite.certificate.name} if invite is not None else {}
        self.sketches: dict[int, dict[str, list[float]]] = {}  # epoch -> {voter: sketch}
        self.newest: dict[str, int] = {}  # voter -> its epoch, in the records of the last read
        self.checked = self.refused = self.unchecked = 0
        # of the last download judged: how far its state lay from the one most peers published (a fraction
        # of its norm), if it was refused for that; else None
        self.last_gap: float | None = None
        self._warned: set = set()
        self._lock = threading.Lock()

    def read(self) -> None:
        """Read the swarm's records once and keep their sketches (a failed read is skipped)."""
        try:
            records = metrics.fetch(self.dht, self.run_id, self._warned, timeout=WATCH_EVERY * 5)
            members = None if self.invite is None else members_by_key(self.dht, self.invite, WATCH_EVERY * 5)
        except Exception as exc:
            log.debug("Could not read the swarm's records: %r", exc)
            return
        newest: dict[str, int] = {}
        with self._lock:
            # the newest epoch's record first: of the records under one invite, the newest one's sketches win
            for subkey, record in sorted(records.items(), key=lambda item: item[1].global_epoch):
                if not record.peer_id or not record.state_sketches:
                    continue
                voter = record.peer_id
                if members is not None:  # a member's own record (same PeerID, same signing key) or none
                    member = members.get(subkey)
                    if member is None or member.peer_id != record.peer_id:
                        continue
                    voter = self.voters[record.peer_id] = member.name
                for item in record.state_sketches:
                    self.sketches.setdefault(item.epoch, {})[voter] = list(item.sketch)
                newest[voter] = max(newest.get(voter, -1), record.global_epoch)
            self.newest = newest  # the peers whose records live now
            for epoch in sorted(self.sketches)[:-64]:  # a long run's old epochs
                del self.sketches[epoch]

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Read the swarm's records every ``WATCH_EVERY`` seconds while the body (a download) runs: a long
        download outlasts the few epochs that a record carries. The first read comes ``WATCH_EVERY`` in: the
        download reads the records just before, to choose its donor, and the judgement reads them again."""
        done = threading.Event()

        def watch() -> None:
            while not done.wait(WATCH_EVERY):
                self.read()

        watcher = threading.Thread(target=watch, name="donor-check", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()

    def _seen(self, epoch: int, donor: str) -> tuple[dict[str, list[float]], dict[str, int], str]:
        """The sketches published for ``epoch`` (this peer's left out, the donor's kept), and the other peers'
        newest epochs (this peer and the donor left out), by voter; and the donor's voter."""
        own = self.voters.get(self.own, self.own)
        with self._lock:
            donor = self.voters.get(donor, donor)
            votes = {p: s for p, s in self.sketches.get(epoch, {}).items() if p != own}
            newest = {p: e for p, e in self.newest.items() if p not in (donor, own)}
        return votes, newest, donor

    def _counted(self, epoch: int, donor: str) -> tuple[dict[str, list[float]], dict[str, int], str]:
        """:meth:`_seen` once the other live peers that have not reached ``epoch`` yet have published it (an
        attacker's colluder publishes first), at most WAIT_FOR_SKETCHES seconds: one that is behind, or left,
        may never publish it. One past the epoch has published it already, or jumped over it by a download
        of its own."""
        deadline = time.monotonic() + WAIT_FOR_SKETCHES
        # a read of its own first: the watcher's first read begins with the download and may not have ended
        # (a small state downloads in 50 ms), and with no record read yet every state looked like a lone
        # swarm's and was kept unchecked (a loaded machine: a donor ahead of everyone was kept)
        self.read()
        while True:
            votes, newest, voter = self._seen(epoch, donor)
            behind = {p for p, e in newest.items() if e < epoch and p not in votes}
            # the donor's own record of the epoch too: it served the state before it published it (this
            # peer's own state, judged by :meth:`astray`, has no record to wait for)
            published = voter in votes or donor == self.own or not newest
            if (not behind and published) or time.monotonic() >= deadline:
                return votes, newest, voter
            time.sleep(0.5)
            self.read()

    def judge(self, epoch: int, sketch: list[float], donor: str) -> str | None:
        """None if the state of global ``epoch`` downloaded from ``donor`` (its PeerID), whose sketch is
        ``sketch``, may be kept; else why not (one line)."""
        self.last_gap = None
        votes, newest, voter = self._counted(epoch, donor)
        if not set(votes) - {voter}:
            top = max(newest.values(), default=None)
            if top is not None and top < epoch:
                self.refused += 1
                ahead = f"the newest of {len(newest)}: {top}"
                return f"its global epoch {epoch} {AHEAD} ({ahead})"
            if top is not None and epoch < top - SKETCHES_KEPT:
                self.refused += 1
                return (
                    f"its global epoch {epoch} is older than the states the other peers still publish (the "
                    f"newest: {top})"
                )
            self.unchecked += 1
            log.info(
                "No other peer published the state of global epoch %d (%s): kept unchecked",
                epoch,
                "there is none" if top is None else "they went past it by downloads",
            )
            return None
        same, rival, rest = _tally(sketch, votes)
        if len(same) >= rival:
            self.checked += 1
            log.info(
                "Checked the state of global epoch %d: %d of the %d peers that published it hold it",
                epoch,
                len(same),
                len(votes),
            )
            return None
        self.refused += 1
        gap = self.last_gap = min(sketch_distance(sketch, x) for x in rest)
        return (
            f"its parameters differ from the state that {rival} of the {len(votes)} peers published for "
            f"global epoch {epoch} (by {gap:.2g} of its norm or more; {len(same)} hold the downloaded one)"
        )

    def agreeing(self, donor: str, others: list[str]) -> list[str]:
        """Of ``others`` (PeerIDs, base58), those whose records published, at the newest epoch that the
        record of ``donor`` published too, a state within ``NEAR`` of the donor's: the helpers asked first
        for slices of its download (docs/hivemind-patches.md item 31), whose optimizer statistics are the
        donor's too. A peer with no such record, or under the donor's invite, is not among them."""
        with self._lock:
            mine = self.voters.get(donor, donor)
            held = {epoch: votes[mine] for epoch, votes in self.sketches.items() if mine in votes}
            agree = []
            for peer in others:
                theirs = self.voters.get(peer, peer)
                common = [e for e in held if theirs != mine and theirs in self.sketches[e]]
                if common and sketch_distance(held[max(common)], self.sketches[max(common)][theirs]) <= NEAR:
                    agree.append(peer)
        return agree

    def margin(self, donor: str) -> int:
        """How many more votes the state that ``donor`` (its PeerID, base58) published at its newest published
        epoch has than the most-published other state of that epoch, as :meth:`judge` would count them now
        (this peer's own record left out): >= 0 if a download of it would be kept as the records stand, < 0 if
        refused; 0 for a donor without a record. The download asks donors of one epoch in this order."""
        own = self.voters.get(self.own, self.own)
        with self._lock:
            mine = self.voters.get(donor, donor)
            held = [epoch for epoch, votes in self.sketches.items() if mine in votes]
            if not held:
                return 0
            votes = {p: s for p, s in self.sketches[max(held)].items() if p != own}
        same, rival, _ = _tally(votes[mine], votes)
        return len(same) - rival

    def astray(self, epoch: int, sketch: list[float]) -> str | None:
        """Why this peer's own state of global ``epoch`` (its sketch ``sketch``) is the one astray, or None.

        A state round whose average lies far from this peer's parameters (swarm/averaging/screen.py
        ``STATE_RADIUS``) says only that this peer and its group disagree: either groupmates that are half of
        the group or more sent other parameters (colluders), and this peer must keep its own, or this peer's
        state wandered off (a bug, a stale state, rounds it rejected while an attacker was in them), and it
        would otherwise reject every round, train alone for ever, and be banned by the others for being
        far. The swarm's published sketches decide: astray if at least ``ASTRAY_VOTES`` other peers (one vote
        per invite) hold one state that is not this peer's, and they are more than half of the peers that
        published the epoch. Colluders that are half of the peers or fewer, and a swarm of two, never make a
        peer think itself astray."""
        self.read()
        votes, _, _ = self._counted(epoch, self.own)
        same, rival, rest = _tally(sketch, votes)
        if rival < ASTRAY_VOTES or 2 * rival <= len(votes):
            return None
        gap = min(sketch_distance(sketch, x) for x in rest)
        return (
            f"{rival} of the {len(votes)} other peers that published global epoch {epoch} hold one state, "
            f"{gap:.2g} of its norm or more from this peer's ({len(same)} hold this peer's)"
        )


def _tally(sketch: list[float], votes: dict[str, list[float]]) -> tuple[list[str], int, list[list[float]]]:
    """(the voters whose sketch is within ``NEAR`` of ``sketch``; the most other voters that hold one other
    state; the other voters' sketches). Honest peers that have not averaged yet (each from its own
    initialisation) hold as many states as there are peers, and outvote nobody."""
    same = [p for p, other in votes.items() if sketch_distance(sketch, other) <= NEAR]
    rest = [votes[p] for p in votes if p not in same]
    rival = max((sum(sketch_distance(x, y) <= NEAR for y in rest) for x in rest), default=0)
    return same, rival, rest
