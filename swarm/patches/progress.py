"""The progress tracker (hivemind/optim/progress_tracker.py): how often a peer tells and reads the swarm's
progress.

**What hivemind does.** ``ProgressTracker`` stores a signed record of this peer's progress in the DHT after
every local step (``report_local_progress`` sets ``should_report_progress``, and ``_progress_reporter``,
progress_tracker.py:195-240, stores on each set), and only once the peer has samples (progress_tracker.py:
213-216). It reads the swarm's records at a time planned from its estimate of when the swarm reaches the
target batch (``_parse_swarm_progress_data``, progress_tracker.py:275-330): made from the speeds in the
records, ``max_refresh_period`` (10 s) away when no speed is known, ``default_refresh_period`` (3 s) away
when no record is found (progress_tracker.py:280-292). At a new epoch it sets the estimate to "never"
(``update_epoch``, progress_tracker.py:176-193: ``eta_next_epoch = inf``).

**What goes wrong** (items of docs/hivemind-patches.md):

- item 6: a peer taking 60-80 steps a second kept its DHT process at 26 % of a core storing records.
- item 14: records stored before a peer's first samples carry no speed, so the next read is 10 s away, and
  each peer computes the whole target alone meanwhile.
- item 15: after a new epoch, until its next read, a peer counts only its own samples and steps when they
  alone reach the target: with epochs shorter than ``min_refresh_period`` every peer computed most of each
  epoch's target alone.
- item 19: peers started together each find nobody at their first read and train alone for 3 s.
- item 27: a peer alone ends its epoch once its own last record, extrapolated at its speed, reaches the
  target, with fewer samples than the target when its steps run slower than that speed.

**What this changes.** :func:`throttle_progress_reports` stores a new epoch at once, and its first samples,
otherwise at most one record per interval. :func:`read_soon_while_speeds_unknown` plans the next read
``min_refresh_period`` ahead when no speed (or no record) is known. :func:`expect_the_swarm` sets a new
epoch's estimate from the summed speed of the last read. :func:`read_within` and :func:`meet_peers` bring a
read forward for a peer that waits (DiLoCo after its inner steps; ``--min-peers`` before the first step).
:func:`leave_out_banned` reads the swarm without the peers that this peer banned; :func:`discount_refused`
(item 24) counts a refused donor's epoch as no more than this peer's own. :func:`pace_by_time`
(item 22) makes the target batch what the swarm computes in a given time, at the speeds of its records.
:func:`keep_only` with :func:`vouched_by` (item 26) keeps, in an invite-only swarm, only the records whose
claimed PeerID is the one their signer's member record names. :func:`count_alone_exactly` (item 27) has a peer
alone in its reads step when its own samples reach the target, not when its extrapolated record does.
:func:`leave_out_silent` (item 30) leaves out the records of peers that did not come to a round until they
store a newer one.

These wrap methods of one running ``ProgressTracker``; nothing here is process-wide. The tracker keeps what
item 15 needs in a :class:`LastRead` that the wrappers share.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


class ThrottledReports(threading.Event):
    """The tracker's ``should_report_progress``: releases its reporter at once for a new epoch and for the
    epoch's first samples, otherwise at most once per ``interval`` seconds; a set that comes too early is
    released when the interval ends. The reporter thread itself waits out the interval, in :meth:`wait`
    (hivemind runs that wait in an executor thread, progress_tracker.py:204)."""

    def __init__(self, tracker: Any, interval: float) -> None:
        super().__init__()
        self.tracker, self.interval = tracker, interval
        self.last, self.last_key = -float("inf"), None
        self.fired = 0  # records this peer let the tracker store
        self._pending = False
        self._wake = threading.Condition()

    def is_set(self) -> bool:
        return self._pending

    def set(self) -> None:
        with self._wake:
            self._pending = True
            self._wake.notify_all()

    def clear(self) -> None:
        # the release in wait() took the pending set already; hivemind's reporter clears only after its wait
        # returned (progress_tracker.py:205-207), so a set that came in between (a new epoch) stays pending
        pass

    def _key(self) -> tuple[int, bool]:
        # (epoch, has samples) new: at once. hivemind's reporter stops storing once no record of the last
        # two epochs carried samples (progress_tracker.py:213-216), and the epoch's first record (from
        # update_epoch) has none: with epochs shorter than the interval, holding back the first record with
        # samples made the peer vanish from the others' count, and both stepped alone
        progress = self.tracker.local_progress
        return progress.epoch, progress.samples_accumulated > 0

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            while True:
                now = time.monotonic()
                left = None if deadline is None else deadline - now
                if not self._pending:
                    if left is not None and left <= 0:
                        return False
                    self._wake.wait(left)
                    continue
                hold = self.last + self.interval - now
                # a wait that times out during the hold releases too (hivemind stores on its timeout anyway),
                # and so does the tracker's shutdown (its reporter then ends)
                stopping = self.tracker.shutdown_triggered.is_set()
                if self._key() != self.last_key or hold <= 0 or (left is not None and left <= 0) or stopping:
                    self.last, self.last_key = now, self._key()
                    self.fired += 1
                    self._pending = False
                    return True
                self._wake.wait(hold if left is None else min(hold, left))  # a new epoch's set() ends it


def throttle_progress_reports(tracker: Any, interval: float) -> None:
    """Item 6, on one running ``ProgressTracker`` (``interval`` 0 leaves it be)."""
    if interval <= 0 or isinstance(tracker.should_report_progress, ThrottledReports):
        return
    previous, throttled = tracker.should_report_progress, ThrottledReports(tracker, interval)
    if previous.is_set():
        throttled.set()
    tracker.should_report_progress = throttled
    previous.set()  # wakes the reporter from its wait on the old event; from its next turn it waits on ours


@dataclass
class LastRead:
    """What the last read of the swarm's progress found: the summed speed of its records and the peers."""

    speed: float = 0.0
    peers: int = 0


