"""What swarm/patches/state_averager.py changes: untorn downloads (item 4), judged states and downloads
(item 7), one epoch per group (item 9), bounded state matchmaking (item 12), the epoch a download holds
(item 13), paced donor records (item 18).

Each scenario runs twice: on plain hivemind (hivemind's own TrainingStateAverager, DHT nodes with no patch
installed), where it asserts the failure that docs/hivemind-patches.md describes, and with the patches (the
state averager of ``state_averager_class``, every process-wide patch installed), where it asserts that the
failure is gone. Races are forced: a lock held, a method hooked, a step held at its trigger until a condition
holds."""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from functools import partial

import pytest
import torch
from hivemind.optim.state_averager import TrainingStateAverager

from swarm.averaging.screen import RoundScreen, total_norm
from swarm.patches import state_averager
from swarm.waiting import wait_until
from tests.patches.common import MATCHMAKING, PLAIN, PLAIN_OR_PATCHED


@pytest.fixture(autouse=True)
def _declare_every_second(monkeypatch):
    """A donor's changed epoch reaches the DHT within 1 s here, not DECLARE_EVERY's 5 s: the scenarios set a
    donor's epoch and wait for its record, and the pacing itself has its own test (which sets its own)."""
    monkeypatch.setattr(state_averager, "DECLARE_EVERY", 1.0)  # before the averagers' processes fork


def _nodes(request: pytest.FixtureRequest, patched: bool, n: int) -> list:
    """``n`` DHT nodes: every process-wide patch installed for the test (``dhts``), or none
    (``plain_dhts``)."""
    return request.getfixturevalue("dhts" if patched else "plain_dhts")(n)


def _class(patched: bool, **methods) -> type:
    """The swarm's state averager, or hivemind's own; with ``methods`` a subclass that keeps hivemind's class
    name (the p2p handlers' names are built from it)."""
    base = state_averager.state_averager_class(TrainingStateAverager) if patched else TrainingStateAverager
    return type(base.__name__, (base,), methods) if methods else base


def _averagers(cls: type | list[type], nodes: list, nets: list, prefix: str, **options) -> list:
    """A state averager of class ``cls`` (or of each class of a list; SGD, lr 0.1) on each DHT node, over each
    net's parameters."""
    sgd = partial(torch.optim.SGD, lr=0.1)
    classes = cls if isinstance(cls, list) else [cls] * len(nodes)
    built: list = []
    try:
        for c, node, net in zip(classes, nodes, nets, strict=True):
            built.append(
                c(dht=node, params=net.parameters(), prefix=prefix, optimizer=sgd, start=True, **options)
            )
    except BaseException:
        for averager in built:
            averager.shutdown()
        raise
    return built


def _shutdown(*averagers) -> None:
    for averager in averagers:
        averager.shutdown()


