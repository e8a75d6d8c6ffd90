"""What swarm/patches/progress.py changes: throttled records (item 6), reads when nobody's speed is known
(items 14 and 19), a new epoch's estimate from the last read (item 15), and reads for peers that wait
(read_within, meet_peers). Each test runs one scenario on plain hivemind (the change not applied) and with
the change."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.patches import progress
from swarm.waiting import wait_until
from tests.patches.common import PLAIN_OR_PATCHED, _two_trackers


def _read_now(tracker: ProgressTracker) -> Any:
    """Have ``tracker`` read the swarm's progress now (as meet_peers does); returns what the read found."""
    before = tracker.global_progress
    progress.read_within(tracker, 0.0)
    assert wait_until(lambda: tracker.global_progress is not before, timeout=10, interval=0.01)
    return tracker.global_progress


def _peers_and_samples(tracker: ProgressTracker) -> tuple[int, int]:
    """Have ``tracker`` read the swarm's progress soon; the peers and samples of what it holds now (a test
    waits until they are what it expects)."""
    tracker.global_progress.next_fetch_time = get_dht_time()
    tracker.global_state_updated.set()
    return tracker.global_progress.num_peers, tracker.global_progress.samples_accumulated


def _latest(tracker: ProgressTracker, node: Any) -> list[tuple[int, int]]:
    """The records of ``tracker``'s run in the DHT, read through ``node`` (a node with the tracker's
    validators): (epoch, samples accumulated) of each."""
    found = node.get(tracker.training_progress_key, latest=True)
    if found is None:
        return []
    return [(v.value["epoch"], v.value["samples_accumulated"]) for v in found.value.values()]