def _record_peer(entry: Any) -> str | None:
    """The PeerID (base58) of a progress record, or None for a malformed one (hivemind's own parsing judges
    it)."""
    from hivemind.p2p import PeerID

    try:
        return PeerID(entry.value["peer_id"]).to_base58()
    except Exception:
        return None


def vouched_by(members: Any, own_key: bytes) -> Any:
    """For an invite-only swarm: a predicate ``keep(subkey, entry)`` on progress records that keeps a record
    only if its PeerID is the one that the member record signed by the same DHT key names (``members``, a
    swarm.net.fence.MemberBook: ``current()`` returns them by key, or None before the first read, when every
    record is kept; a key it does not name is told to it, ``note_unknown()``, so that it reads soon), and this
    peer's own (``own_key``). A record's ``peer_id`` is whatever its writer claims, and the bans, the refused
    donors and the claimed epochs are all keyed by it: an invited peer could otherwise write its records in an
    honest peer's name, or in a name nobody banned. One warning per signing key that claims another member's
    PeerID; a key without a member record (a newcomer not read yet, or a stranger) is left out silently."""
    warned: set[bytes] = set()

    def keep(subkey: Any, entry: Any) -> bool:
        book = members.current()
        if book is None or subkey == own_key:
            return True
        member, claimed = book.get(subkey), _record_peer(entry)
        if claimed is None:  # withdrawn (a leaving tracker stores None, progress_tracker.py:353-359) or
            return True  # malformed: hivemind's own parsing skips it
        if member is None:
            members.note_unknown()
            return False
        if member.peer_id == claimed:
            return True
        if subkey not in warned:
            warned.add(subkey)
            log.warning(
                "Ignored the progress records of invite %r, which claim PeerID %s while its member record "
                "names %s",
                member.name,
                claimed,
                member.peer_id,
            )
        return False

    return keep


def keep_only(tracker: Any, keep: Any) -> None:
    """On one running ``ProgressTracker``: every read of the swarm's progress sees only the records for which
    ``keep(subkey, entry)`` is true (:func:`vouched_by`). Install it after every other wrapper of
    ``_parse_swarm_progress_data``, so that they all see what it leaves."""
    parse = tracker._parse_swarm_progress_data

    def parsed(metadata: Any) -> Any:
        if isinstance(metadata, dict):
            metadata = {key: entry for key, entry in metadata.items() if keep(key, entry)}
        return parse(metadata)

    tracker._parse_swarm_progress_data = parsed