def _copies(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _holds(net: torch.nn.Module, expected: list[torch.Tensor]) -> bool:
    return all(torch.equal(p.detach(), e) for p, e in zip(net.parameters(), expected, strict=True))


def _donor_visible(node, prefix: str, donor) -> bool:
    """Whether ``node`` reads ``donor``'s record in the DHT (a downloader asks only the donors it reads)."""
    found = node.get(f"{prefix}.all_averagers", latest=True)
    return found is not None and isinstance(found.value, dict) and donor.peer_id.to_bytes() in found.value


def _waits_for_the_step(averager) -> threading.Event:
    """An event set when the swarm's state averager makes a download wait for an epoch's step to end (its
    ``_swarm_settled`` waited on while clear). hivemind's own never waits, and the event is never set."""
    waiting = threading.Event()
    settled = getattr(averager, "_swarm_settled", None)
    if settled is None:
        return waiting

    class Watched(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            if not self.is_set():
                waiting.set()
            return super().wait(timeout)

    watched = Watched()
    if settled.is_set():
        watched.set()
    averager._swarm_settled = watched
    return waiting


class _Either:
    """Holds once any of the events given is set."""

    def __init__(self, *events: threading.Event) -> None:
        self._events = events

    def is_set(self) -> bool:
        return any(e.is_set() for e in self._events)


def _held_step(averager, release: threading.Event | _Either) -> tuple[threading.Thread, dict]:
    """Starts ``averager``'s epoch step (increment_epoch, then the optimizer step) in a thread; the update
    waits at the step's trigger until ``release`` holds. Returns once the step has numbered the new epoch and
    waits at the trigger; ``times`` gets the monotonic time at which the step returned (key "ended")."""
    at_trigger, times = threading.Event(), {}

    def trigger() -> None:
        at_trigger.set()
        assert wait_until(release.is_set, timeout=60, interval=0.01), "the step's trigger was never released"

    def run() -> None:
        averager.step(increment_epoch=True, optimizer_step=True, wait_for_trigger=trigger)
        times["ended"] = time.monotonic()

    epoch = averager.local_epoch
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert wait_until(
        lambda: at_trigger.is_set() and averager.local_epoch == epoch + 1, timeout=20, interval=0.01
    )
    return thread, times


@PLAIN_OR_PATCHED
def test_a_download_is_the_state_the_donor_copied_not_one_its_update_changed_afterwards(request, patched):
    """Item 4, a torn download. hivemind's ``get_current_state`` (optim/state_averager.py:627-656) takes the
    tensor lock but hands over the live parameters (``param.detach().cpu()``, no copy), and the averager
    process serializes them after the lock is released (averaging/averager.py:795-805): an update that runs
    then reaches the download. Here A's update, which holds the tensor lock as ``lock_updates`` makes it,
    runs right after A's state was taken and has updated the weight but not yet the bias when the averager
    process serializes. On plain hivemind B downloads that half-applied update (the new weight with the old
    bias, a state A never held between two updates); the swarm's state averager serves the copy it took
    under the lock, A's state before the update."""
    node_a, node_b = _nodes(request, patched, 2)
    torch.manual_seed(0)
    net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    half_applied = threading.Event()

    def get_current_state(self):
        state = super(donor_class, self).get_current_state()
        with self.lock_averaged_tensors, torch.no_grad():
            net_a.weight.sub_(0.1)  # the update has reached the weight, not yet the bias
        half_applied.set()
        return state

    donor_class = _class(patched, get_current_state=get_current_state)
    a, b = _averagers([donor_class, _class(patched)], [node_a, node_b], [net_a, net_b], "pytest-sa-torn")
    try:
        before = _copies(net_a)
        assert wait_until(lambda: _donor_visible(node_b, "pytest-sa-torn", a), timeout=20)
        b.load_state_from_peers(timeout=5)
        assert half_applied.is_set() and b.local_epoch == 0
        with a.lock_averaged_tensors, torch.no_grad():
            net_a.bias.sub_(0.1)  # the rest of the update
        weight, bias = _copies(net_b)
        if patched:
            assert _holds(net_b, before)
        else:
            torch.testing.assert_close(weight, before[0] - 0.1)  # the update's new weight
            torch.testing.assert_close(bias, before[1])  # with the old bias
    finally:
        _shutdown(a, b)


@PLAIN_OR_PATCHED
def test_a_download_during_the_donors_epoch_step_never_gets_the_new_epoch_with_the_old_state(
    request, patched
):
    """Item 4, a download during an epoch's step. hivemind numbers the new epoch as the step begins
    (optim/state_averager.py:428-429) and runs the update afterwards, in ``_do`` after its trigger
    (state_averager.py:511-520). A's step is held at its trigger while B downloads.

    On plain hivemind B gets epoch 1 with A's parameters of epoch 0, which A no longer holds at epoch 1 (and
    again epoch 2 with epoch 1's parameters). The swarm's state averager makes the download wait for the step:
    when the step is released once A waits (phase 1), B gets epoch 1 with the parameters A holds at epoch 1;
    when the step is held until B's download has returned (phase 2, A waits half of ``next_chunk_timeout``,
    0.5 s), A sends nothing, which hivemind's downloader takes as "ask the next peer", and B keeps its own
    state."""
    node_a, node_b = _nodes(request, patched, 2)
    torch.manual_seed(0)
    net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    a, b = _averagers(
        _class(patched), [node_a, node_b], [net_a, net_b], "pytest-sa-settled", custom_gradients=True
    )
    for p in net_a.parameters():
        p.grad = torch.ones_like(p)
    waiting, b_done = _waits_for_the_step(a), threading.Event()
    try:
        assert wait_until(lambda: _donor_visible(node_b, "pytest-sa-settled", a), timeout=20)

        # phase 1: the step is released once B's download has returned or A waits for the step
        a.next_chunk_timeout = 10.0
        epoch_0 = _copies(net_a)
        thread, times = _held_step(a, _Either(b_done, waiting))
        b.load_state_from_peers(timeout=20)
        loaded_at = time.monotonic()
        b_done.set()
        thread.join(timeout=20)
        assert not thread.is_alive() and a.local_epoch == 1 and b.local_epoch == 1
        epoch_1 = _copies(net_a)
        assert not _holds(net_a, epoch_0)  # the step updated
        if patched:
            assert loaded_at >= times["ended"], (times, loaded_at)
            assert _holds(net_b, epoch_1)
        else:
            assert loaded_at < times["ended"], (times, loaded_at)
            assert _holds(net_b, epoch_0)  # epoch 1 with epoch 0's parameters

        # phase 2: the step is held until B's download has returned
        a.next_chunk_timeout = 1.0
        kept, b_done = _copies(net_b), threading.Event()
        thread, times = _held_step(a, b_done)
        b.load_state_from_peers(timeout=20)
        b_done.set()
        thread.join(timeout=20)
        assert not thread.is_alive() and a.local_epoch == 2
        if patched:
            assert b.local_epoch == 1 and _holds(net_b, kept)  # nothing was sent
        else:
            assert b.local_epoch == 2 and _holds(net_b, epoch_1)  # epoch 2 with epoch 1's parameters
        assert not _holds(net_a, epoch_1)
    finally:
        b_done.set()  # a step still held at its trigger ends
        _shutdown(a, b)


@PLAIN_OR_PATCHED
def test_a_peer_loading_a_download_never_serves_the_downloaded_state_with_its_old_epoch(request, patched):
    """Item 4, a download from a peer that is loading one of its own. hivemind copies the downloaded tensors
    under the lock (optim/state_averager.py:682-690) and numbers their epoch only after it (line 697), having
    copied them into what its averager sends (``_load_local_tensors_into_averager_``, line 695) in between. A
    downloads B's state of epoch 5 and is held there; C downloads from the newest donor, A (priority 10).

    On plain hivemind C gets B's tensors numbered with A's old epoch 0 (in a localhost swarm, a newcomer's
    download check then compared epoch 6's tensors with the swarm's records of epoch 0 and refused an honest
    donor). The swarm's state averager serves nothing until A's download is done (C waits half of A's
    ``next_chunk_timeout``, then asks the next donor, B): C holds B's state at epoch 5."""
    prefix = "pytest-sa-loading"
    nodes = _nodes(request, patched, 3)
    torch.manual_seed(0)
    nets = [torch.nn.Linear(4, 3) for _ in range(3)]
    base = _class(patched)
    held, c_done = threading.Event(), threading.Event()

    def hold_once(self) -> None:  # A, between hivemind's copy of the download and its epoch
        if getattr(self, "hold_next_copy", False):
            self.hold_next_copy = False
            held.set()
            c_done.wait(timeout=30)
        base._load_local_tensors_into_averager_(self)

    a, b, c = _averagers(
        [_class(patched, _load_local_tensors_into_averager_=hold_once), base, base], nodes, nets, prefix
    )
    at_b = _copies(nets[1])
    loading = threading.Thread(target=lambda: a.load_state_from_peers(timeout=20), daemon=True)
    try:
        b.local_epoch = 5
        a.state_sharing_priority, b.state_sharing_priority = 10, 5
        a.next_chunk_timeout = 2.0
        expected = {a.peer_id.to_bytes(): 10, b.peer_id.to_bytes(): 5}
        for node in nodes:
            assert wait_until(lambda n=node: expected.items() <= _priorities(n, prefix).items(), timeout=30)

        a.hold_next_copy = True
        loading.start()
        assert held.wait(timeout=30), "A never downloaded B's state"
        assert a.local_epoch == 0 and _holds(nets[0], at_b)  # the tensors are in, the epoch not yet
        c.load_state_from_peers(timeout=10)
        c_done.set()
        loading.join(timeout=30)
        assert not loading.is_alive() and a.local_epoch == 5 and _holds(nets[0], at_b)
        assert _holds(nets[2], at_b)
        if patched:
            assert c.local_epoch == 5  # from B, after A sent nothing
        else:
            assert c.local_epoch == 0  # epoch 5's tensors under A's old number
    finally:
        c_done.set()
        _shutdown(a, b, c)


@PLAIN_OR_PATCHED
def test_a_peer_waiting_for_its_own_download_serves_its_own_state(request, patched):
    """Item 4 serves nothing while a downloaded state is applied, judged and numbered, and only then: before
    the state arrives the peer's own state stands. Peers that start together download from each other; when
    the swarm's state averager served nothing for the whole download, each waited half of the other's
    ``next_chunk_timeout`` (the demo's peers, forked at once: 5 s each) and then asked another donor. Here B
    downloads from D, whose answer is held; meanwhile A downloads from the newest donor, B. On plain hivemind
    and with the patches A gets B's own state (epoch 3) at once; then D answers and B holds D's (epoch 6)."""
    prefix = "pytest-sa-both-loading"
    nodes = _nodes(request, patched, 3)
    torch.manual_seed(0)
    nets = [torch.nn.Linear(4, 3) for _ in range(3)]
    base = _class(patched)
    asked, release = threading.Event(), threading.Event()

    def hold_first(self):  # D: its first download (B's) waits for the test
        if not asked.is_set():
            asked.set()
            release.wait(timeout=30)
        return base.get_current_state(self)

    a, b, d = _averagers([base, base, _class(patched, get_current_state=hold_first)], nodes, nets, prefix)
    at_b, at_d = _copies(nets[1]), _copies(nets[2])
    loading = threading.Thread(target=lambda: b.load_state_from_peers(timeout=20), daemon=True)
    try:
        b.local_epoch, d.local_epoch = 3, 6
        a.state_sharing_priority, b.state_sharing_priority, d.state_sharing_priority = 1, 10, 5
        b.next_chunk_timeout = 4.0
        expected = {a.peer_id.to_bytes(): 1, b.peer_id.to_bytes(): 10, d.peer_id.to_bytes(): 5}
        for node in nodes:
            assert wait_until(lambda n=node: expected.items() <= _priorities(n, prefix).items(), timeout=30)

        loading.start()
        assert asked.wait(timeout=30), "B never asked D"
        a.load_state_from_peers(timeout=8)
        assert a.local_epoch == 3 and _holds(nets[0], at_b), "A did not get B's own state"
        release.set()
        loading.join(timeout=30)
        assert not loading.is_alive() and b.local_epoch == 6 and _holds(nets[1], at_d)
    finally:
        release.set()
        _shutdown(a, b, d)


class _AskedLock:
    """A tensor lock (delegating to the averager's) that notes when a thread other than the test's asks for
    it with ``with``, as ``get_current_state`` does."""

    def __init__(self, lock) -> None:
        self._lock, self.asked = lock, threading.Event()

    def acquire(self, *args, **kwargs) -> bool:
        return self._lock.acquire(*args, **kwargs)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        if threading.current_thread() is not threading.main_thread():
            self.asked.set()
        return self._lock.__enter__()

    def __exit__(self, *exc) -> None:
        return self._lock.__exit__(*exc)


@PLAIN_OR_PATCHED
def test_a_step_that_begins_while_the_donor_copies_its_state_is_not_sent_with_the_old_tensors(
    request, patched
):
    """Item 4, a step that begins during the copy. hivemind numbers the new epoch as an epoch's step begins,
    before the update and without the tensor lock (optim/state_averager.py:428-429), and its
    ``get_current_state`` reads the epoch after it copied (state_averager.py:651-653). B's download reaches
    A's ``get_current_state``, which waits for the tensor lock (the test holds it); A's step begins, numbers
    epoch 1 and waits at its trigger; the lock is released, the copy proceeds, and only then (once B's
    download has returned, or A waits for the step) does the update run.

    On plain hivemind B gets epoch 1 with epoch 0's parameters (in a DiLoCo test a newcomer announced epoch
    37 and held both donors' anchor of 36). The swarm's state averager sees that a step began while it copied,
    waits for the step to end and copies again: B gets epoch 1's parameters."""
    node_a, node_b = _nodes(request, patched, 2)
    torch.manual_seed(0)
    net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    a, b = _averagers(
        _class(patched), [node_a, node_b], [net_a, net_b], "pytest-sa-copy-race", next_chunk_timeout=20.0,
        custom_gradients=True,
    )  # fmt: skip
    lock = a.lock_averaged_tensors
    a.lock_averaged_tensors = watched_lock = _AskedLock(lock)
    if patched:
        state_averager.lock_updates(a, a.optimizer)  # the update holds the lock, as the strategy installs it
    for p in net_a.parameters():
        p.grad = torch.ones_like(p)
    waiting, b_done = _waits_for_the_step(a), threading.Event()

    def download() -> None:
        try:
            b.load_state_from_peers(timeout=20)
        finally:
            b_done.set()

    downloader = threading.Thread(target=download, daemon=True)
    try:
        assert wait_until(lambda: _donor_visible(node_b, "pytest-sa-copy-race", a), timeout=20)
        epoch_0 = _copies(net_a)
        with lock:
            downloader.start()
            assert wait_until(
                watched_lock.asked.is_set, timeout=20, interval=0.01
            )  # the copy waits for the lock
            thread, times = _held_step(a, _Either(b_done, waiting))
        downloader.join(timeout=30)
        thread.join(timeout=20)
        assert not downloader.is_alive() and not thread.is_alive()
        assert a.local_epoch == b.local_epoch == 1
        epoch_1 = _copies(net_a)
        assert not _holds(net_a, epoch_0)  # the step updated
        assert _holds(net_b, epoch_1 if patched else epoch_0)
    finally:
        b_done.set()  # a step still held at its trigger ends
        _shutdown(a, b)


@PLAIN_OR_PATCHED
def test_an_outsized_averaged_state_is_applied_on_plain_hivemind_and_rejected_by_the_screen(request, patched):
    """Item 7, a state round. A averages with B, whose parameters are 10,000 times too large; A has a
    RoundScreen (factor 10), B none. hivemind copies the group's mean into the model unchecked
    (optim/state_averager.py:605-621, ``_apply_averaging_results_``): on plain hivemind A holds the mean,
    whose norm is about 5,000 times A's own. The swarm's state averager has the screen judge it first: A
    keeps its own parameters and counts the round. B (no screen) holds the mean either way, so the round did
    run."""
    node_a, node_b = _nodes(request, patched, 2)
    torch.manual_seed(0)
    net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in net_b.parameters():
            p.mul_(1e4)
    before_a = _copies(net_a)
    mean = [(p + q.detach()) / 2 for p, q in zip(before_a, net_b.parameters(), strict=True)]
    a, b = _averagers(
        _class(patched), [node_a, node_b], [net_a, net_b], "pytest-sa-state-screen",
        min_matchmaking_time=MATCHMAKING, request_timeout=1.5, target_group_size=2,
    )  # fmt: skip
    screen, rejected = RoundScreen(10.0), []
    a.screen, a.on_rejected = screen, lambda *args: rejected.append(args)  # unused by hivemind's own
    try:
        opts = dict(averaging_round=True, averaging_opts=dict(timeout=MATCHMAKING + 10))
        other = threading.Thread(target=b.step, kwargs=opts)
        other.start()
        a.step(**opts)
        other.join(timeout=MATCHMAKING)
        assert not other.is_alive()
        for p, m in zip(net_b.parameters(), mean, strict=True):  # the round did run: B holds the mean
            torch.testing.assert_close(p.detach(), m, rtol=1e-5, atol=1e-3)
        if patched:
            for p, kept in zip(net_a.parameters(), before_a, strict=True):
                torch.testing.assert_close(p.detach(), kept)
            assert screen.rejected_state_rounds == 1, screen.__dict__
            ((kind, reason, samples),) = rejected
            assert kind == "state" and "averaged parameters have norm" in reason, rejected
        else:
            for p, m in zip(net_a.parameters(), mean, strict=True):
                torch.testing.assert_close(p.detach(), m, rtol=1e-5, atol=1e-3)
            assert total_norm(list(net_a.parameters())) > 1000 * total_norm(before_a)
            assert screen.rejected == 0 and not rejected
    finally:
        _shutdown(a, b)


@PLAIN_OR_PATCHED
def test_a_state_download_with_outsized_numbers_is_applied_on_plain_hivemind_and_undone_by_the_screen(
    request, patched
):
    """Item 7, a download. hivemind.Optimizer downloads the newest peer's state whenever a peer falls behind,
    and hivemind copies what it downloaded into the model unchecked (optim/state_averager.py:658-698), so an
    attacker that runs ahead hands its state over. A (with a RoundScreen, factor 10) downloads twice from B
    (no screen): first an honest state, which A takes whole either way; then one whose parameters are 10,000
    times too large. On plain hivemind A takes that one too; the swarm's state averager undoes it, keeping
    A's own tensors but taking B's newer epoch.

    Item 13, the state averager's side (``held_epoch``): after the honest download of epoch 5, A takes epoch 6
    as hivemind.Optimizer's catch-up does when the state is one epoch older than the swarm's ("Catching up
    with collaboration step", optim/optimizer.py:705-707). Plain hivemind's state averager keeps no note of
    the epoch its tensors are (no ``held_epoch``; its only epoch is the 6 it was given); the swarm's notes 5,
    which ``download_the_epoch_it_names`` reads."""
    node_a, node_b = _nodes(request, patched, 2)
    torch.manual_seed(0)
    net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    a, b = _averagers(_class(patched), [node_a, node_b], [net_a, net_b], "pytest-sa-download")
    screen, rejected = RoundScreen(10.0), []
    a.screen, a.on_rejected = screen, lambda *args: rejected.append(args)  # unused by hivemind's own
    try:
        b.local_epoch = b.state_sharing_priority = 5
        wait_until(lambda: a.load_state_from_peers(timeout=5) is None and a.local_epoch == 5, timeout=60)
        assert a.local_epoch == 5 and not rejected, rejected
        assert _holds(net_a, _copies(net_b))
        a.local_epoch = 6  # hivemind.Optimizer's catch-up
        assert getattr(a, "held_epoch", None) == (5 if patched else None)

        kept = _copies(net_a)
        with torch.no_grad():
            for q in net_b.parameters():
                q.mul_(1e4)
        b.local_epoch = b.state_sharing_priority = 9
        wait_until(lambda: a.load_state_from_peers(timeout=5) is None and a.local_epoch == 9, timeout=60)
        assert a.local_epoch == 9
        if patched:
            assert _holds(net_a, kept)
            assert screen.rejected_downloads == 1 and screen.rejected_state_rounds == 0, screen.__dict__
            ((kind, reason, _),) = rejected
            assert kind == "download" and "the downloaded parameters have norm" in reason, rejected
        else:
            assert _holds(net_a, _copies(net_b))  # the outsized state
            assert screen.rejected == 0 and not rejected
    finally:
        _shutdown(a, b)


@PLAIN_OR_PATCHED
def test_a_download_at_this_peers_own_epoch_is_judged_too(request, patched):
    """Item 7, a download at the downloader's own epoch. hivemind loads any state whose epoch is not behind
    its own (optim/state_averager.py:673), and ``download_the_epoch_it_names`` (item 13) downloads again at
    the epoch it kept: an outsized state from a donor at that same epoch must be judged as much as a newer
    one. On plain hivemind A takes it; the swarm's state averager rejects it and keeps A's own parameters."""
    node_a, node_b = _nodes(request, patched, 2)
    torch.manual_seed(0)
    net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    with torch.no_grad():
        for q in net_b.parameters():
            q.mul_(1e4)
    a, b = _averagers(_class(patched), [node_a, node_b], [net_a, net_b], "pytest-sa-same-epoch")
    screen, rejected = RoundScreen(10.0), []
    a.screen, a.on_rejected = screen, lambda *args: rejected.append(args)
    try:
        kept, outsized = _copies(net_a), _copies(net_b)
        b.state_sharing_priority = 1  # both at epoch 0; B is a donor
        assert wait_until(lambda: _donor_visible(node_a, "pytest-sa-same-epoch", b), timeout=30)
        if patched:
            assert wait_until(lambda: a.load_state_from_peers(timeout=5) is None and rejected, timeout=60)
            assert a.local_epoch == 0 and _holds(net_a, kept)
            ((kind, reason, _),) = rejected
            assert kind == "download" and "the downloaded parameters have norm" in reason, reason
        else:
            assert wait_until(
                lambda: a.load_state_from_peers(timeout=5) is None and _holds(net_a, outsized), timeout=60
            )
            assert a.local_epoch == 0 and screen.rejected == 0
    finally:
        _shutdown(a, b)


@PLAIN_OR_PATCHED
def test_a_download_judges_and_undoes_the_optimizer_state_the_rounds_do_not_average(request, patched):
    """Item 7, the rest of a download. hivemind's download replaces the optimizer's whole state dict
    (``load_optimizer_state``, optim/state_averager.py:686 and 732-740): the momentum buffers that no state
    round averages (SGD's here; DiLoCo's outer momentum) and the hyperparameters of every group. A donor with
    momentum 10^6 times an honest one and a weight decay of 1000 hands both over on plain hivemind. The
    swarm's state averager judges the whole optimizer state, rejects the download and puts A's own state
    back; and it never takes a donor's hyperparameters, even from an honest download."""
    node_a, node_b = _nodes(request, patched, 2)
    torch.manual_seed(0)
    net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    momentum = partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01)
    cls = _class(patched)
    a, b = (
        cls(dht=node, params=net.parameters(), prefix="pytest-sa-optstate", optimizer=momentum, start=True)
        for node, net in ((node_a, net_a), (node_b, net_b))
    )
    screen, rejected = RoundScreen(10.0), []
    a.screen, a.on_rejected = screen, lambda *args: rejected.append(args)
    try:
        for averager in (a, b):  # one honest update each: the momentum buffers exist
            for p in averager.main_parameters:
                p.grad = torch.ones_like(p)
            averager.step(optimizer_step=True)
        with torch.no_grad():  # B's momentum (and only its momentum) turns outsized
            for p in b.main_parameters:
                b.optimizer.state[p]["momentum_buffer"].mul_(1e6)
        own = [a.optimizer.state[p]["momentum_buffer"].clone() for p in a.main_parameters]
        b.optimizer.param_groups[0]["weight_decay"] = 1000.0
        b.local_epoch, b.state_sharing_priority = 3, 3
        assert wait_until(lambda: _donor_visible(node_a, "pytest-sa-optstate", b), timeout=30)
        assert wait_until(
            lambda: a.load_state_from_peers(timeout=5) is None and a.local_epoch == 3, timeout=60
        )
        got = [a.optimizer.state[p]["momentum_buffer"] for p in a.main_parameters]
        if patched:
            ((kind, reason, _),) = rejected
            assert kind == "download" and "the downloaded optimizer state have norm" in reason, reason
            assert all(torch.equal(g, o) for g, o in zip(got, own, strict=True))
            assert a.optimizer.param_groups[0]["weight_decay"] == 0.01
        else:
            assert total_norm(got) > 1e5 * total_norm(own)
            assert a.optimizer.param_groups[0]["weight_decay"] == 1000.0
            assert not rejected
    finally:
        _shutdown(a, b)


@pytest.mark.parametrize("mode", [pytest.param("plain hivemind", marks=PLAIN), "patched", "checked"])
def test_a_download_cut_short_is_dropped_whole_not_failed_with_an_error(request, mode, caplog):
    """Item 29. A donor whose stream ends early, here one that sends its state without the last tensor of its
    optimizer state (SGD's momentum buffer): hivemind looks the optimizer's tensors up by the indices the
    metadata names and raises IndexError (optim/state_averager.py:737), which hivemind.Optimizer logs as an
    ERROR with its traceback and retries at once (optimizer.py:693-703). The swarm's state averager drops the
    state before any of it is applied, says why in one line, and keeps its own parameters, optimizer state
    and epoch; with the download check (item 23) the donor is refused, as a contradicted one is."""
    from swarm.averaging.donors import DonorCheck

    patched = mode != "plain hivemind"
    node_a, node_b = _nodes(request, patched, 2)
    torch.manual_seed(0)
    net_a, net_b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    momentum = partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    base = _class(patched)

    def cut_short(self):
        metadata, tensors, infos = base.get_current_state(self)
        return metadata, tensors[:-1], infos[:-1]

    prefix = f"pytest-sa-cut-short-{mode.replace(' ', '-')}"
    a = base(dht=node_a, params=net_a.parameters(), prefix=prefix, optimizer=momentum, start=True)
    try:
        b = _class(patched, get_current_state=cut_short)(
            dht=node_b, params=net_b.parameters(), prefix=prefix, optimizer=momentum, start=True
        )
    except BaseException:
        a.shutdown()
        raise
    raised: list[BaseException] = []
    refused: list = []
    if mode == "checked":
        a.check_download = DonorCheck(node_a, f"{prefix}-run", a.peer_id.to_base58())
        a.on_refused = lambda donor, reason: refused.append((donor, reason))

    def download() -> object:
        try:
            return a.load_state_from_peers(timeout=5)
        except IndexError as exc:  # plain hivemind's failure
            raised.append(exc)
            return exc

    try:
        for averager in (a, b):  # one update each: the momentum buffers exist
            for p in averager.main_parameters:
                p.grad = torch.ones_like(p)
            averager.step(optimizer_step=True)
        kept = _copies(net_a)
        own = [a.optimizer.state[p]["momentum_buffer"].clone() for p in a.main_parameters]
        b.local_epoch, b.state_sharing_priority = 3, 3
        assert wait_until(lambda: _donor_visible(node_a, prefix, b), timeout=30)
        if not patched:
            assert wait_until(lambda: isinstance(download(), IndexError), timeout=60)
            assert "list index out of range" in str(raised[-1])
            return
        assert wait_until(lambda: download() is None and a._swarm_not_whole is not None, timeout=60)
        assert not raised
        why = "its optimizer state names tensor 1, and 1 optimizer tensors arrived"
        assert why in a._swarm_not_whole
        got = [a.optimizer.state[p]["momentum_buffer"] for p in a.main_parameters]
        assert all(torch.equal(g, o) for g, o in zip(got, own, strict=True))
        assert _holds(net_a, kept) and a.local_epoch == 0 and not a.donor_answered
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        if mode == "checked":  # its caller says why (the strategy's warning), once
            ((donor, reason),) = refused
            assert donor == b.peer_id.to_base58() and why in reason and donor in a.refused_donors
            assert not any(m.startswith("Dropped a state downloaded") for m in said), said
        else:
            assert any(m.startswith("Dropped a state downloaded from a peer: its") for m in said), said
    finally:
        _shutdown(a, b)


@pytest.mark.parametrize("waits", [False, True], ids=["given up at the timeout", "waited for"])
def test_a_download_whose_chunks_keep_coming_is_waited_for_past_the_timeout(request, waits, monkeypatch):
    """Item 37. A donor behind a slow uplink sends its state a chunk every 0.3 s, about 6 s in all, to a
    downloader that allows 2 s (``load_state_timeout``). hivemind gives up at 2 s and raises TimeoutError
    (averaging/averager.py:682; hivemind.Optimizer then asks again), while the averager process goes on with
    the first download, which lands on a future nobody reads. The swarm's state averager waits while the
    chunks keep coming, and the state arrives."""
    import asyncio
    from typing import get_type_hints

    from swarm.averaging.donors import DonorCheck

    node_a, node_b = _nodes(request, True, 2)
    torch.manual_seed(0)
    net_a, net_b = (torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(10))) for _ in range(2))
    base = _class(True)

    async def slowly(self, _request, context):
        async for message in base.rpc_download_state(self, _request, context):
            await asyncio.sleep(0.3)
            yield message

    # the p2p handler's types are read from its annotations (hivemind/p2p/servicer.py)
    slowly.__annotations__ = get_type_hints(base.rpc_download_state)

    prefix = f"pytest-sa-slow-donor-{waits}"
    if not waits:  # the downloader as hivemind waits: one limit for the whole download
        monkeypatch.setattr(state_averager, "DOWNLOAD_CAP", 1)
    # the downloader's wait for a chunk (request_timeout, without next_chunk_timeout): far above 0.3 s, so
    # that a donor's process starved for a moment on a busy machine does not end the download
    a = base(dht=node_a, params=net_a.parameters(), prefix=prefix, optimizer=partial(torch.optim.SGD, lr=0.1),
             start=True, request_timeout=5.0)  # fmt: skip
    try:
        b = _class(True, rpc_download_state=slowly)(
            dht=node_b, params=net_b.parameters(), prefix=prefix, optimizer=partial(torch.optim.SGD, lr=0.1),
            start=True,
        )  # fmt: skip
    except BaseException:
        a.shutdown()
        raise
    a.check_download = DonorCheck(node_a, f"{prefix}-run", a.peer_id.to_base58())
    try:
        b.local_epoch, b.state_sharing_priority = 3, 3
        assert wait_until(lambda: _donor_visible(node_a, prefix, b), timeout=30)
        began = time.monotonic()
        if not waits:
            with pytest.raises(TimeoutError):
                a.load_state_from_peers(timeout=2.0)
            assert time.monotonic() - began < 4 and a.local_epoch == 0 and not _holds(net_a, _copies(net_b))
            return
        a.load_state_from_peers(timeout=2.0)
        took = time.monotonic() - began
        assert took > 2.0 and a.donor_answered and a.local_epoch == 3, (took, a.local_epoch)
        assert _holds(net_a, _copies(net_b))
    finally:
        _shutdown(a, b)