@PLAIN_OR_PATCHED
def test_a_step_stores_a_progress_record_on_plain_hivemind_and_not_when_throttled(dhts, patched):
    """Item 6. Twenty steps of one epoch, each taken once the reporter has taken the previous one (a demo
    step takes 13 ms, far longer than the reporter's turn). Plain hivemind stores a signed record in the DHT
    for every step (optim/progress_tracker.py:153-168 sets ``should_report_progress``, and
    ``_progress_reporter``, :195-230, stores on each set): 20 stores. Throttled (here to one record a
    minute), the epoch's first samples are stored at once and the other 19 counts are held back for the
    interval: 1 store. hivemind's event is cleared by its reporter as it stores; the throttled one stays set
    while it holds a record back, so the next step goes on at once."""
    (node,) = dhts(1)
    run = f"pytest-rounds-records-{patched}"
    stores: list[int] = []  # the samples of each record the tracker stored
    store = node.store

    def counted(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("key") == f"{run}_progress":
            stores.append(kwargs["value"]["samples_accumulated"])
        return store(*args, **kwargs)

    node.store = counted  # the tracker stores through it (progress_tracker.py:220)
    tracker = ProgressTracker(node, run, target_batch_size=10**6, start=False)
    try:
        if patched:  # before the reporter's first turn, which then waits on the throttled event only
            progress.throttle_progress_reports(tracker, 60.0)
        event, turns = tracker.should_report_progress, []
        wait = event.wait

        def turn(timeout: float | None = None) -> bool:
            turns.append(timeout)
            return wait(timeout)

        # the reporter's first turn waits 0 s and stores nothing without samples. Steps taken during it were
        # stored twice once (in a run of the suite, throttled: [640, 640]): hivemind reads the progress after
        # the wait, so a turn that timed out before step 1 stored the steps taken since, and the next turn
        # released them again as the epoch's first samples. The steps begin once that turn is over
        event.wait = turn  # the reporter looks the method up at every turn (progress_tracker.py:204)
        tracker.start()
        assert wait_until(lambda: len(turns) >= 2, timeout=10, interval=0.001), turns
        for step in range(1, 21):
            tracker.report_local_progress(0, step * 32)
            taken = wait_until(lambda: patched or not event.is_set(), timeout=10, interval=0.001)
            assert taken, step
        assert wait_until(lambda: len(stores) == (1 if patched else 20), timeout=10, interval=0.01), stores
        assert len(stores) == (1 if patched else 20) and stores[0] >= 32, stores
        assert tracker.local_progress.samples_accumulated == 640
    finally:
        tracker.shutdown()
        del node.store
        vars(tracker.should_report_progress).pop("wait", None)


def test_progress_is_reported_a_few_times_a_second_and_the_last_count_arrives(dhts):
    """Item 6, throttled: a burst of 200 steps in about a second stores a handful of records (hivemind
    stores one per step, see the test above), a new epoch and its first samples go out without waiting for
    the interval (here made 60 s, which the test would notice), and a count held back reaches the DHT when
    the interval ends. The reporter thread is released asynchronously (in its own wait), so the test waits
    for each release."""
    (first,) = dhts(1)
    tracker = ProgressTracker(first, "pytest-rounds-report", target_batch_size=10**6, start=True)
    try:
        progress.throttle_progress_reports(tracker, 0.25)
        event = tracker.should_report_progress
        began = time.monotonic()
        for step in range(1, 201):
            tracker.report_local_progress(0, step * 32)
            time.sleep(0.005)  # the pace of the burst's steps
        fired = event.fired  # read first: a deferred store after this line is not counted against the time
        seconds = time.monotonic() - began
        assert 1 <= fired <= seconds / 0.25 + 2, (fired, seconds)  # not 200
        event.interval = 60.0  # a record held back by the interval would now take a minute
        tracker.report_local_progress(1, 0)  # a new epoch is not held back (update_epoch reports 0 samples)
        assert wait_until(lambda: event.fired == fired + 1, timeout=10, interval=0.01), event.fired
        tracker.report_local_progress(1, 32)  # nor its first samples: hivemind's reporter stops storing a
        wait_until(lambda: event.fired == fired + 2, timeout=10, interval=0.01)  # peer whose recent records
        assert event.fired == fired + 2  # all had 0 samples
        event.interval = 0.25

        def latest() -> tuple[int, int] | None:
            records = _latest(tracker, first)
            return records[0] if len(records) == 1 else None

        wait_until(lambda: latest() == (1, 32), timeout=10, interval=0.1)
        assert latest() == (1, 32)
        tracker.report_local_progress(1, 64)  # within the interval: held back, then sent when it ends
        wait_until(lambda: latest() == (1, 64), timeout=10, interval=0.1)
        assert latest() == (1, 64)
    finally:
        tracker.shutdown()


def test_a_new_epoch_reported_while_the_reporter_wakes_is_not_cleared_away(dhts):
    """Item 6. hivemind's reporter clears the event after its wait returned (progress_tracker.py:204-207), so
    a set that came in between (here a new epoch) was cleared away unreleased, and the reporter slept until
    its next timeout. The release takes the set it answers; the reporter's clear leaves a later one pending.
    Driven by hand, in the reporter's order, with the tracker's reporter not started."""
    (node,) = dhts(1)
    tracker = ProgressTracker(node, "pytest-rounds-wakes", target_batch_size=10**6, start=False)
    try:
        progress.throttle_progress_reports(tracker, 60.0)
        event = tracker.should_report_progress
        tracker.report_local_progress(0, 32)
        assert event.wait(1.0) and event.fired == 1  # the reporter's wait returns...
        tracker.report_local_progress(1, 0)  # ...a new epoch is reported before it goes on...
        if event.is_set():
            event.clear()  # ...and it clears, as hivemind's reporter does
        began = time.monotonic()
        assert event.wait(5.0), "the new epoch's set was cleared away"
        assert event.fired == 2 and time.monotonic() - began < 1.0
        assert not event.wait(0.2) and event.fired == 2  # nothing else is pending
    finally:
        tracker.shutdown(timeout=0.0)  # its thread never ran: nothing to wait for


@PLAIN_OR_PATCHED
def test_a_tracker_that_finds_nobody_reads_again_within_min_refresh_period(dhts, patched):
    """Item 19. A tracker's first read, at its creation, finds no record (none is stored before a peer's
    first samples) and plans the next one default_refresh_period (3 s) ahead, as every read that finds
    nobody does (optim/progress_tracker.py:280-292): peers started together each trained alone that long.
    Plain hivemind reads at that plan and plans 3 s again. With item 14's wrapper installed the planned read
    is brought forward (within min_refresh_period, 0.5 s), and a tracker that finds nobody reads every
    0.5 s."""
    (node,) = dhts(1)
    run = f"pytest-rounds-nobody-{patched}"
    tracker = ProgressTracker(node, run, 16, private_key=RSAPrivateKey(), start=True)  # hivemind's periods
    try:
        first = tracker.global_progress  # made at its creation, from no record
        planned = first.next_fetch_time - get_dht_time()
        assert first.num_peers == 0 and 2.0 < planned <= 3.0, planned
        began = time.monotonic()
        if patched:
            progress.read_soon_while_speeds_unknown(tracker)
        reads: list[tuple[float, float, Any]] = []  # each read: when it came, its plan (s ahead), itself

        def reads_seen(count: int) -> bool:
            seen = tracker.global_progress
            if seen is not (first if not reads else reads[-1][2]):
                assert seen.num_peers == 0, seen
                reads.append((time.monotonic() - began, seen.next_fetch_time - get_dht_time(), seen))
            return len(reads) >= count

        assert wait_until(lambda: reads_seen(1), timeout=10, interval=0.01)
        (came, plan, _), *_ = reads
        if not patched:
            assert came >= planned - 0.1 and 2.0 < plan <= 3.0, reads  # at hivemind's plan, and 3 s again
            return
        assert came < min(planned, tracker.min_refresh_period + 1.0) and plan <= 0.5, reads  # brought forward
        assert wait_until(lambda: reads_seen(3), timeout=10, interval=0.01)  # and again every 0.5 s
        assert all(plan <= 0.5 for _, plan, _ in reads), reads
    finally:
        tracker.shutdown()


@PLAIN_OR_PATCHED
def test_peers_that_meet_before_their_first_samples_read_each_others_progress_soon(dhts, patched):
    """Item 14 and meet_peers. Two trackers started together find nobody: hivemind stores no record before
    a peer's first samples (optim/progress_tracker.py:213-216). meet_peers stores one and reads until both
    count two peers. Those records carry no speed, from which plain hivemind plans the next read
    ``max_refresh_period`` away (progress_tracker.py:305-331: the estimate is 16 samples over the records'
    speeds, 1e-20 samples/s each, clipped to the maximum, here 60 s), and until then each peer counted only
    its own samples: with 2 peers each computed the whole target batch in every epoch of its first 10 s. B
    then reaches the target alone: A, which only waits, does not see it (its next read is a minute away).
    With item 14 the next read is ``min_refresh_period`` away, and A sees the swarm ready within seconds. A
    already knows its own speed, as a peer that has stepped but not yet stored a record with it: hivemind's
    estimate leaves that out."""
    target, stop = 16, threading.Event()
    with _two_trackers(dhts, f"pytest-rounds-speedless-{patched}", target, patched) as (a, b):
        assert [_read_now(t).num_peers for t in (a, b)] == [0, 0]  # started together: nobody seen
        a.performance_ema.samples_per_second = 1000.0  # not in A's record, which meet_peers stores
        met: list[int] = []
        both = [
            threading.Thread(target=lambda t=t: met.append(progress.meet_peers(t, 2, stop)), daemon=True)
            for t in (a, b)
        ]
        try:
            for thread in both:
                thread.start()
            for thread in both:
                thread.join(timeout=30)
        finally:
            stop.set()  # a meet_peers still waiting returns at once
        assert sorted(met) == [2, 2]
        planned = a.global_progress.next_fetch_time - get_dht_time()
        if patched:
            assert planned <= a.min_refresh_period + 1.0, planned
        else:
            assert planned > 55.0, planned
        assert not a.ready_to_update_epoch
        b.report_local_progress(0, target)  # B alone brings the swarm to the target (first samples: stored)
        assert wait_until(lambda: (0, target) in _latest(a, a.dht), timeout=10, interval=0.05)
        ready = wait_until(lambda: a.ready_to_update_epoch, timeout=3, interval=0.05)
        if patched:
            assert ready, "A waits for a read"
            assert a.global_progress.samples_accumulated >= target
        else:
            assert not ready and a.global_progress.next_fetch_time - get_dht_time() > 45.0, a.global_progress


@PLAIN_OR_PATCHED
def test_a_peer_that_waits_for_the_swarm_reads_its_progress_again_within_min_refresh_period(dhts, patched):
    """read_within. B's record says it is slow (0.1 samples/s), so A plans its next read more than 30 s
    ahead (150 s to the target, times 1 peer over 1 + 3 expected: hivemind's ``expected_drift_peers``,
    optim/progress_tracker.py:317-331). B then reaches the target. Plain hivemind's A, waiting as DiLoCo
    waits after its local steps, sees the swarm ready only at that planned read; with ``read_within`` on
    every turn of the wait (and item 14 installed, as the strategy has it) A sees it within seconds."""
    target = 16
    with _two_trackers(dhts, f"pytest-rounds-read-within-{patched}", target, patched) as (a, b):
        b.performance_ema.samples_per_second = 0.1
        b.local_progress = b._get_local_progress(0, 1)
        b.should_report_progress.set()  # B's reporter stores the record (it has a sample)

        def a_read_b() -> bool:  # A reads the swarm's progress now, as meet_peers makes it read
            if a.global_progress.samples_accumulated >= 1:  # B's record (A stores none before its samples)
                return True
            a.global_progress.next_fetch_time = get_dht_time()
            a.global_state_updated.set()
            return False

        assert wait_until(a_read_b, timeout=20, interval=0.25)
        planned = a.global_progress.next_fetch_time - get_dht_time()
        assert planned > 30, planned  # the read hivemind planned from B's speed
        b.report_local_progress(0, target)  # B alone brings the swarm to the target
        assert wait_until(lambda: (0, target) in _latest(a, a.dht), timeout=10, interval=0.05)
        began = time.monotonic()

        def waiting_turn() -> bool:  # one turn of DiLoCo.outer_step's wait
            if a.ready_to_update_epoch:
                return True
            if patched:
                progress.read_within(a, a.min_refresh_period)
            return False

        ready = wait_until(waiting_turn, timeout=3, interval=0.02)
        if not patched:
            assert not ready and a.global_progress.next_fetch_time - get_dht_time() > 20, a.global_progress
            return
        assert ready, "A still waits for the planned read"
        assert time.monotonic() - began < 3.5
        assert a.global_progress.samples_accumulated >= target


@PLAIN_OR_PATCHED
def test_a_new_epoch_expects_the_swarm_at_the_speed_of_the_last_read(dhts, patched):
    """Item 15: plain hivemind starts every epoch with the estimate "never" (optim/progress_tracker.py:
    176-185, ``eta_next_epoch = float("inf")``), so until its next read a peer counts only its own samples,
    and with epochs shorter than a read apart each peer computed most of the target alone. A reads both
    records (A 30, B 50 samples/s); at its next epoch it expects the swarm's 400 samples 5 s later
    (400 / 80) with expect_the_swarm (and item 14, whose reads it uses), where hivemind expects them
    never."""
    target = 400
    with _two_trackers(dhts, f"pytest-rounds-expect-{patched}", target, patched=False) as (a, b):
        for tracker, speed in ((a, 30.0), (b, 50.0)):
            if patched:
                progress.expect_the_swarm(tracker, progress.read_soon_while_speeds_unknown(tracker))
            tracker.performance_ema.samples_per_second = speed
            tracker.local_progress = tracker._get_local_progress(0, 1)  # a first sample, at that speed
            tracker.should_report_progress.set()  # the reporter stores the record

        def a_read_both() -> bool:
            if a.global_progress.num_peers == 2 and a.global_progress.samples_accumulated >= 2:
                return True
            a.global_progress.next_fetch_time = get_dht_time()
            a.global_state_updated.set()
            return False

        assert wait_until(a_read_both, timeout=20, interval=0.25)
        with a.pause_updates():  # as hivemind.Optimizer moves to the next epoch; no read comes in between
            a.update_epoch(1)
            expected = a.global_progress.eta_next_epoch - get_dht_time()
            ready = a.ready_to_update_epoch
        if patched:
            assert expected == pytest.approx(target / 80.0, abs=0.5), expected
        else:
            assert expected == float("inf"), expected
        assert not ready and a.global_progress.samples_accumulated == 0


@PLAIN_OR_PATCHED
def test_a_banned_peer_is_left_out_of_the_swarms_progress(dhts, patched):
    """leave_out_banned. B has samples and a record; A's reads count it (two peers, B's samples) on plain
    hivemind. With B banned by A (swarm/suspects.py), A's reads leave B's record out: one peer, none
    of B's samples, so A neither looks for a group that B cannot join nor counts B's claims toward the
    target."""
    with _two_trackers(dhts, f"pytest-rounds-banned-{patched}", 10**6, patched) as (a, b):
        if patched:
            progress.leave_out_banned(a, lambda peer: peer == b.dht.peer_id.to_base58())
        a.report_local_progress(0, 5)
        b.report_local_progress(0, 7)

        def read() -> tuple[int, int]:
            return _peers_and_samples(a)

        expected = (1, 5) if patched else (2, 12)
        assert wait_until(lambda: read() == expected, timeout=20, interval=0.25), read()
        if patched:  # and it stays so: B's later records are left out too
            b.report_local_progress(0, 20)
            time.sleep(1.0)
            assert read() == (1, 5)


@PLAIN_OR_PATCHED
def test_a_refused_donors_epoch_ahead_counts_as_this_peers_own(dhts, patched):
    """discount_refused (item 24). B is at epoch 50 with 7 samples, A at epoch 3 with 5. On plain hivemind A's
    reads put the swarm at B's epoch 50 (A is behind and downloads). With B refused as a donor by A, A's reads
    count B as a peer (two peers) at A's own epoch, none of its samples; once B's refusal has ended, B's epoch
    counts again."""
    refused = {"until": float("inf")}
    with _two_trackers(dhts, f"pytest-rounds-refused-{patched}", 10**6, patched) as (a, b):
        if patched:
            b_id = b.dht.peer_id.to_base58()

            def is_refused(peer: str) -> bool:
                return peer == b_id and refused["until"] > time.monotonic()

            reads = progress.discount_refused(a, is_refused)
        a.report_local_progress(3, 5)
        b.report_local_progress(50, 7)

        def read() -> tuple[int, int, int]:
            a.global_progress.next_fetch_time = get_dht_time()
            a.global_state_updated.set()
            found = a.global_progress
            return found.epoch, found.num_peers, found.samples_accumulated

        expected = (3, 2, 5) if patched else (50, 2, 7)
        assert wait_until(lambda: read() == expected, timeout=20, interval=0.25), read()
        if patched:
            assert reads.at > time.monotonic() - 5
            refused["until"] = time.monotonic()
            assert wait_until(lambda: read() == (50, 2, 7), timeout=20, interval=0.25), read()


@PLAIN_OR_PATCHED
def test_the_target_follows_the_swarms_speed_when_paced_by_time(dhts, patched):
    """pace_by_time (item 22). A (30 samples/s) and B (50) have a target of 10**6 samples: on plain hivemind
    A's reads keep it, and expect it in 10**6 / 80 s. Paced to 5 s, A's reads make the target 5 x 80 = 400
    samples, expected about 5 s from the read; when B speeds up to 150 samples/s, 5 x 180 = 900."""
    target = 10**6
    with _two_trackers(dhts, f"pytest-rounds-paced-{patched}", target, patched=False) as (a, b):
        if patched:
            progress.pace_by_time(a, 5.0)
        for tracker, speed in ((a, 30.0), (b, 50.0)):
            tracker.performance_ema.samples_per_second = speed
            tracker.local_progress = tracker._get_local_progress(0, 1)
            tracker.should_report_progress.set()

        def read() -> tuple[int, int]:
            a.global_progress.next_fetch_time = get_dht_time()
            a.global_state_updated.set()
            return a.global_progress.num_peers, a.target_batch_size

        expected = 400 if patched else target
        assert wait_until(lambda: read() == (2, expected), timeout=20, interval=0.25), read()
        eta = a.global_progress.eta_next_epoch - get_dht_time()
        assert eta == pytest.approx((expected - 2) / 80.0, abs=0.6), eta
        b.performance_ema.samples_per_second = 150.0
        b.local_progress = b._get_local_progress(0, 2)
        b.should_report_progress.set()
        expected = 900 if patched else target
        assert wait_until(lambda: read() == (2, expected), timeout=20, interval=0.25), read()


@PLAIN_OR_PATCHED
def test_a_peer_alone_steps_when_its_own_samples_reach_the_target(dhts, patched):
    """Item 27. A alone has stored a record of 10 samples at 100 samples/s, target 64, and computes nothing
    more (a slow step: a loaded machine, or a batch whose non-finite gradients were skipped). Plain hivemind
    extrapolates that record (optim/progress_tracker.py:305-316) and lets A step about half a second later
    with its 10 samples; with count_alone_exactly A steps only once it counts 64, also when a read of its own
    older record lands after its last report. Once B's record is read, A's estimate is hivemind's again."""
    target = 64
    with _two_trackers(dhts, f"pytest-rounds-alone-{patched}", target, patched=False) as (a, b):
        if patched:
            progress.count_alone_exactly(a)
        a.performance_ema.samples_per_second = 100.0
        a.local_progress = a._get_local_progress(0, 10)
        a.should_report_progress.set()
        assert wait_until(lambda: _read_now(a).num_peers == 1, timeout=20, interval=0.25)
        time.sleep(max(0.0, a.global_progress.eta_next_epoch - get_dht_time()) if not patched else 1.0)
        time.sleep(0.1)
        assert a.ready_to_update_epoch is not patched, (a.global_progress, a.local_progress)
        if patched:
            assert a.global_progress.eta_next_epoch == float("inf")
            stale = a.dht.get(a.training_progress_key, latest=True)  # its record of 10 samples
            a.report_local_progress(0, 63)
            assert not a.ready_to_update_epoch
            # a read that began before that report ends after it (the fetcher's assignment,
            # progress_tracker.py:267): the count stays this peer's own, 63, not its record's 10
            a.global_progress = a._parse_swarm_progress_data(stale.value)
            assert a.global_progress.samples_accumulated == 63, a.global_progress
            a.report_local_progress(0, 64)
            assert a.ready_to_update_epoch
        b.performance_ema.samples_per_second = 50.0
        b.local_progress = b._get_local_progress(0, 1)
        b.should_report_progress.set()
        assert wait_until(lambda: _read_now(a).num_peers == 2, timeout=20, interval=0.25)
        assert a.global_progress.eta_next_epoch < float("inf")  # hivemind's estimate, patched or not


@PLAIN_OR_PATCHED
def test_a_peer_that_never_came_to_a_round_is_left_out_until_it_reports_again(dhts, patched):
    """leave_out_silent (item 30). B reported once, then went silent (it left without withdrawing its
    record: its p2p daemon ended with it). A's reads count B until the record expires, 60 s on plain
    hivemind, so A looks for a group of two at every epoch. A round that B came to leaves it counted; once a
    round that B did not come to is noted (what the optimizer's wiring does on NobodyElseLooking, or after a
    round without it), A's reads leave B's record out; a newer record from B counts again, as a live peer's
    next step stores one."""
    with _two_trackers(dhts, f"pytest-silent-{patched}", 10**6, patched) as (a, b):
        silent = progress.leave_out_silent(a) if patched else None
        a.report_local_progress(0, 5)
        b.report_local_progress(0, 7)

        def read() -> tuple[int, int]:
            return _peers_and_samples(a)

        assert wait_until(lambda: read() == (2, 12), timeout=20, interval=0.25), read()
        if not patched:  # B's record keeps counting: nothing in hivemind leaves it out before it expires
            time.sleep(1.0)
            assert read() == (2, 12)
            return
        assert silent.note(came={b.dht.peer_id.to_base58()}) == 0  # B came to the round: still counted
        assert wait_until(lambda: read() == (2, 12), timeout=20, interval=0.25), read()
        assert silent.note() == 1
        assert a.global_progress.num_peers == 1  # at once, before the next read
        assert wait_until(lambda: read() == (1, 5), timeout=20, interval=0.25), read()
        time.sleep(1.0)
        assert read() == (1, 5) and silent.count == 1  # B's old record stays left out
        b.report_local_progress(0, 9)  # B is back: a newer record
        assert wait_until(lambda: read() == (2, 14), timeout=20, interval=0.25), read()
        assert silent.count == 0


def test_a_peer_whose_record_is_fresh_is_not_left_out(dhts):
    """leave_out_silent's ``older_than`` (item 30; the optimizer's wiring passes matchmaking_time): a peer
    that was late for one round has stored a record within its last step, a dead one's record only ages. A
    note leaves out only records at least that old: B's record, just stored, stays counted; once it is old
    enough, the same note leaves it out."""
    with _two_trackers(dhts, "pytest-silent-fresh", 10**6) as (a, b):
        silent = progress.leave_out_silent(a, older_than=30.0)
        a.report_local_progress(0, 5)
        b.report_local_progress(0, 7)
        assert wait_until(lambda: _peers_and_samples(a) == (2, 12), timeout=20, interval=0.25)
        assert silent.note() == 0 and silent.count == 0
        assert _peers_and_samples(a) == (2, 12)
        silent.older_than = 0.0  # as if 30 s had passed without a newer record from B
        assert silent.note() == 1
        assert wait_until(lambda: _peers_and_samples(a) == (1, 5), timeout=20, interval=0.25)