def leave_out_banned(tracker: Any, banned: Any) -> None:
    """On one running ``ProgressTracker``: the records of peers for which ``banned(peer_id_text)`` is true
    are left out of every read (swarm/suspects.py). Left in, a banned peer still counts in
    ``num_peers``, so this peer looks for a group of two that cannot form and waits its whole matchmaking time
    every epoch, and its claimed samples still count toward the swarm's target. Call before the other
    wrappers of ``_parse_swarm_progress_data``, so that they see what it leaves."""
    parse = tracker._parse_swarm_progress_data

    def kept(entry: Any) -> bool:
        peer = _record_peer(entry)
        return peer is None or not banned(peer)

    def parsed(metadata: Any) -> Any:
        if isinstance(metadata, dict):
            metadata = {key: entry for key, entry in metadata.items() if kept(entry)}
        return parse(metadata)

    tracker._parse_swarm_progress_data = parsed


SILENT_SKEW = 1.0  # item 30: seconds by which a live peer's clock may run behind this one's


class Silent:
    """Item 30, on one running ``ProgressTracker``: the records of peers that did not come to a round are left
    out of its reads until they store a newer record. Made by :func:`leave_out_silent`; :meth:`note` marks
    the other peers of the last read but those that came.

    A peer that leaves without withdrawing its record (its p2p daemon ended with it, or it was killed) is
    counted in ``num_peers`` until the record expires (``metadata_expiration``, 60 s): this peer then looks
    for a group that cannot form, or waits for the missing peer until the group's expiration, at every epoch.
    A live peer stores a newer record at its next step, so one marked wrongly (far behind, downloading, or
    late for one round) counts again at once."""

    def __init__(self, tracker: Any, older_than: float = 0.0) -> None:
        self._tracker, self._own = tracker, tracker._local_public_key
        # only records at least this old are left out: a live peer that was late for one round has stored a
        # record within its last step, a dead one's record only ages
        self.older_than = older_than
        self._lock = threading.Lock()
        self._seen: dict[Any, tuple[float, str | None]] = {}  # the last read's other records: time, PeerID
        self._silent: dict[Any, float] = {}  # the record times left out, by subkey

    def note(self, came: Any = ()) -> int:
        """Leave out the records of the other peers of the last read, but of those whose PeerID (base58) is
        in ``came``, including their records stored up to ``SILENT_SKEW`` seconds before now; returns how
        many peers. The tracker's count drops now, and a read follows at once.

        Not only the records read: one that a peer stored just before it left can reach this peer's DHT
        node after the last read, and would count it again for another round. A live peer's next record is
        newer, unless its clock runs more than ``SILENT_SKEW`` behind this one's (then it counts again that
        much later)."""
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        upto = now - SILENT_SKEW
        with self._lock:
            gone = {
                key: max(stamp, upto)
                for key, (stamp, peer) in self._seen.items()
                if peer not in came and now - stamp >= self.older_than
            }
            self._silent.update(gone)
            for key in gone:
                del self._seen[key]
        if gone:
            seen = self._tracker.global_progress
            seen.num_peers = max(1, seen.num_peers - len(gone))
            read_within(self._tracker, 0.0)
        return len(gone)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._silent)

    def kept(self, metadata: Any) -> Any:
        if not isinstance(metadata, dict):
            return metadata
        kept, seen = {}, {}
        with self._lock:
            for key, entry in metadata.items():
                value = getattr(entry, "value", None)
                stamp = value.get("time") if isinstance(value, dict) else None
                if key != self._own and isinstance(stamp, int | float):
                    if key in self._silent:
                        if stamp <= self._silent[key]:
                            continue
                        del self._silent[key]  # a newer record: the peer is back
                    seen[key] = (float(stamp), _record_peer(entry))
                kept[key] = entry
            self._seen = seen
        return kept