@PLAIN_OR_PATCHED
def test_peers_that_average_their_state_leave_the_round_at_one_epoch(request, patched):
    """Item 9. With ``sync_epoch_when_averaging`` every member of a state round takes the largest epoch it
    gathered, whatever it is (optim/state_averager.py:558-564). A peer one epoch behind that joins its
    groupmate's round takes the groupmate's epoch, either way (the epochs differed by one in a test run, so
    equal parameters had different epoch numbers). On plain hivemind a groupmate 93 epochs ahead moves A to
    its epoch (101), and one with a malformed epoch (a float, 21.5) makes A's epoch that float; with the
    swarm's state averager the first moves A by one epoch only (9), the second not at all (11)."""
    node_a, node_b = _nodes(request, patched, 2)
    a, b = _averagers(
        _class(patched), [node_a, node_b], [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)], "pytest-sa-epochs",
        min_matchmaking_time=MATCHMAKING, request_timeout=1.5, target_group_size=2,
        sync_epoch_when_averaging=True,
    )  # fmt: skip

    def average(epoch_a: float, epoch_b: float) -> tuple[float, float]:
        a.local_epoch, b.local_epoch = epoch_a, epoch_b
        opts = dict(increment_epoch=True, averaging_round=True, averaging_opts=dict(timeout=MATCHMAKING + 10))
        other = threading.Thread(target=b.step, kwargs=opts)
        other.start()
        a.step(**opts)
        other.join(timeout=MATCHMAKING)
        assert not other.is_alive()
        return a.local_epoch, b.local_epoch

    try:
        assert average(4, 5) == (6, 6)
        assert average(7, 100) == ((9, 101) if patched else (101, 101))
        assert average(10, 20.5) == ((11, 21.5) if patched else (21.5, 21.5))
    finally:
        _shutdown(a, b)


