"""What swarm/patches/state_averager.py changes: untorn downloads (item 4), judged states and downloads
(item 7), one epoch per group (item 9), bounded state matchmaking (item 12), paced donor records (item 18)."""

from __future__ import annotations

import threading
import time

import torch

from swarm.averaging.screen import RoundScreen
from swarm.patches import matchmaking, state_averager
from swarm.waiting import wait_until
from tests.patches.common import MATCHMAKING, _state_averagers


def test_an_outsized_averaged_state_is_rejected_and_the_peer_keeps_its_own(dhts):
    """A's state averager averages with B's (the same class, without a screen), whose parameters are 10,000
    times too large: A keeps its own parameters and counts the round, while B takes the mean."""
    node_a, node_b = dhts(2)
    torch.manual_seed(0)
    net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in net_b.parameters():
            p.mul_(1e4)
    before_a = [p.detach().clone() for p in net_a.parameters()]
    mean = [(p + q.detach()) / 2 for p, q in zip(before_a, net_b.parameters(), strict=True)]
    a, b = _state_averagers(
        [node_a, node_b],
        [net_a, net_b],
        "pytest-rounds-state-screen",
        min_matchmaking_time=MATCHMAKING,
        request_timeout=1.5,
    )
    screen, rejected = RoundScreen(10.0), []
    a.screen, a.on_rejected = screen, lambda *args: rejected.append(args)
    try:
        for averager in (a, b):
            matchmaking.set_target_group_size(averager, 2, {})
        opts = dict(averaging_round=True, averaging_opts=dict(timeout=MATCHMAKING + 10))
        other = threading.Thread(target=b.step, kwargs=opts)
        other.start()
        a.step(**opts)
        other.join(timeout=MATCHMAKING)
        assert not other.is_alive()
        for p, kept in zip(net_a.parameters(), before_a, strict=True):
            torch.testing.assert_close(p.detach(), kept)
        for p, m in zip(net_b.parameters(), mean, strict=True):  # the round did run: B holds the mean
            torch.testing.assert_close(p.detach(), m, rtol=1e-5, atol=1e-3)
        assert screen.rejected_state_rounds == 1, screen.__dict__
        ((kind, reason, samples),) = rejected
        assert kind == "state" and "averaged parameters have norm" in reason, rejected
    finally:
        for averager in (a, b):
            averager.shutdown()


def test_a_state_download_with_outsized_numbers_is_undone_and_an_honest_one_kept(dhts):
    """hivemind.Optimizer downloads the newest peer's state whenever a peer falls behind, so an attacker that
    runs ahead could hand its state over. A downloads twice from B (the same averager class, without a
    screen): first an honest state, which A takes whole; then one whose parameters are 10,000 times too
    large, which A undoes, keeping its own tensors but taking B's newer epoch."""
    node_a, node_b = dhts(2)
    torch.manual_seed(0)
    net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    a, b = _state_averagers([node_a, node_b], [net_a, net_b], "pytest-rounds-download")
    screen, rejected = RoundScreen(10.0), []
    a.screen, a.on_rejected = screen, lambda *args: rejected.append(args)
    try:
        b.local_epoch = b.state_sharing_priority = 5
        wait_until(lambda: a.load_state_from_peers(timeout=5) is None and a.local_epoch == 5, timeout=60)
        assert a.local_epoch == 5 and not rejected, rejected
        for p, q in zip(net_a.parameters(), net_b.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach())

        kept = [p.detach().clone() for p in net_a.parameters()]
        with torch.no_grad():
            for q in net_b.parameters():
                q.mul_(1e4)
        b.local_epoch = b.state_sharing_priority = 9
        wait_until(lambda: a.load_state_from_peers(timeout=5) is None and a.local_epoch == 9, timeout=60)
        assert a.local_epoch == 9
        for p, k in zip(net_a.parameters(), kept, strict=True):
            torch.testing.assert_close(p.detach(), k)
        assert screen.rejected_downloads == 1 and screen.rejected_state_rounds == 0, screen.__dict__
        ((kind, reason, _),) = rejected
        assert kind == "download" and "the downloaded parameters have norm" in reason, rejected
    finally:
        for averager in (a, b):
            averager.shutdown()