def leave_out_silent(tracker: Any, older_than: float = 0.0) -> Silent:
    """Item 30: wrap ``tracker``'s reads with a :class:`Silent` (leaving out records at least ``older_than``
    seconds old at a note) and return it. Call before the other wrappers of ``_parse_swarm_progress_data``,
    so that they see what it leaves."""
    silent, parse = Silent(tracker, older_than), tracker._parse_swarm_progress_data

    def parsed(metadata: Any) -> Any:
        return parse(silent.kept(metadata))

    tracker._parse_swarm_progress_data = parsed
    return silent


@dataclass
class Reads:
    """When a tracker wrapped by :func:`discount_refused` last read the swarm's progress (time.monotonic), and
    the records it read then (before any discount)."""

    at: float = -math.inf
    records: dict = field(default_factory=dict)

    def claims(self) -> dict[str, int]:
        """The epoch that each record of the last read claimed (base58 PeerID -> epoch)."""
        return _claims(self.records.values())


def claimed_epochs(tracker: Any, timeout: float = 5.0, keep: Any = None) -> dict[str, int]:
    """Item 25: the epoch that each peer's progress record claims now (base58 PeerID -> epoch), read from
    the DHT as the tracker reads it (progress_tracker.py:246-249); records in client mode, which hivemind
    leaves out of the swarm's epoch, malformed ones and those that ``keep(subkey, entry)`` (if given) refuses
    are left out. Empty if the read fails."""
    try:
        read = tracker.dht.get(tracker.training_progress_key, latest=True, return_future=True)
        found = read.result(timeout)
    except Exception as e:  # a DHT that is shutting down, a timeout
        log.debug("Could not read the swarm's progress records: %r", e)
        return {}
    records = found.value if found is not None and isinstance(found.value, dict) else {}
    return _claims(entry for subkey, entry in records.items() if keep is None or keep(subkey, entry))


def _claims(entries: Any) -> dict[str, int]:
    """The epoch that each of these progress records claims (base58 PeerID -> epoch), without records in
    client mode and malformed ones."""
    epochs = {}
    for entry in entries:
        peer, value = _record_peer(entry), getattr(entry, "value", None)
        if peer is not None and isinstance(value, dict) and not value.get("client_mode", False):
            if isinstance(value.get("epoch"), int):
                epochs[peer] = value["epoch"]
    return epochs


def discount_refused(tracker: Any, refused: Any) -> Reads:
    """Items 24 and 25, on one running ``ProgressTracker``: the record of a peer for which
    ``refused(peer_id_text)`` is true (a donor whose state this peer refused, swarm/averaging/donors.py, or a
    peer whose epoch no donor served, swarm/patches/optimizer.py) still counts as a peer with its
    speed, but an epoch of it ahead of this peer's own counts as this peer's epoch, with none of its samples.
    hivemind takes the swarm's epoch from the largest epoch of any record (progress_tracker.py:300-303) and
    downloads whenever this peer is behind it (optimizer.py:655-673): a refused donor ahead of every other
    peer, honest or not, kept this peer downloading at every step. Returns when the reads happened, for
    :func:`swarm.patches.optimizer.decide_downloads_after_refusals`."""
    from hivemind.utils import ValueWithExpiration

    parse, reads = tracker._parse_swarm_progress_data, Reads()

    def discounted(entry: Any) -> Any:
        own, peer = tracker.local_progress.epoch, _record_peer(entry)
        try:
            ahead = entry.value["epoch"] > own
        except Exception:  # hivemind's own parsing judges a malformed record
            return entry
        if not ahead or peer is None or not refused(peer):
            return entry
        return ValueWithExpiration(
            {**entry.value, "epoch": own, "samples_accumulated": 0}, entry.expiration_time
        )

    def parsed(metadata: Any) -> Any:
        at = time.monotonic()  # before the discounts are applied: a discount that began later is not in it
        if isinstance(metadata, dict):
            reads.records = metadata  # read into claims only when a download needs them
            metadata = {key: discounted(entry) for key, entry in metadata.items()}
        reads.at = at
        return parse(metadata)

    tracker._parse_swarm_progress_data = parsed
    return reads