def test_sane_epochs_keeps_a_groupmates_epoch_within_one_of_this_peers():
    """Item 9, the rule itself: each gathered epoch, an int from this peer's own epoch up to one more;
    nothing when this peer's own is malformed."""
    assert state_averager.sane_epochs({"a": 5, "b": "x", "c": 4, "d": True, "e": 6}, "a") == dict(
        a=5, b=5, c=5, d=5, e=6
    )
    assert state_averager.sane_epochs({"a": 5, "b": 100, "c": 5.5}, "a") == dict(a=5, b=6, c=5)
    assert state_averager.sane_epochs({"a": None, "b": 7}, "a") == {}


@PLAIN_OR_PATCHED
def test_a_state_round_without_its_group_gives_up_after_find_group_within(request, patched):
    """Item 12. A's state round finds no group: B, whom A expects (target group size 2), does not come, as a
    stranger stuck elsewhere would not. hivemind's ``_do`` passes one ``timeout`` (here 5 s) both as the
    matchmaking deadline (optim/state_averager.py:502-509; averaging/averager.py:398 and the retries until it,
    averager.py:479) and as the wait for the round's result (state_averager.py:550). On plain hivemind A
    looks for its group for the whole 5 s; the swarm's state averager gives up after ``find_group_within``
    (2 s). A's parameters are left as they were, and the next round, which B joins, averages either way."""
    node_a, node_b = _nodes(request, patched, 2)
    nets = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    with torch.no_grad():
        for value, net in zip((1.0, 3.0), nets, strict=True):
            for p in net.parameters():
                p.fill_(value)
    timeout, within = 5.0, 2.0
    a, b = _averagers(
        _class(patched), [node_a, node_b], nets, "pytest-sa-bound", min_matchmaking_time=1.0,
        request_timeout=0.8, target_group_size=2, **(dict(find_group_within=within) if patched else {}),
    )  # fmt: skip
    opts = dict(averaging_round=True, averaging_opts=dict(timeout=timeout))
    try:
        began = time.perf_counter()
        a.step(**opts)
        alone = time.perf_counter() - began
        if patched:
            assert within - 0.5 < alone < timeout - 1.0, alone
        else:
            assert alone > timeout - 0.5, alone
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
        _shutdown(a, b)


async def _stall(self, seconds: float) -> None:
    """Blocks the averager process's event loop, as a busy machine can: the messages sent after it wait."""
    time.sleep(seconds)


def test_find_group_within_counts_from_when_the_round_is_asked_for(dhts):
    """Item 12 on a busy machine: the step that asks for a state round waits in the averager process's pipe
    while that process is held up (here 3 s). The round still gives up ``find_group_within`` (2 s) after it
    was asked for, once the averager process reads it; a deadline counted from that reading looked for the
    group 2 s more (5 s in all)."""
    nets = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    timeout, within, stall = 8.0, 2.0, 3.0
    (a,) = _averagers(
        _class(True, _stall=_stall), dhts(1), nets[:1], "pytest-sa-asked", min_matchmaking_time=1.0,
        request_timeout=0.8, target_group_size=2, find_group_within=within,
    )  # fmt: skip
    try:
        a._outer_pipe.send(("_stall", [stall], {}))
        began = time.perf_counter()
        a.step(averaging_round=True, averaging_opts=dict(timeout=timeout))
        alone = time.perf_counter() - began
        assert stall - 0.5 < alone < stall + within - 1.0, alone
    finally:
        _shutdown(a)