def test_peers_that_average_their_state_leave_the_round_at_one_epoch(dhts):
    """A peer one epoch behind that joins its groupmate's round takes the groupmate's epoch (the epochs
    differed by one in a test run, so equal parameters had different epoch numbers); a groupmate far ahead
    moves it by one epoch only, and a malformed epoch not at all."""
    node_a, node_b = dhts(2)
    a, b = _state_averagers(
        [node_a, node_b],
        [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)],
        "pytest-rounds-epochs",
        min_matchmaking_time=MATCHMAKING,
        request_timeout=1.5,
        sync_epoch_when_averaging=True,
    )

    def average(epoch_a: int, epoch_b: int) -> tuple[int, int]:
        a.local_epoch, b.local_epoch = epoch_a, epoch_b
        opts = dict(increment_epoch=True, averaging_round=True, averaging_opts=dict(timeout=MATCHMAKING + 10))
        other = threading.Thread(target=b.step, kwargs=opts)
        other.start()
        a.step(**opts)
        other.join(timeout=MATCHMAKING)
        assert not other.is_alive()
        return a.local_epoch, b.local_epoch

    try:
        for averager in (a, b):
            matchmaking.set_target_group_size(averager, 2, {})
        assert average(4, 5) == (6, 6)
        assert average(7, 100) == (9, 101)
    finally:
        for averager in (a, b):
            averager.shutdown()
    assert state_averager.sane_epochs({"a": 5, "b": "x", "c": 4, "d": True, "e": 6}, "a") == dict(
        a=5, b=5, c=5, d=5, e=6
    )
    assert state_averager.sane_epochs({"a": None, "b": 7}, "a") == {}


def test_a_state_round_without_its_group_gives_up_after_find_group_within(dhts):
    """A's state round finds no group: B, whom A counts (target group size 2), never comes, as a stranger
    stuck elsewhere would not (item 12 of swarm.averagers). The round must fail after ``find_group_within``
    (4 s), not after the step's 30 s timeout, which stays the wait for a round's result; A's parameters are
    left as they were, and the next round, which B joins, averages."""
    node_a, node_b = dhts(2)
    nets = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    with torch.no_grad():
        for value, net in zip((1.0, 3.0), nets, strict=True):
            for p in net.parameters():
                p.fill_(value)
    a, b = _state_averagers(
        [node_a, node_b], nets, "pytest-rounds-bound", min_matchmaking_time=2.0, request_timeout=1.5,
        find_group_within=4.0,
    )  # fmt: skip
    opts = dict(averaging_round=True, averaging_opts=dict(timeout=30.0))
    try:
        for averager in (a, b):
            matchmaking.set_target_group_size(averager, 2, {})
        began = time.perf_counter()
        a.step(**opts)
        alone = time.perf_counter() - began
        assert 3.5 < alone < 15.0, alone  # the deadline of 4 s, not the 30 s timeout
        assert all(torch.all(p == 1.0) for p in nets[0].parameters())
        other = threading.Thread(target=b.step, kwargs=opts)
        other.start()
        a.step(**opts)
        other.join(timeout=30)
        assert not other.is_alive()
        for net in nets:
            for p in net.parameters():
                torch.testing.assert_close(p, torch.full_like(p, 2.0))
    finally:
        for averager in (a, b):
            averager.shutdown()


def test_a_state_download_waits_for_the_donors_epoch_step_or_asks_another(dhts):
    """hivemind numbers the new epoch before the update and the state round that make it, so a download
    during A's epoch step would get the new number with a state that is not yet the epoch's. B's download,
    asked 0.5 s into A's step (a state round that finds no group for 3 s), arrives only after the step,
    with A's epoch and parameters of then. With a shorter wait than the step, A sends nothing and B keeps its
    own state."""
    node_a, node_b = dhts(2)
    torch.manual_seed(0)
    net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    a, b = _state_averagers(
        [node_a, node_b],
        [net_a, net_b],
        "pytest-rounds-settled",
        min_matchmaking_time=3.0,
        request_timeout=1.0,
        next_chunk_timeout=10.0,
    )

    def a_steps() -> tuple[threading.Thread, list[float]]:
        ended: list[float] = []

        def run() -> None:
            a.step(increment_epoch=True, averaging_round=True, averaging_opts=dict(timeout=3.0))
            ended.append(time.monotonic())

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.5)
        return thread, ended

    try:
        a.state_sharing_priority = 1
        thread, ended = a_steps()
        b.load_state_from_peers(timeout=20)
        loaded_at = time.monotonic()
        thread.join(timeout=20)
        assert ended and loaded_at >= ended[0], (ended, loaded_at)
        assert a.local_epoch == b.local_epoch == 1
        for p, q in zip(net_a.parameters(), net_b.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach())

        a.next_chunk_timeout = 1.0  # A waits for its step half of that
        a.state_sharing_priority = 2
        kept = [p.detach().clone() for p in net_b.parameters()]
        thread, _ = a_steps()
        b.load_state_from_peers(timeout=20)
        assert thread.is_alive(), "A's step ended before the download was refused: the test proves nothing"
        thread.join(timeout=20)
        assert a.local_epoch == 2 and b.local_epoch == 1
        for p, k in zip(net_b.parameters(), kept, strict=True):
            torch.testing.assert_close(p.detach(), k)
    finally:
        for averager in (a, b):
            averager.shutdown()