def pace_by_time(tracker: Any, seconds: float) -> None:
    """Item 22, on one running ``ProgressTracker``: at every read of the swarm's progress, before hivemind
    estimates the time to the target, the target batch becomes ``seconds`` times the summed speed of the
    records read (hivemind's ``target_batch_size`` is a fixed number of samples: the time between rounds
    shrinks as peers join and grows as they leave, and a DiLoCo target of peers x H x batch assumes that
    every peer computes at one speed). Every peer reads the same records, so they agree on the target to
    within a read's age. Until a record carries a speed the target stays as configured; it never drops below
    one sample. A record with a speed that is negative or not finite counts as none (hivemind's own parsing
    refuses it). Install it before :func:`leave_out_banned`, so that it sees what that leaves."""
    parse = tracker._parse_swarm_progress_data

    def parsed(metadata: Any) -> Any:
        entries = metadata.values() if isinstance(metadata, dict) else ()
        speeds = (_record_speed(e) for e in entries)
        speed = sum(v for v in speeds if math.isfinite(v) and v > 0)
        if speed > 1e-6:
            tracker.target_batch_size = max(1, round(seconds * speed))
        return parse(metadata)

    tracker._parse_swarm_progress_data = parsed


def read_soon_while_speeds_unknown(
    tracker: Any, last: LastRead | None = None, below: float = 1e-6
) -> LastRead:
    """Items 14 and 19, on one running ``ProgressTracker``: a read of the swarm's progress whose records carry
    no speed above ``below`` samples/s in all (or that finds no record) plans the next read
    ``min_refresh_period`` ahead, not ``max_refresh_period``. hivemind's speeds start at 1e-20
    (utils/performance_ema.py). Only the records count, as in hivemind's estimate: a peer that has stepped
    but not yet stored a record with its speed still reads soon. A tracker whose reads so far found nobody
    reads again within ``min_refresh_period`` of this call. Returns the :class:`LastRead` that each read
    updates (``last``, if given); call once per tracker."""
    from hivemind.utils import get_dht_time

    last = LastRead() if last is None else last
    parse = tracker._parse_swarm_progress_data

    def parsed(metadata: Any) -> Any:
        progress = parse(metadata)
        last.speed, last.peers = 0.0, 0
        try:
            entries = metadata.values() if isinstance(metadata, dict) else ()
            known = sum(_record_speed(e) for e in entries)
            last.speed, last.peers = known, progress.num_peers
            if known < below:  # no speed known, or no record at all (item 19)
                soon = get_dht_time() + tracker.min_refresh_period
                progress.next_fetch_time = min(progress.next_fetch_time, soon)
        except Exception:  # an unreadable record leaves hivemind's plan as it was; never stop the fetcher
            log.debug("Could not check the speeds in the swarm's progress records", exc_info=True)
        return progress

    tracker._parse_swarm_progress_data = parsed
    if not tracker.global_progress.num_peers:  # its first read (at its creation) may have found nobody
        read_within(tracker, tracker.min_refresh_period)
    return last


def _record_speed(entry: Any) -> float:
    """The speed (samples/s) in one record of the swarm's progress as the DHT returns it; 0 if unreadable."""
    value = getattr(entry, "value", None)
    number = value.get("samples_per_second") if isinstance(value, dict) else None
    try:
        return float(number) if isinstance(number, int | float) else 0.0
    except OverflowError:  # an integer too large for a float
        return 0.0


def expect_the_swarm(tracker: Any, last: LastRead) -> None:
    """Item 15, on one running ``ProgressTracker``: at a new epoch, the estimate of the time to the target is
    the time the swarm needs at ``last``'s summed speed (that of :func:`read_soon_while_speeds_unknown`)."""
    from hivemind.utils import get_dht_time

    update = tracker.update_epoch

    def update_epoch(new_epoch: int | None = None) -> int:
        epoch = update(new_epoch)
        seen = tracker.global_progress
        # only a fresh epoch, which hivemind left without an estimate, and only with other peers to count on
        if seen.epoch == epoch and seen.eta_next_epoch == float("inf") and last.peers > 1 and last.speed > 0:
            seen.eta_next_epoch = get_dht_time() + tracker.target_batch_size / last.speed
        return epoch

    tracker.update_epoch = update_epoch