@PLAIN_OR_PATCHED
def test_a_donor_stores_its_changed_epoch_at_most_once_per_declare_every(request, patched, monkeypatch):
    """Item 18. hivemind's donor stores its record in the DHT at every change of ``state_sharing_priority``
    (averaging/averager.py:243-249 and 600-625), and hivemind.Optimizer changes it at every global epoch. The
    donor's priority changes to 1, 2 and 3, each change after the one before was stored or 1.5 s passed; the
    stores of the donor's record are noted in its averager process.

    On plain hivemind each change is stored at once: 0, 1, 2, 3. The swarm's state averager stores a changed
    priority at most every DECLARE_EVERY (8 s here), reading it when it stores: 0, then 3, at least 8 s after
    the first.

    Sharing is then switched off while the donor stores 3 (its averager process holds in that store until the
    switch is made). hivemind reads the flag again after the store (averager.py:605-618), takes the switch as
    stored, and never stores it: the record of 3 stays until it expires (30 s). The swarm's averager stores it
    at once (within DECLARE_EVERY less 1 s: 7 s here, so that an averager process starved for seconds, as in
    one fresh-clone suite where the store had not come after 4 s, is not taken for a throttled one). A suite
    once saw plain hivemind miss the switch without the hold: the test had switched within those
    microseconds."""
    declare_every = 8.0
    # set before the fork: the averager process reads it
    monkeypatch.setattr(state_averager, "DECLARE_EVERY", declare_every)
    (node,) = _nodes(request, patched, 1)
    stores = mp.get_context("fork").SimpleQueue()
    switched_off = mp.get_context("fork").Event()
    store = node.store

    def noted_store(key, *args, **kwargs):  # runs in the averager process
        if key.endswith(".all_averagers"):
            stores.put((kwargs.get("value"), time.monotonic()))
            if kwargs.get("value") == 3.0:  # the store of 3 holds until sharing is switched off
                switched_off.wait(timeout=20)
        return store(key, *args, **kwargs)

    node.store = noted_store  # the averager process is forked with it
    (donor,) = _averagers(_class(patched), [node], [torch.nn.Linear(4, 3)], "pytest-sa-declare")
    noted: list[tuple] = []

    def values() -> list:
        while not stores.empty():
            noted.append(stores.get())
        seen = []  # consecutive stores of one value (the first record, stored again) counted once
        for value, _ in noted:
            if not seen or seen[-1] != value:
                seen.append(value)
        return seen

    def stored(value) -> bool:
        return values()[-1:] == [value]

    try:
        assert wait_until(lambda: stored(0.0), timeout=20, interval=0.02)
        for epoch in (1, 2, 3):
            donor.state_sharing_priority = epoch
            if epoch < 3:  # the next change comes once this one is stored, or 1.5 s on
                wait_until(lambda e=epoch: stored(float(e)), timeout=1.5, interval=0.02)
        assert wait_until(lambda: stored(3.0), timeout=declare_every + 10, interval=0.02)
        first = next(t for value, t in noted if value == 0.0)
        last = next(t for value, t in noted if value == 3.0)
        if patched:
            assert values() == [0.0, 3.0], values()
            assert last - first >= declare_every - 0.05, last - first
        else:
            assert values() == [0.0, 1.0, 2.0, 3.0], values()
        switched = time.monotonic()
        donor.allow_state_sharing = False
        switched_off.set()
        if patched:
            assert wait_until(lambda: stored(None), timeout=declare_every - 1.0, interval=0.02)
            assert noted[-1][1] - switched < declare_every - 1.0
        else:
            assert not wait_until(lambda: stored(None), timeout=3.0, interval=0.02), values()
    finally:
        switched_off.set()
        donor.shutdown()


def test_a_state_sketch_tells_the_same_state_from_drift_and_from_numbers_of_the_right_size():
    """Item 23's sketch: equal states give equal sketches; a state that drifted by 1e-4 of its norm (an honest
    peer whose round failed) is about 1e-4 away, well within ``NEAR``; random numbers of each tensor's own
    norm, the same state with its signs flipped, and another seed's model are about their whole norm away."""
    from swarm.averaging.donors import NEAR

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 10))
    state = _copies(net)
    sketch = state_averager.state_sketch(state)
    assert state_averager.state_sketch([t.clone() for t in state]) == sketch

    def norm_of_all(tensors):
        return sum(float(t.double().square().sum()) for t in tensors) ** 0.5

    noise = [torch.randn_like(t) for t in state]
    scale = 1e-4 * norm_of_all(state) / norm_of_all(noise)
    drifted = [t + scale * n for t, n in zip(state, noise, strict=True)]
    assert 1e-6 < state_averager.sketch_distance(sketch, state_averager.state_sketch(drifted)) < 1e-3 < NEAR

    random_state = [n * (t.norm() / n.norm()) for t, n in zip(state, noise, strict=True)]
    torch.manual_seed(1)
    other_seed = _copies(
        torch.nn.Sequential(torch.nn.Linear(40, 300), torch.nn.LayerNorm(300), torch.nn.Linear(300, 10))
    )
    for far in (random_state, [-t for t in state], other_seed):
        far_sketch = state_averager.state_sketch(far)
        assert abs(far_sketch[0] - sketch[0]) < 1e-6 * sketch[0] or far is other_seed  # the same norm
        assert state_averager.sketch_distance(sketch, far_sketch) > 0.2


