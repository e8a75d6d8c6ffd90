"""What swarm/patches/progress.py changes: throttled records (item 6), reads when nobody's speed is known
(items 14 and 19), a new epoch's estimate from the last read (item 15), and reads for peers that wait."""

from __future__ import annotations

import threading
import time

import pytest

from swarm.patches import progress
from swarm.waiting import wait_until
from tests.patches.common import _two_trackers


def test_progress_is_reported_a_few_times_a_second_and_the_last_count_arrives(dhts):
    """hivemind stores a progress record after every step; throttled, a burst of 200 steps in about a second
    stores a handful, a new epoch and its first samples go out without waiting for the interval (here made
    60 s, which the test would notice), and a count held back reaches the DHT when the interval ends. The
    reporter thread is released asynchronously (in its own wait), so the test waits for each release."""
    from hivemind.optim.progress_tracker import ProgressTracker

    (first,) = dhts(1)
    tracker = ProgressTracker(first, "pytest-rounds-report", target_batch_size=10**6, start=True)
    try:
        progress.throttle_progress_reports(tracker, 0.25)
        event = tracker.should_report_progress
        began = time.monotonic()
        for step in range(1, 201):
            tracker.report_local_progress(0, step * 32)
            time.sleep(0.005)
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
            found = first.get(
                tracker.training_progress_key, latest=True
            )  # this DHT has the tracker's validators
            if found is None:
                return None
            (entry,) = [v.value for v in found.value.values()]
            return entry["epoch"], entry["samples_accumulated"]

        wait_until(lambda: latest() == (1, 32), timeout=10, interval=0.1)
        assert latest() == (1, 32)
        tracker.report_local_progress(1, 64)  # within the interval: held back, then sent when it ends
        wait_until(lambda: latest() == (1, 64), timeout=10, interval=0.1)
        assert latest() == (1, 64)
    finally:
        tracker.shutdown()


def test_a_tracker_that_finds_nobody_reads_again_within_min_refresh_period(dhts):
    """A tracker plans its first read default_refresh_period (3 s) after its creation, and the next one as
    far after every read that finds no record: peers started together each trained alone that long
    (docs/hivemind-patches.md item 19). Once item 14's wrapper is installed, it reads every
    min_refresh_period (0.5 s) while it finds nobody: at least 3 reads within 8 s (about 15 expected),
    against none (hivemind's plan here: default_refresh_period 30 s)."""
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    (node,) = dhts(1)
    tracker = ProgressTracker(
        node, "pytest-rounds-nobody", 16, default_refresh_period=30.0, private_key=RSAPrivateKey(), start=True
    )
    try:
        first = tracker.global_progress  # made at its creation, from no record: the first read 30 s ahead
        assert first.num_peers == 0
        assert first.next_fetch_time - get_dht_time() > 20.0, first
        progress.read_soon_while_speeds_unknown(tracker)
        reads, seen, deadline = 0, first, time.monotonic() + 8.0
        while time.monotonic() < deadline:
            if tracker.global_progress is not seen:
                reads, seen = reads + 1, tracker.global_progress
                assert seen.num_peers == 0 and seen.next_fetch_time - get_dht_time() <= 0.6, seen
            time.sleep(0.02)
        assert reads >= 3, reads
    finally:
        tracker.shutdown()


def test_peers_that_meet_before_their_first_samples_read_each_others_progress_soon(dhts):
    """Two trackers meet before their first samples (meet_peers): their records carry no speed, from which
    hivemind plans the next read of the swarm's progress ``max_refresh_period`` away (here 60 s), and until
    then each peer counted only its own samples: with 2 peers each computed the whole target batch in every
    epoch of its first 10 s. With item 14 the next read is ``min_refresh_period`` away: B then reaches the
    target alone, and A, which only waits, sees the swarm ready within seconds. A already knows its own speed,
    as a peer that has stepped but not yet stored a record with it: hivemind's estimate leaves that out."""
    from hivemind.utils import get_dht_time

    target, stop = 16, threading.Event()
    with _two_trackers(dhts, "pytest-rounds-speedless", target) as (a, b):
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
        assert a.global_progress.next_fetch_time - get_dht_time() <= a.min_refresh_period + 1.0
        assert not a.ready_to_update_epoch
        b.report_local_progress(0, target)  # B alone brings the swarm to the target (first samples: stored)
        assert wait_until(lambda: a.ready_to_update_epoch, timeout=20, interval=0.05), "A waits for a read"
        assert a.global_progress.samples_accumulated >= target


def test_a_peer_that_waits_for_the_swarm_reads_its_progress_again_within_min_refresh_period(dhts):
    """B's record says it is slow (0.1 samples/s), so A plans its next read more than 30 s ahead (150 s to
    the target, times 1 peer over 1 + 3 expected: hivemind's ``expected_drift_peers``). B then reaches the
    target. A, waiting as DiLoCo waits after its local steps (``read_within`` on every turn), sees the swarm
    ready within seconds, not at the planned read."""
    from hivemind.utils import get_dht_time

    target = 16
    with _two_trackers(dhts, "pytest-rounds-read-within", target) as (a, b):
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
        began = time.monotonic()

        def waiting_turn() -> bool:  # one turn of DiLoCo.outer_step's wait
            if a.ready_to_update_epoch:
                return True
            progress.read_within(a, a.min_refresh_period)
            return False

        assert wait_until(waiting_turn, timeout=20, interval=0.02), "A still waits for the planned read"
        assert time.monotonic() - began < 20
        assert a.global_progress.samples_accumulated >= target


def test_a_new_epoch_expects_the_swarm_at_the_speed_of_the_last_read(dhts):
    """Item 15: hivemind starts every epoch with the estimate "never", so until its next read a peer counts
    only its own samples, and with epochs shorter than a read apart each peer computed most of the target
    alone. A reads both records (A 30, B 50 samples/s); at its next epoch it expects the swarm's 400 samples
    5 s later (400 / 80), where hivemind expects them never."""
    from hivemind.utils import get_dht_time

    target = 400
    with _two_trackers(dhts, "pytest-rounds-expect", target) as (a, b):
        for tracker, speed in ((a, 30.0), (b, 50.0)):
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
        assert expected == pytest.approx(target / 80.0, abs=0.5), expected
        assert not ready and a.global_progress.samples_accumulated == 0