def count_alone_exactly(tracker: Any) -> None:
    """Item 27, on one running ``ProgressTracker``: a read of the swarm's progress that finds no record but
    this peer's own leaves the time to the target unestimated ("never"), so the peer ends its epoch when its
    own samples reach the target. hivemind estimates the swarm's samples by extrapolating each record at its
    speed (progress_tracker.py:305-316) and ends the epoch once that estimate passes the target
    (``ready_to_update_epoch``, progress_tracker.py:127-134), which stands in for records not yet read. A
    peer alone knows its own count exactly: extrapolated from its last record, a step slower than its speed
    (a loaded machine, a batch whose non-finite gradients were skipped) ended its epoch short of the target.
    The samples too are its own count, not its record's: hivemind's fetcher replaces the swarm's progress with
    what its read found (progress_tracker.py:264-267), and a read that began before this peer's last reports
    (``report_local_progress`` adds them to the swarm's count without the fetcher's lock) found a record one
    or two batches behind: the peer then took a batch more for that epoch, or ended its run one epoch short.
    Not with DiLoCo, whose peer waits after its H local steps with nothing left to compute."""
    parse = tracker._parse_swarm_progress_data
    own = tracker._local_public_key

    def parsed(metadata: Any) -> Any:
        progress = parse(metadata)
        entries = metadata.items() if isinstance(metadata, dict) else ()
        others = [key for key, entry in entries if key != own and getattr(entry, "value", None) is not None]
        if not others and progress.epoch == tracker.local_progress.epoch:
            progress.eta_next_epoch = float("inf")
            progress.samples_accumulated = tracker.local_progress.samples_accumulated
        return progress

    tracker._parse_swarm_progress_data = parsed


def read_within(tracker: Any, seconds: float) -> None:
    """Have a running ``ProgressTracker`` read the swarm's progress within ``seconds`` (a no-op when its next
    read is due by then), for a peer that waits for the swarm with nothing left to compute: DiLoCo after its
    H local steps. Called on every turn of such a wait, it makes the tracker read every ``seconds``. Waking
    the fetcher with ``global_state_updated`` makes it plan its wait again from the moved ``next_fetch_time``
    (progress_tracker.py:256-263)."""
    from hivemind.utils import get_dht_time

    seen, due = tracker.global_progress, get_dht_time() + seconds
    if seen.next_fetch_time > due:
        seen.next_fetch_time = due
        tracker.global_state_updated.set()


def meet_peers(tracker: Any, count: int, stop: Any, within: float = 10.0, every: float = 0.25) -> int:
    """Before the first step of peers started together (``--min-peers``): store this peer's progress record
    now and have its running ``ProgressTracker`` read the swarm's progress every ``every`` seconds, until it
    sees ``count`` peers (this one included), ``stop`` (an Event) is set, or ``within`` seconds pass. Returns
    how many peers the tracker sees.

    A peer stores its first progress record only once it has samples (progress_tracker.py:213-216), and a
    tracker that found no peer reads again only after ``default_refresh_period``, 3 s
    (progress_tracker.py:291): peers that ``--min-peers`` released together each saw the swarm empty and
    trained alone. The record stored here is the one the reporter would store (epoch, 0 samples, no speed
    yet), so the others count this peer from the start.
    """
    from hivemind.utils import get_dht_time

    progress = tracker.local_progress
    tracker.dht.store(
        key=tracker.training_progress_key,
        subkey=tracker._local_public_key,
        value=progress.dict(),
        expiration_time=get_dht_time() + tracker.metadata_expiration,
        return_future=True,
    )
    deadline = time.monotonic() + within
    while not stop.is_set() and time.monotonic() < deadline:
        seen = tracker.global_progress
        if seen.num_peers >= count:
            break
        read_within(tracker, 0.0)
        stop.wait(every)
    return tracker.global_progress.num_peers