def _priorities(node, prefix: str) -> dict:
    """The donors' declared priorities as ``node`` reads them (PeerID bytes -> priority)."""
    found = node.get(f"{prefix}.all_averagers", latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {peer: entry.value for peer, entry in found.value.items()}


def _publish_sketch(node, run: str, name: str, peer_id: str, epoch: int, tensors: list[torch.Tensor]) -> None:
    """A metrics record, as a training peer publishes it, with the sketch of ``tensors`` at ``epoch``."""
    from swarm.net import metrics

    record = metrics.LocalMetrics(
        peer_name=name,
        global_epoch=epoch,
        samples_per_second=1.0,
        loss=1.0,
        samples_accumulated=0,
        mini_steps=1,
        time=time.time(),
        peer_id=peer_id,
        state_sketches=[metrics.StateSketch(epoch=epoch, sketch=state_averager.state_sketch(tensors))],
    )
    metrics.publish(node, run, name.encode(), record, expiration=120).result(timeout=10)


def _newcomer_honest_and_random_nets() -> tuple[list[torch.nn.Module], list[torch.Tensor]]:
    """Three nets (a newcomer's, an honest donor's, and one of random numbers of each honest tensor's own
    norm, which the screen lets through) and a copy of the honest one's parameters."""
    torch.manual_seed(0)
    nets = [torch.nn.Linear(8, 6) for _ in range(3)]
    honest = _copies(nets[1])
    with torch.no_grad():
        for p, q in zip(nets[2].parameters(), honest, strict=True):
            noise = torch.randn_like(q)
            p.copy_(noise * (q.norm() / noise.norm()))
    return nets, honest


@pytest.mark.parametrize(
    "patched, diloco",
    [
        pytest.param(False, False, marks=PLAIN, id="plain hivemind"),
        pytest.param(True, False, id="patched"),
        pytest.param(True, True, id="diloco"),
    ],
)
def test_colluding_donors_that_claim_the_newest_epoch_and_serve_random_numbers_are_outvoted(
    request, patched, diloco
):
    """Item 23. hivemind downloads from the donor that declares the highest priority (averaging/averager.py:
    689-702) and loads whatever it serves whose epoch is not behind (optim/state_averager.py:672). D declares
    priority 6 and serves, at epoch 5, random numbers of each honest tensor's own norm (which the screen lets
    through: the sizes are honest); D and E (a colluder) publish that state's sketch as theirs; B, C and F,
    honest, hold one state at epoch 5 and publish its sketch (B is a donor of priority 5). On plain hivemind
    the newcomer A takes D's state. With the swarm's state averager and a DonorCheck, A refuses it (2 records
    for it, 3 against), undoes it, and takes B's (3 for, 2 against); D is not asked again, and since its
    state shares nothing with the swarm's, A bans it from its groups. A DiLoCo peer (a state averager with
    extra tensors: its inner moments) refuses D's state as well, but bans nobody: DiLoCo's honest peers hold
    their groups' anchors, and an honest donor lay 1.2 times its norm from the most-published state in the
    volunteers lab."""
    from swarm import suspects
    from swarm.averaging.donors import DonorCheck
    from swarm.patches import robust

    prefix, run = "pytest-sa-bad-donor", "pytest-sa-bad-donor-run"
    nodes = _nodes(request, patched, 3)
    nets, honest = _newcomer_honest_and_random_nets()
    random_state, newcomer_own = _copies(nets[2]), _copies(nets[0])
    a, b, d = _averagers(_class(patched), nodes, nets, prefix)
    refused: list = []
    if patched:
        assert a.bans_bad_donors  # no extra tensors: the peers are meant to hold one state
        if diloco:
            sgd = partial(torch.optim.SGD, lr=0.1)
            built = _class(True)(
                dht=nodes[0], params=nets[0].parameters(), prefix=f"{prefix}-diloco", optimizer=sgd,
                start=False, extra_tensors=(torch.zeros(3),),
            )  # fmt: skip
            assert not built.bans_bad_donors
            a.bans_bad_donors = False  # as a DiLoCo peer's state averager sets it
        a.screen, a.on_rejected = RoundScreen(10.0), lambda *args: refused.append(("screen", *args))
        a.check_download = DonorCheck(nodes[0], run, a.peer_id.to_base58())
        a.on_refused = lambda donor, reason: refused.append((donor, reason))
    try:
        b.local_epoch = d.local_epoch = 5
        b.state_sharing_priority, d.state_sharing_priority = 5, 6
        records = [("b", b.peer_id.to_base58(), honest), ("c", "honest-c", honest), ("f", "honest-f", honest)]
        records += [("d", d.peer_id.to_base58(), random_state), ("e", "colluder-e", random_state)]
        for name, peer_id, tensors in records:
            _publish_sketch(nodes[1], run, name, peer_id, 5, tensors)
        expected = {b.peer_id.to_bytes(): 5, d.peer_id.to_bytes(): 6}
        assert wait_until(lambda: expected.items() <= _priorities(nodes[0], prefix).items(), timeout=30)

        a.load_state_from_peers(timeout=5)
        assert a.local_epoch == 5
        if patched:
            assert _holds(nets[0], honest), "the newcomer must hold the honest donor's state"
            ((donor, reason),) = refused
            assert donor == d.peer_id.to_base58(), refused
            assert "differ from the state that 3 of the 5 peers published for global epoch 5" in reason, (
                reason
            )
            assert "2 hold the downloaded one" in reason, reason
            assert a.check_download.refused == 1 and a.check_download.checked == 1
            assert d.peer_id.to_base58() in a.refused_donors
            # its state shares nothing with the swarm's: banned from A's groups (swarm/suspects.py), unless
            # A is a DiLoCo peer
            banned = robust.suspects().get(d.peer_id.to_base58())
            if diloco:
                assert banned is None, banned
                return
            assert banned is not None and banned.banned_for > 0 and banned.ban_served, banned
            assert banned.ban_gap > 1.0, banned
            assert suspects.why_banned(banned).startswith("the state it served as a donor shared nothing")
            assert robust.suspects().get(b.peer_id.to_base58()) is None  # the honest donor: nothing
        else:
            assert _holds(nets[0], random_state)  # the attackers' numbers are the newcomer's model
            assert not _holds(nets[0], newcomer_own)
    finally:
        if patched:
            robust.suspects().clear()
        _shutdown(a, b, d)


def test_a_download_skips_banned_donors_and_asks_suspected_ones_last(request):
    """Items 21 and 23. Donor D serves random numbers of each honest tensor's norm; B, C and F hold one honest
    state (B is a donor). A's rounds have judged D's gradients far from the others' (swarm/suspects.py), in
    three rounds, not yet a ban: at one epoch (priority 5 both) A asks B before D, so no download is refused
    (hivemind picks at random: D first half the time, which the check then refuses). Once A has banned D,
    A does not ask it even when it declares the newest epoch (priority 6), where its averagers would refuse
    to call it anyway."""
    from swarm.averaging.donors import DonorCheck
    from swarm.patches import robust

    prefix, run = "pytest-sa-suspect-donor", "pytest-sa-suspect-donor-run"
    nodes = _nodes(request, True, 3)
    nets, honest = _newcomer_honest_and_random_nets()
    random_state = _copies(nets[2])
    a, b, d = _averagers(_class(True), nodes, nets, prefix)
    refused: list = []
    a.screen, a.on_rejected = RoundScreen(10.0), lambda *args: refused.append(("screen", *args))
    a.check_download = DonorCheck(nodes[0], run, a.peer_id.to_base58())
    a.on_refused = lambda donor, reason: refused.append((donor, reason))
    suspects, suspect = robust.suspects(), d.peer_id.to_base58()
    try:
        b.local_epoch = d.local_epoch = 5
        b.state_sharing_priority = d.state_sharing_priority = 5
        records = [("b", b.peer_id.to_base58(), honest), ("c", "honest-c", honest), ("f", "honest-f", honest)]
        records += [("d", suspect, random_state)]
        for name, peer_id, tensors in records:
            _publish_sketch(nodes[1], run, name, peer_id, 5, tensors)
        expected = {b.peer_id.to_bytes(): 5, d.peer_id.to_bytes(): 5}
        assert wait_until(lambda: expected.items() <= _priorities(nodes[0], prefix).items(), timeout=30)
        for scale in (0.4, 0.45, 0.6):
            assert not suspects.record(suspect, scale)
        assert a._donors() == [b.peer_id, d.peer_id]
        a.load_state_from_peers(timeout=5)
        assert _holds(nets[0], honest) and not refused, refused
        assert a.check_download.checked == 1 and a.check_download.refused == 0

        assert suspects.record(suspect, 0.3)  # the fourth judged round bans it
        d.state_sharing_priority = 6
        expected[d.peer_id.to_bytes()] = 6
        assert wait_until(lambda: expected.items() <= _priorities(nodes[0], prefix).items(), timeout=30)
        assert a._donors() == [b.peer_id]
        with torch.no_grad():
            for p in nets[0].parameters():
                p.zero_()
        a.load_state_from_peers(timeout=5)
        assert _holds(nets[0], honest) and not refused, refused
    finally:
        suspects.clear()
        _shutdown(a, b, d)


def test_a_download_check_keeps_a_lone_swarms_state_and_refuses_an_epoch_nobody_else_reached(
    request, monkeypatch
):
    """Item 23's rules where no other peer vouches: with no other peer's record at all (a swarm of two) the
    download is kept unchecked; a donor's own record never counts; a state whose epoch is ahead of every
    other peer's for ``WAIT_FOR_SKETCHES`` seconds is refused; one whose epoch the other peers went past
    without publishing it (by downloads of their own, as a starting swarm does) is kept unchecked at once,
    and refused once it is older than the epochs their records carry."""
    from swarm.averaging import donors

    monkeypatch.setattr(donors, "WAIT_FOR_SKETCHES", 1.0)
    (node,) = request.getfixturevalue("dhts")(1)
    run = "pytest-donor-rules"
    check = donors.DonorCheck(node, run, own="newcomer")
    state = [torch.ones(3, 4), torch.arange(5.0)]
    sketch = state_averager.state_sketch(state)

    assert check.judge(3, sketch, donor="donor") is None and check.unchecked == 1  # nobody to ask

    _publish_sketch(node, run, "donor", "donor", 3, state)  # the donor vouching for itself
    check.read()
    assert check.judge(3, sketch, donor="donor") is None and check.unchecked == 2

    _publish_sketch(node, run, "other", "other", 2, [t * 0.9 for t in state])
    check.read()
    started = time.monotonic()
    reason = check.judge(3, sketch, donor="donor")
    assert reason == "its global epoch 3 is ahead of every other peer's (the newest of 1: 2)", reason
    assert time.monotonic() - started >= 1.0 and check.refused == 1

    _publish_sketch(node, run, "other", "other", 4, [t * 0.9 for t in state])  # jumped over epoch 3
    check.read()
    started = time.monotonic()
    assert check.judge(3, sketch, donor="donor") is None and check.unchecked == 3
    assert time.monotonic() - started < 1.0  # nobody left to wait for
    assert check.judge(4, state_averager.state_sketch([t * 0.9 for t in state]), donor="donor") is None
    assert check.checked == 1

    _publish_sketch(node, run, "other", "other", 20, [t * 0.8 for t in state])
    check.read()
    reason = check.judge(3, sketch, donor="donor")
    assert (
        reason == "its global epoch 3 is older than the states the other peers still publish (the newest: 20)"
    )
    assert check.refused == 2 and check.unchecked == 3


def test_a_download_check_reads_the_records_before_it_judges(request, monkeypatch):
    """A download check judges what the swarm's records say when the download ends, not what its watcher had
    read by then: a small state downloads in 50 ms, before the watcher's first read has ended, and a check
    with nothing read took every state for a lone swarm's (a donor ahead of everyone, kept unchecked, in a
    fresh-clone suite)."""
    from swarm.averaging import donors

    monkeypatch.setattr(donors, "WAIT_FOR_SKETCHES", 0.5)
    (node,) = request.getfixturevalue("dhts")(1)
    run = "pytest-donor-first-read"
    state = [torch.ones(3, 4), torch.arange(5.0)]
    _publish_sketch(node, run, "other", "other", 0, [t * 0.9 for t in state])
    check = donors.DonorCheck(node, run, own="newcomer")  # nothing read yet
    reason = check.judge(50, state_averager.state_sketch(state), donor="donor")
    assert reason == "its global epoch 50 is ahead of every other peer's (the newest of 1: 0)", reason
    assert check.refused == 1 and check.unchecked == 0


def test_a_download_check_waits_for_the_honest_peers_records_that_come_after_a_colluders(
    request, monkeypatch
):
    """Item 23: colluding donors publish their record of an epoch first; the check waits for every live peer's
    record of that epoch (at most ``WAIT_FOR_SKETCHES``) before it counts, so three honest peers that publish
    1.5 s later still outvote the two that vouch for the bad state."""
    from swarm.averaging import donors

    monkeypatch.setattr(donors, "WAIT_FOR_SKETCHES", 10.0)
    (node,) = request.getfixturevalue("dhts")(1)
    run = "pytest-donor-race"
    honest = [torch.ones(3, 4), torch.arange(5.0)]
    bad = [torch.randn(3, 4), torch.randn(5)]
    for name in ("h1", "h2", "h3"):
        _publish_sketch(node, run, name, name, 4, [t * 0.99 for t in honest])  # live, one epoch behind
    for name in ("c1", "c2"):
        _publish_sketch(node, run, name, name, 5, bad)
    check = donors.DonorCheck(node, run, own="newcomer")
    check.read()

    def honest_later() -> None:
        time.sleep(1.5)
        for name in ("h1", "h2", "h3"):
            _publish_sketch(node, run, name, name, 5, honest)

    later = threading.Thread(target=honest_later)
    later.start()
    try:
        started = time.monotonic()
        reason = check.judge(5, state_averager.state_sketch(bad), donor="c1")
        waited = time.monotonic() - started
    finally:
        later.join()
    assert waited >= 1.5, waited
    assert reason is not None and "the state that 3 of the 5 peers published" in reason, reason
    assert check.judge(5, state_averager.state_sketch(honest), donor="h1") is None


def test_a_peer_finds_its_own_state_astray_only_when_most_other_peers_hold_one_other_state(
    request, monkeypatch
):
    """After a state round whose average lay far from its parameters, a peer asks whether its own state is
    the one astray (swarm/averaging/donors.py ``astray``): yes when at least two other peers, and more than
    half of those that published the epoch, hold one state that is not its own; no in a swarm of two, nor
    against colluders that are half of the other peers, nor where other peers hold its state. A peer one epoch
    behind is waited for, and its record counts."""
    from swarm.averaging import donors

    monkeypatch.setattr(donors, "WAIT_FOR_SKETCHES", 10.0)
    (node,) = request.getfixturevalue("dhts")(1)
    run = "pytest-astray"
    torch.manual_seed(0)
    swarm_state = [torch.randn(3, 4), torch.randn(5)]
    astray = [torch.randn(3, 4), torch.randn(5)]  # the same sizes, nothing in common
    check = donors.DonorCheck(node, run, own="me")
    mine = state_averager.state_sketch(astray)

    assert check.astray(5, mine) is None  # nobody else
    _publish_sketch(node, run, "b", "b", 5, swarm_state)
    assert check.astray(5, mine) is None  # a swarm of two: nobody can tell which of the two is astray

    _publish_sketch(node, run, "c", "c", 4, [t * 0.99 for t in swarm_state])  # live, one epoch behind

    def c_later() -> None:
        time.sleep(1.0)
        _publish_sketch(node, run, "c", "c", 5, [t * 1.001 for t in swarm_state])  # within NEAR of b's

    later = threading.Thread(target=c_later)
    later.start()
    try:
        started = time.monotonic()
        reason = check.astray(5, mine)
        waited = time.monotonic() - started
    finally:
        later.join()
    assert 1.0 <= waited < 10.0, waited
    assert reason is not None and reason.startswith(
        "2 of the 2 other peers that published global epoch 5 hold"
    ), reason
    assert "(0 hold this peer's)" in reason, reason
    assert check.astray(5, state_averager.state_sketch(swarm_state)) is None  # the swarm's own state

    for name in ("d", "e"):  # two more that hold this peer's state: 2 against 2
        _publish_sketch(node, run, name, name, 5, astray)
    assert check.astray(5, mine) is None
    _publish_sketch(node, run, "e", "e", 5, swarm_state)  # e went over: 3 of 4 hold the other state
    reason = check.astray(5, mine)
    assert reason is not None and reason.startswith("3 of the 4 other peers"), reason
    assert "(1 hold this peer's)" in reason, reason


def test_in_an_invite_only_swarm_a_download_check_counts_one_vote_per_invite(request, tmp_path):
    """Item 23, who votes. An invited attacker publishes, under 4 DHT keys and 4 PeerIDs of its own, 4 records
    that vouch for its state of epoch 5, each with a valid member record of its one invite, plus a record in
    an honest peer's name (under its own key) and one with no member record at all; 2 honest peers, each with
    its own invite, hold the honest state. Counting one vote per PeerID, as in an open swarm, the attacker's 4
    outvote the 2 honest peers and its state is kept. Counting one per invite (the check of an invite-only
    swarm), it has one vote against 2 and its state is refused, and the honest one is accepted."""
    import base64

    from swarm.averaging import donors
    from swarm.net import metrics
    from swarm.net.fence import member_bytes
    from swarm.net.invite import load_or_create_owner_key, make_invite

    (node,) = request.getfixturevalue("dhts")(1)
    run = "pytest-donor-sybil"
    owner, _ = load_or_create_owner_key(tmp_path / "owner.pem")
    invites = {name: make_invite(owner, run, name, 3600.0) for name in ("newcomer", "h1", "h2", "mallory")}
    honest = [torch.ones(3, 4), torch.arange(5.0)]
    bad = [torch.randn(3, 4) * 3, torch.randn(5) * 8]

    def member(invite_name: str, peer_id: str, key: bytes) -> None:
        invite = invites[invite_name]
        record = metrics.MemberRecord(
            peer_id=peer_id,
            certificate=invite.certificate.to_text(),
            signature=base64.b64encode(invite.sign(member_bytes(run, peer_id))).decode(),
        )
        stored = node.store(
            metrics.members_key(run), subkey=key, value=record.dict(), expiration_time=time.time() + 120
        )
        assert stored

    def vote(peer_id: str, key: bytes, tensors: list[torch.Tensor]) -> None:
        _publish_sketch(node, run, key.decode(), peer_id, 5, tensors)  # signed under ``key``

    for name in ("h1", "h2"):
        member(name, f"peer-{name}", name.encode())
        vote(f"peer-{name}", name.encode(), honest)
    for i in range(4):
        member("mallory", f"mallory-{i}", f"mallory-{i}".encode())
        vote(f"mallory-{i}", f"mallory-{i}".encode(), bad)
    vote("peer-h1", b"mallory-forges-h1", bad)  # in an honest peer's name, under the attacker's key
    vote("outsider", b"outsider", bad)  # no member record

    by_peer_id = donors.DonorCheck(node, run, own="peer-newcomer")
    by_peer_id.read()
    assert by_peer_id.judge(5, state_averager.state_sketch(bad), donor="mallory-0") is None

    by_invite = donors.DonorCheck(node, run, own="peer-newcomer", invite=invites["newcomer"])
    by_invite.read()
    reason = by_invite.judge(5, state_averager.state_sketch(bad), donor="mallory-0")
    assert reason is not None and "the state that 2 of the 3 peers published" in reason, reason
    assert "1 hold the downloaded one" in reason, reason
    assert by_invite.judge(5, state_averager.state_sketch(honest), donor="peer-h1") is None
    assert by_invite.checked == 1 and by_invite.refused == 1


def _layered_nets(count: int) -> list[torch.nn.Module]:
    """``count`` nets of three Linear layers (six tensors), all with the parameters of the first."""
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3))) for _ in range(count)]
    with torch.no_grad():
        for net in nets[1:]:
            for p, q in zip(net.parameters(), nets[0].parameters(), strict=True):
                p.copy_(q)
    return nets