def test_a_donor_stores_its_changed_epoch_at_most_once_per_declare_every(dhts, monkeypatch):
    """hivemind stores a donor's record at every change of its priority (the epoch, once per global epoch);
    the swarm's state averager stores a changed priority at most every DECLARE_EVERY seconds, read when it
    stores (docs/hivemind-patches.md item 18). Three changes 0.5 s apart, within the interval after the first
    record, reach the DHT as one record with the last of them; switching sharing off goes at once."""
    monkeypatch.setattr(
        state_averager, "DECLARE_EVERY", 8.0
    )  # before the fork: the averager process reads it
    (node,) = dhts(1)
    (donor,) = _state_averagers([node], [torch.nn.Linear(4, 3)], "pytest-rounds-declare")
    key, subkey = "pytest-rounds-declare.all_averagers", donor.peer_id.to_bytes()
    seen: list = []

    def record() -> object:
        found = node.get(key, latest=True)
        entry = found.value.get(subkey) if found is not None and isinstance(found.value, dict) else None
        value = "absent" if entry is None else entry.value
        if not seen or seen[-1] != value:
            seen.append(value)
        return value

    try:
        wait_until(lambda: record() == 0.0, timeout=20)
        seen[:] = [0.0]  # a read before the averager's first store found no record
        began = time.monotonic()
        for epoch in (1, 2, 3):
            donor.state_sharing_priority = epoch
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                record()
                time.sleep(0.05)
        wait_until(lambda: record() == 3.0, timeout=20)
        assert time.monotonic() - began < 8.0 + 10.0
        assert seen == [0.0, 3.0], seen
        donor.allow_state_sharing = False
        wait_until(lambda: record() is None, timeout=5)
    finally:
        donor.shutdown()


def test_a_step_that_begins_while_the_donor_copies_its_state_is_not_sent_with_the_old_tensors(dhts):
    """hivemind numbers the new epoch as an epoch's step begins, before the update and without the tensor lock
    (state_averager.py, ``step``). A download that had passed the "step ended" check and then copied while
    the next step began sent the new epoch's number with the old tensors (in a DiLoCo test a newcomer
    announced epoch 37 and held both donors' anchor of 36). Here the copy waits for the lock, the step begins
    and numbers epoch 1, the copy proceeds, and only then does the step update: what A serves must be epoch
    1's parameters, copied again once the step ended."""
    (node_a,) = dhts(1)
    net = torch.nn.Linear(4, 3)
    (a,) = _state_averagers(
        [node_a], [net], "pytest-rounds-copy-race", next_chunk_timeout=20.0, custom_gradients=True
    )
    state_averager.lock_updates(a, a.optimizer)  # the update holds the lock, as the strategy installs it
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in net.parameters()]
    served: list = []
    trigger = threading.Event()
    copier = threading.Thread(target=lambda: served.append(a.get_current_state()), daemon=True)
    stepper = threading.Thread(
        target=lambda: a.step(increment_epoch=True, optimizer_step=True, wait_for_trigger=trigger.wait),
        daemon=True,
    )
    try:
        with a.lock_averaged_tensors:
            copier.start()  # passes the "step ended" check, then waits for the lock
            time.sleep(0.5)
            stepper.start()
            assert wait_until(lambda: a.local_epoch == 1, timeout=10)
        time.sleep(0.5)  # the copier has the lock now; the update waits for the trigger
        trigger.set()
        stepper.join(timeout=20)
        copier.join(timeout=20)
        assert not stepper.is_alive() and served, "the step or the copy did not end"
        after = [p.detach().clone() for p in net.parameters()]
        assert all(not torch.equal(x, y) for x, y in zip(before, after, strict=True))  # the step updated
        metadata, tensors, _ = served[0]
        assert metadata["epoch"] == 1
        for sent, now in zip(tensors, after, strict=False):
            torch.testing.assert_close(sent, now)
    finally:
        trigger.set()
        a.shutdown()