def _helping(request, donors: list[dict], download_donors: int = 3, votes: int = 3):
    """A newcomer A (``download_donors``, a DonorCheck, a screen; its parameters 0, its three extra tensors of
    64 numbers 1) and one donor per entry of ``donors``: a dict with its ``params`` (the six tensors), the
    value of its ``extras``, its ``epoch`` (5 if not given), the ``priority`` it declares, the parameters it
    ``publishes`` in its metrics record (its own if not given) and its class (``plain``: hivemind's own),
    with ``votes`` more records of epoch 5 that hold the first donor's parameters published; returns (A, the
    donors, A's net, A's extras, what A was told of refused donors)."""
    from swarm.averaging.donors import DonorCheck

    prefix, run = "pytest-sa-slices", "pytest-sa-slices-run"
    nodes = _nodes(request, True, 1 + len(donors))
    nets = _layered_nets(1 + len(donors))
    extras = [tuple(torch.full((64,), float(d["extras"])) for _ in range(3)) for d in donors]
    extras.insert(0, tuple(torch.ones(64) for _ in range(3)))
    with torch.no_grad():
        for net, donor in zip(nets[1:], donors, strict=True):
            for p, value in zip(net.parameters(), donor["params"], strict=True):
                p.copy_(value)
        for p in nets[0].parameters():
            p.zero_()
    sgd = partial(torch.optim.SGD, lr=0.1)
    classes = [_class(True)] + [TrainingStateAverager if d.get("plain") else _class(True) for d in donors]
    built: list = []
    try:
        for cls, node, net, extra in zip(classes, nodes, nets, extras, strict=True):
            built.append(
                cls(dht=node, params=net.parameters(), prefix=prefix, optimizer=sgd, start=True,
                    extra_tensors=extra)
            )  # fmt: skip
        a = built[0]
        refused: list = []
        a.screen, a.on_rejected = RoundScreen(10.0), lambda *args: refused.append(("screen", *args))
        a.check_download = DonorCheck(nodes[0], run, a.peer_id.to_base58())
        a.on_refused = lambda donor, reason: refused.append((donor, reason))
        a.download_donors = download_donors
        for averager, donor in zip(built[1:], donors, strict=True):
            averager.local_epoch, averager.state_sharing_priority = donor.get("epoch", 5), donor["priority"]
        for i in range(votes):
            _publish_sketch(nodes[1], run, f"honest-{i}", f"honest-{i}", 5, donors[0]["params"])
        for i, (averager, donor) in enumerate(zip(built[1:], donors, strict=True)):
            state = donor.get("publishes", donor["params"])
            _publish_sketch(nodes[1], run, f"donor-{i}", averager.peer_id.to_base58(), 5, state)
        expected = {b.peer_id.to_bytes(): d["priority"] for b, d in zip(built[1:], donors, strict=True)}
        assert wait_until(lambda: expected.items() <= _priorities(nodes[0], prefix).items(), timeout=30)
    except BaseException:
        _shutdown(*built)
        raise
    return a, built[1:], nets[0], extras[0], refused


def _values(extras: tuple) -> list[float]:
    return [float(t[0]) for t in extras]


def test_a_download_takes_the_parameters_from_its_donor_and_the_rest_in_slices_from_others(request):
    """Item 31. Donors B and C hold one state at epoch 5 (C's parameters 1e-5 from B's: honest peers of one
    epoch differ that much) and declare epoch 6; E holds other parameters (0.5 further on every number: a
    DiLoCo peer of another group) and declares 5. Their extra tensors (DiLoCo's inner moments) are 2, 3 and
    4. A downloads with ``download_donors`` 3: every parameter comes from the donor asked (B or C, the newest
    epoch), the six of them in its slice; the three extras come in slices from the two others: first the
    one whose record published the donor's state, then E. The parameters are checked and kept."""
    base = [p.detach().clone() for p in _layered_nets(1)[0].parameters()]
    donors = [
        dict(params=base, extras=2, priority=6),
        dict(params=[t + 1e-5 for t in base], extras=3, priority=6),
        dict(params=[t + 0.5 for t in base], extras=4, priority=5),
    ]
    a, built, net, extras, refused = _helping(request, donors)
    try:
        a.load_state_from_peers(timeout=5)
        assert a.local_epoch == 5 and not refused, refused
        held = [p.detach() for p in net.parameters()]

        def holds(k: int) -> bool:
            return all(torch.equal(p, q) for p, q in zip(held, donors[k]["params"], strict=True))

        (asked,) = [k for k in (0, 1) if holds(k)]
        other = 1 - asked
        assert _values(extras) == [donors[other]["extras"]] * 2 + [4.0], _values(extras)
        assert a.check_download.checked == 1 and a.check_download.refused == 0
    finally:
        _shutdown(a, *built)


def test_a_download_with_an_outsized_slice_is_refused_and_the_donor_asked_alone(request):
    """Item 31. Donor B declares epoch 6 (it is asked first), D epoch 5 (a helper); both hold B's parameters
    at epoch 5, and D's extra tensors are 10^4 (B's: 2). The screen rejects the state put together; D then
    helps no download for REFUSE_FOR seconds, and B is asked alone at once: A holds B's state, and no donor
    counts as refused (B's own state was good, and with more helpers, which one sent the bad slice would
    not be known)."""
    honest = [p.detach().clone() for p in _layered_nets(1)[0].parameters()]
    donors = [dict(params=honest, extras=2, priority=6), dict(params=honest, extras=1e4, priority=5)]
    a, (b, d), net, extras, refused = _helping(request, donors)
    try:
        a.load_state_from_peers(timeout=5)
        assert a.local_epoch == 5
        assert all(torch.equal(p.detach(), t) for p, t in zip(net.parameters(), honest, strict=True))
        assert _values(extras) == [2.0] * 3, _values(extras)
        assert not refused and not a.refused_donors, (refused, a.refused_donors)
        assert set(a.unhelpful) == {d.peer_id.to_base58()}, a.unhelpful
        assert a.check_download.checked == 1 and a.check_download.refused == 0
        assert a._helpers(b.peer_id, 6.0, a._ranked_donors()) == []  # it helps no download for a while
    finally:
        _shutdown(a, b, d)


def test_a_helper_at_another_epoch_or_without_the_slice_rpc_leaves_its_slice_to_the_donor(request):
    """Item 31. B (declaring epoch 6) holds epoch 5 and extras 2; helper C holds epoch 4 (its declaration
    lags; extras 3), and helper D is hivemind's own state averager (a peer without the slice RPC; extras 4).
    A with ``download_donors`` 3 asks B for the slices that C and D could not send: A holds B's state at epoch
    5, nobody is refused."""
    honest = [p.detach().clone() for p in _layered_nets(1)[0].parameters()]
    donors = [
        dict(params=honest, extras=2, priority=6),
        dict(params=honest, extras=3, priority=5, epoch=4),
        dict(params=honest, extras=4, priority=5, plain=True),
    ]
    a, (b, c, d), net, extras, refused = _helping(request, donors)
    try:
        a.check_download.read()  # as a download does before it chooses helpers
        assert len(a._helpers(b.peer_id, 6.0, a._ranked_donors())) == 2
        a.load_state_from_peers(timeout=5)
        assert a.local_epoch == 5
        assert all(torch.equal(p.detach(), t) for p, t in zip(net.parameters(), honest, strict=True))
        assert _values(extras) == [2.0] * 3, _values(extras)
        assert not refused and not a.unhelpful and a.check_download.checked == 1, (refused, a.unhelpful)
    finally:
        _shutdown(a, b, c, d)


def _momenta(averager, value: float | None = None) -> list[float]:
    """The first number of each SGD momentum buffer of ``averager``'s optimizer (set to ``value`` first)."""
    params = [p for g in averager.optimizer.param_groups for p in g["params"]]
    if value is not None:
        with torch.no_grad(), averager.lock_averaged_tensors:
            for p in params:
                averager.optimizer.state[p]["momentum_buffer"] = torch.full_like(p, value)
    return [float(averager.optimizer.state[p]["momentum_buffer"].flatten()[0]) for p in params]


@pytest.mark.parametrize("holds", [True, False], ids=["holds-its-own-state", "newcomer"])
def test_a_peer_that_holds_its_own_state_downloads_all_but_its_own_extras(request, holds):
    """Item 33. Where the extras are each peer's own (``keeps_own_extras``: DiLoCo's inner moments), a peer
    that holds a state of its own (it took an epoch's step or a download) takes the parameters and the
    optimizer's statistics (SGD momenta 7; its own 3) from its donor B (epoch 5, extras 2) and keeps its own
    extras (1); a newcomer, which holds none, takes B's whole state. Either way the parameters are checked
    and kept."""
    honest = [p.detach().clone() for p in _layered_nets(1)[0].parameters()]
    a, (b,), net, extras, refused = _helping(request, [dict(params=honest, extras=2, priority=6)], 1)
    try:
        _momenta(b, 7.0), _momenta(a, 3.0)  # hivemind loads the statistics that this peer's optimizer holds
        a.keeps_own_extras, a.holds_own_state = True, holds
        a.load_state_from_peers(timeout=5)
        assert a.local_epoch == 5 and not refused, refused
        assert all(torch.equal(p.detach(), t) for p, t in zip(net.parameters(), honest, strict=True))
        assert _values(extras) == [1.0 if holds else 2.0] * 3, _values(extras)
        assert _momenta(a) == [7.0] * 6
        assert a.check_download.checked == 1 and a.check_download.refused == 0
        assert a.holds_own_state
    finally:
        _shutdown(a, b)


def test_a_donor_without_the_slice_rpc_sends_the_whole_state_to_a_peer_that_keeps_its_extras(request):
    """Item 33. Donor B is hivemind's own state averager (a peer without the slice RPC): A, which asked for
    all but its own extras, takes B's whole state instead, and refuses nobody."""
    honest = [p.detach().clone() for p in _layered_nets(1)[0].parameters()]
    donors = [dict(params=honest, extras=2, priority=6, plain=True)]
    a, (b,), net, extras, refused = _helping(request, donors, 1)
    try:
        a.keeps_own_extras = a.holds_own_state = True
        a.load_state_from_peers(timeout=5)
        assert a.local_epoch == 5 and not refused, refused
        assert all(torch.equal(p.detach(), t) for p, t in zip(net.parameters(), honest, strict=True))
        assert _values(extras) == [2.0] * 3, _values(extras)
    finally:
        _shutdown(a, b)


def test_at_one_epoch_a_download_asks_first_the_donor_whose_state_most_peers_published(request):
    """Item 34. Donors B, C and D declare epoch 5; B's parameters are also published by three other peers'
    records, C's and D's (0.5 and -0.5 further on every number: DiLoCo peers of other groups) by their own
    records alone. The check keeps only B's, so A asks B first (by chance one time in three before): nothing
    is refused."""
    honest = [p.detach().clone() for p in _layered_nets(1)[0].parameters()]
    donors = [
        dict(params=honest, extras=2, priority=5),
        dict(params=[t + 0.5 for t in honest], extras=3, priority=5),
        dict(params=[t - 0.5 for t in honest], extras=4, priority=5),
    ]
    a, built, net, extras, refused = _helping(request, donors, 1)
    try:
        a.check_download.read()
        assert [a.check_download.margin(b.peer_id.to_base58()) for b in built] == [3, -3, -3]
        a.load_state_from_peers(timeout=5)
        assert a.local_epoch == 5 and not refused, refused
        assert all(torch.equal(p.detach(), t) for p, t in zip(net.parameters(), honest, strict=True))
        assert a.check_download.refused == 0 and a.check_download.checked == 1
    finally:
        _shutdown(a, *built)


def test_a_download_that_brings_nothing_leaves_a_change_of_this_peers_own_state_unjudged(request):
    """Item 23. A (at epoch 5, its parameters 0) downloads from B (epoch 6), which is in an epoch's step and
    sends nothing. While A waits, A's own parameters change (+1: a DiLoCo round in the background landing).
    No state arrived, so nothing is judged: A keeps its change, and B is not refused. (Judged as a download,
    A's own state, which the three records of epoch 5 contradict, was undone and B refused.)"""
    honest = [p.detach().clone() for p in _layered_nets(1)[0].parameters()]
    a, (b,), net, extras, refused = _helping(request, [dict(params=honest, extras=2, priority=6, epoch=6)], 1)
    try:
        a.local_epoch = 5
        b._swarm_settled.clear()  # B is in an epoch's step: it serves no state (after half a chunk timeout)
        reads, read = [], a.check_download.read

        def read_and_change() -> None:
            read()
            reads.append(time.monotonic())
            if len(reads) == 3:  # the download's watcher, two seconds into it (B answers after five)
                with torch.no_grad():
                    for p in net.parameters():
                        p.add_(1.0)

        a.check_download.read = read_and_change
        a.load_state_from_peers(timeout=5)
        assert len(reads) >= 3, reads
        assert not refused and not a.refused_donors, (refused, a.refused_donors)
        assert a.local_epoch == 5 and a.check_download.refused == 0
        assert all(torch.equal(p.detach(), torch.ones_like(p)) for p in net.parameters())
    finally:
        b._swarm_settled.set()
        _shutdown(a, b)
