"""swarm/patches on real hivemind DHTs and averager processes on 127.0.0.1: a group closes as soon as
every expected peer is in it, packed buffers average to the exact mean, and a failed round steps on the
peer's own gradient instead of zeros."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import AveragingStage
from hivemind.compression import CompressionInfo, TensorRole
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager

from swarm import patches
from swarm.averaging.diloco import DiLoCo, group_formed
from swarm.averaging.screen import RoundScreen, total_norm
from swarm.patches import allreduce, grad_averager, matchmaking, progress, state_averager
from swarm.patches import optimizer as wiring
from swarm.procs import remove_stale_sockets, start_group, stop_group
from swarm.waiting import wait_until

PROGRESS_ONLY = """
import sys, time, hivemind
from hivemind.optim.progress_tracker import ProgressTracker
run_id, epoch = sys.argv[1], int(sys.argv[2])
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=sys.argv[3:])
tracker = ProgressTracker(dht, run_id, target_batch_size=8, start=True)
tracker.report_local_progress(epoch, 1)
while True:
    time.sleep(1)
"""
MATCHMAKING = 30.0  # far longer than any test waits: a round that finishes sooner closed its group early


@pytest.fixture
def dhts():
    started = time.time()
    patches.install()
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    nodes = [first]

    def more(n: int) -> list[hivemind.DHT]:
        while len(nodes) < n:
            nodes.append(
                hivemind.DHT(
                    start=True,
                    host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                    initial_peers=[str(a) for a in first.get_visible_maddrs()],
                )
            )
        return nodes[:n]

    yield more
    for node in nodes:
        node.shutdown()
    remove_stale_sockets(since=started, settle=1.0)


@contextmanager
def _optimizer_beside_a_progress_only_peer(node: hivemind.DHT, net: torch.nn.Module):
    """A hivemind.Optimizer on ``node`` (SGD, lr 1) with the swarm's round averager, and a second peer B that
    only announces progress, as a peer that is busy or stuck would: A counts two peers, so it tries to average
    with B. B is another process because progress records are signed with a process-wide key."""
    opt = hivemind.Optimizer(
        dht=node,
        run_id="pytest-rounds-fail",
        params=net.parameters(),
        optimizer=partial(torch.optim.SGD, lr=1.0),
        target_batch_size=8,
        batch_size_per_step=4,
        matchmaking_time=2.0,
        averaging_timeout=4.0,
        averager_opts={"request_timeout": 1.5},
        grad_averager_factory=grad_averager.round_averager(partial(GradientAverager, request_timeout=1.5)),
    )
    peer_b = _progress_only_peer(node, "pytest-rounds-fail", 0)
    try:

        def both_seen() -> bool:
            opt.tracker.report_local_progress(0, 1)  # a tracker reports once it has samples
            return opt.tracker.global_progress.num_peers >= 2

        wait_until(both_seen, timeout=60)
        assert opt.tracker.global_progress.num_peers == 2, peer_b.poll()
        yield opt
    finally:
        stop_group(peer_b, grace=10.0)
        opt.shutdown()


def _progress_only_peer(node: hivemind.DHT, run_id: str, epoch: int) -> subprocess.Popen:
    """A peer of ``run_id`` (another process: progress records are signed with a process-wide key) that only
    announces progress at ``epoch``, as one that is busy or stuck would."""
    return start_group(
        [sys.executable, "-c", PROGRESS_ONLY, run_id, str(epoch), *map(str, node.get_visible_maddrs())],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _state_averagers(nodes: list, nets: list, prefix: str, **options) -> list:
    """The swarm's state averager (SGD, lr 0.1) on each DHT node, over each net's parameters."""
    from hivemind.optim.state_averager import TrainingStateAverager

    cls = state_averager.state_averager_class(TrainingStateAverager)
    sgd = partial(torch.optim.SGD, lr=0.1)
    return [
        cls(dht=node, params=net.parameters(), prefix=prefix, optimizer=sgd, start=True, **options)
        for node, net in zip(nodes, nets, strict=True)
    ]


def _state(seed: int) -> tuple[list[torch.Tensor], list[CompressionInfo]]:
    """A state like the state averager's: parameters, then Adam statistics, of mixed sizes and dtypes."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64,), (64, 64), (3,), (10, 64), (1, 65, 64), (7,)]
    params = [torch.randn(*s, generator=gen) for s in shapes]
    stats = [torch.rand(*s, generator=gen) for s in shapes]
    extra = [torch.randn(5, generator=gen).double()]
    infos = [CompressionInfo.from_tensor(t, key=i, role=TensorRole.PARAMETER) for i, t in enumerate(params)]
    infos += [
        CompressionInfo.from_tensor(t, key=(i, "m"), role=TensorRole.OPTIMIZER) for i, t in enumerate(stats)
    ]
    infos += [CompressionInfo.from_tensor(t, key=99, role=TensorRole.UNSPECIFIED) for t in extra]
    return params + stats + extra, infos


def test_group_closes_when_full_and_packed_buffers_average_exactly(dhts):
    nodes = dhts(3)
    states = [_state(seed) for seed in range(3)]
    expected = [sum(ts) / 3 for ts in zip(*(s for s, _ in states), strict=True)]
    cls = allreduce.packing(DecentralizedAverager)
    assert cls.__name__ == "DecentralizedAverager"  # p2p handler names come from the class name
    group = [
        cls(
            tensors,
            dht=node,
            prefix="pytest-rounds-state",
            tensor_infos=infos,
            min_matchmaking_time=MATCHMAKING,
            request_timeout=1.5,
            start=True,
        )
        for node, (tensors, infos) in zip(nodes, states, strict=True)
    ]
    try:
        for averager in group:
            matchmaking.set_target_group_size(averager, 3, {})
        began = time.perf_counter()
        controls = [a.step(wait=False, timeout=MATCHMAKING + 10) for a in group]
        results = [c.result(timeout=MATCHMAKING - 5) for c in controls]
        spent = time.perf_counter() - began
        assert all(len(r) == 3 for r in results), results
        assert spent < MATCHMAKING - 5, spent
        for averager in group:
            with averager.get_tensors() as got:
                for g, e in zip(got, expected, strict=True):
                    assert g.dtype == e.dtype
                    torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    finally:
        for averager in group:
            averager.shutdown()


def _abandoning_join_request(abandoned: list):
    """Matchmaking._request_join_group of a follower whose process is starved right after it asks a leader to
    take it: the request reaches the leader, but the follower has given up before the answer (request_timeout)
    and looks on. Only the first request of each step is abandoned."""
    from hivemind.averaging.matchmaking import Matchmaking

    from swarm.faults import send_join_request

    original = Matchmaking._request_join_group

    async def request(self, leader):
        if id(self.step_control) in abandoned:
            return await original(self, leader)
        abandoned.append(id(self.step_control))
        abandoned.append(await send_join_request(self, leader))  # kept open: the answer is never read
        return None

    return request


def test_a_groupmate_that_never_joins_is_dropped_and_the_round_ends(dhts, monkeypatch):
    """The leader accepts a follower that has already given up on it (item 8 of swarm.averagers): the leader
    must end its round with what it has instead of failing after allreduce_timeout, and both peers must
    average together in the next round. With hivemind's own handlers the leader waited for the follower's
    parts until sender_timeout and for its reduced parts until allreduce_timeout (in the demo's config: the
    round failed after 15 s, "received 50.0% of input tensors"; the follower: "could not find a group")."""
    from hivemind.averaging.matchmaking import Matchmaking

    leader_node, follower_node = dhts(2)
    opts = dict(
        prefix="pytest-rounds-abandoned",
        min_matchmaking_time=2.0,
        request_timeout=1.5,
        allreduce_timeout=MATCHMAKING,
        next_chunk_timeout=MATCHMAKING - 10,
        start=True,
    )
    # 300 k numbers: more than one part, so each peer reduces some of them (hivemind/averaging/partition.py)
    # the leader names groupmates that never learnt of its group, as the swarm's gradient averagers do
    namer = type("DecentralizedAverager", (allreduce.NamesStrangers, DecentralizedAverager), {})
    leader = namer([torch.ones(300_000)], dht=leader_node, **opts)
    # the follower's averager process is forked with the patched class; this process is restored at once
    monkeypatch.setattr(Matchmaking, "_request_join_group", _abandoning_join_request([]))
    follower = DecentralizedAverager([torch.zeros(300_000)], dht=follower_node, **opts)
    monkeypatch.undo()
    try:
        for averager in (leader, follower):
            matchmaking.set_target_group_size(averager, 2, {})
        first = leader.step(wait=False, timeout=MATCHMAKING + 10)
        time.sleep(0.3)  # the leader declared first, so the follower asks it
        lagging = follower.step(wait=False, timeout=MATCHMAKING + 10)
        began = time.perf_counter()
        gathered = first.result(timeout=MATCHMAKING + 15)
        spent = time.perf_counter() - began
        assert spent < MATCHMAKING - 10, spent  # before sender_timeout: the follower was dropped, not awaited
        # the result names the follower a stranger, and holds only the peers that took part
        assert gathered.strangers == {follower.peer_id} and list(gathered) == [leader.peer_id], gathered
        with leader.get_tensors() as (got,):
            assert torch.equal(got, torch.ones(300_000))  # nothing averaged in: the follower sent nothing
        second = leader.step(wait=False, timeout=MATCHMAKING + 10)
        gathered = second.result(timeout=MATCHMAKING + 15)
        assert len(gathered) == 2 and not getattr(gathered, "strangers", ()), gathered
        assert len(lagging.result(timeout=MATCHMAKING + 15)) == 2
        for averager in (leader, follower):
            with averager.get_tensors() as (got,):
                torch.testing.assert_close(got, torch.full((300_000,), 0.5))
    finally:
        for averager in (leader, follower):
            averager.shutdown()


def test_failed_round_steps_on_own_gradient_not_zeros(dhts):
    """Peer A's swarm has a second peer B that reports progress but never averages: A's gradient round fails,
    and hivemind.Optimizer proceeds with local gradients. The SGD step (lr 1, no momentum) must move A's
    parameters by A's own mean gradient; hivemind's own averager moved them by zero."""
    (node_a,) = dhts(1)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in net.parameters()]
    with _optimizer_beside_a_progress_only_peer(node_a, net) as opt_a:
        grads = []
        for step in range(4):  # the round ends once A and B have 8 samples (or hivemind's ETA says so)
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
            net.zero_grad()
            net(x).pow(2).sum().backward()
            grads.append([p.grad.detach().clone() for p in net.parameters()])
            opt_a.step()
            if opt_a.local_epoch == 1:
                break
        assert opt_a.local_epoch == 1
        assert opt_a.grad_averager.local_fallbacks == 1
        own = [sum(g) / len(grads) for g in zip(*grads, strict=True)]
        for p, b, g in zip(net.parameters(), before, own, strict=True):
            torch.testing.assert_close(p.detach(), b - g, rtol=1e-5, atol=1e-6)


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


def _gradients(net: torch.nn.Module, scale: float, seed: int) -> list[torch.Tensor]:
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))
    net.zero_grad()
    (net(x).pow(2).sum() * scale).backward()
    return [p.grad.detach().clone() for p in net.parameters()]


@contextmanager
def _screened_gradient_pair(dhts, prefix: str, own_scale=None):
    """A (the swarm's round averager, its screen wired by ``screen_rounds``) and B, whose averager speaks the
    swarm's packed format (docs/hivemind-patches.md item 3) but has no screen, on two real DHT nodes. Yields
    (nets, averagers, opt, screen, rejected, loaded); ``opt`` carries the two attributes of hivemind.Optimizer
    that screen_rounds wraps, and ``loaded`` counts the calls of hivemind's own loading after the screen."""
    node_a, node_b = dhts(2)
    torch.manual_seed(0)
    net_a = torch.nn.Linear(4, 3)
    net_b = torch.nn.Linear(4, 3)
    net_b.load_state_dict(net_a.state_dict())  # the same gradients at the same seed
    common = dict(prefix=prefix, min_matchmaking_time=MATCHMAKING, request_timeout=1.5, start=True)
    a = grad_averager.keeping_local_gradients(GradientAverager)(
        list(net_a.parameters()), dht=node_a, **common
    )
    b = allreduce.packing(GradientAverager)(list(net_b.parameters()), dht=node_b, **common)
    screen, rejected, loaded = RoundScreen(10.0), [], []
    opt = SimpleNamespace(
        grad_averager=a,
        state_averager=SimpleNamespace(),
        _load_averaged_gradients_into_optimizer_=lambda: loaded.append(True),
    )
    wiring.screen_rounds(opt, screen, lambda *args: rejected.append(args), own_scale=own_scale)
    try:
        for averager in (a, b):
            matchmaking.set_target_group_size(averager, 2, {})
        yield (net_a, net_b), (a, b), opt, screen, rejected, loaded
    finally:
        for averager in (a, b):
            averager.shutdown()


def _screened_round(pair, a_grads: tuple[float, int], b_grads: tuple[float, int], seed: int, b_seed: int):
    """One real round of the pair: A and B accumulate the gradients of their batches (drawn with ``seed``
    and ``b_seed``) times (scale, batch size) each; then A's screened loading runs. Returns A's own gradient
    and B's."""
    (net_a, net_b), (a, b), opt, *_ = pair
    own = _gradients(net_a, a_grads[0], seed=seed)
    a.accumulate_grads_(batch_size=a_grads[1])
    theirs = _gradients(net_b, b_grads[0], seed=b_seed)
    b.accumulate_grads_(batch_size=b_grads[1])
    controls = [x.step(wait=False, timeout=MATCHMAKING + 10) for x in (a, b)]
    assert all(len(c.result(timeout=MATCHMAKING - 5)) == 2 for c in controls)
    opt._load_averaged_gradients_into_optimizer_()
    return own, theirs


def _assert_a_holds(pair, expected: list[torch.Tensor]) -> None:
    (_, (a, b), *_) = pair
    with a.get_tensors() as got:
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    for x in (a, b):
        x.notify_used_averaged_gradients()


def test_an_outsized_averaged_gradient_is_rejected_for_the_peers_own(dhts):
    """In the first round B is honest and A applies the exact mean; in the second B's gradient is 10,000
    times too large, and A's screen puts A's own gradient where the mean was, counts the round and says why.
    (A plain hivemind GradientAverager cannot average with the swarm's packed parts at all: its round fails
    with "received 0.0% results".)"""
    with _screened_gradient_pair(dhts, "pytest-rounds-screen") as pair:
        *_, screen, rejected, loaded = pair
        own, theirs = _screened_round(pair, (1.0, 4), (1.0, 4), seed=0, b_seed=10)
        _assert_a_holds(pair, [(g + h) / 2 for g, h in zip(own, theirs, strict=True)])
        own, _ = _screened_round(pair, (1.0, 4), (1e4, 4), seed=1, b_seed=11)
        _assert_a_holds(pair, own)
        assert len(loaded) == 2  # hivemind's own loading ran after the screen, both times
        assert screen.rejected_gradient_rounds == 1 and len(screen.norms) == 1, screen.__dict__
        ((kind, reason, samples),) = rejected
        assert kind == "gradient" and samples == 4, rejected
        assert "x this peer's reference" in reason and "the limit is 10x" in reason, reason


def test_a_diloco_peer_after_one_inner_step_accepts_the_mean_of_peers_that_took_sixteen(dhts):
    """A DiLoCo newcomer joins its first outer round after 1 inner step while B took 16 (H = 16): B's
    pseudo-gradient is 16 times A's, and the mean weighted by samples (1 and 16 batches) is 257/17 = 15.1
    times A's own, past the screen's 10x. Scaled by H / steps taken (DiLoCo.pseudo_gradient_scale), A
    accepts that honest mean; B 10,000 times too large is still rejected. Without the scale A rejected the
    first round (seen in the DiLoCo test's summaries, 2026-11-25: ``rejected: ['gradient']``)."""
    inner = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters())
    diloco = DiLoCo(inner, local_steps=16, outer_lr=0.7, outer_momentum=0.9)
    diloco.steps = 1
    assert diloco.pseudo_gradient_scale() == 16.0
    with _screened_gradient_pair(dhts, "pytest-rounds-diloco-screen", diloco.pseudo_gradient_scale) as pair:
        *_, screen, rejected, loaded = pair
        own, theirs = _screened_round(pair, (1.0, 1), (16.0, 16), seed=0, b_seed=0)  # one direction
        mean = [(g + 16 * h) / 17 for g, h in zip(own, theirs, strict=True)]
        assert 15 < total_norm(mean) / total_norm(own) < 15.2  # what the unscaled screen rejected
        _assert_a_holds(pair, mean)
        assert not rejected and screen.rejected_gradient_rounds == 0, rejected
        own, _ = _screened_round(pair, (1.0, 1), (1.6e5, 16), seed=1, b_seed=1)
        _assert_a_holds(pair, own)
        ((kind, reason, samples),) = rejected
        assert kind == "gradient" and samples == 1 and "x 16" in reason, rejected
        assert len(loaded) == 2


def test_a_state_round_is_skipped_only_when_the_whole_group_sent_one_state(dhts):
    """Item 16 on real averagers: A and B each hold the swarm's gradient averager and state averager over a
    net; their gradient rounds carry each one's state digest and tracker count in hivemind's all-gather.
    Equal nets: both skip the epoch's state round (they would average equal tensors). B's weight moved by
    1e-3: both hold it. Equal again, but B's tracker counts a third peer that is not in the group: both hold
    it. The state steps are recorded with what hivemind.Optimizer would pass, not run."""
    nodes = dhts(2)
    torch.manual_seed(0)
    nets = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    nets[1].load_state_dict(nets[0].state_dict())
    states = _state_averagers(nodes, nets, "pytest-rounds-agree-state")
    common = dict(
        prefix="pytest-rounds-agree", min_matchmaking_time=MATCHMAKING, request_timeout=1.5, start=True
    )
    grads = [
        grad_averager.keeping_local_gradients(GradientAverager)(list(net.parameters()), dht=node, **common)
        for net, node in zip(nets, nodes, strict=True)
    ]
    held: list[list[dict]] = [[], []]  # each peer's state steps: their keyword arguments
    skipped: list[list[tuple]] = [[], []]
    opts = []
    for i in range(2):
        states[i].step = lambda *args, _i=i, **kwargs: held[_i].append(kwargs)
        opt = SimpleNamespace(
            local_epoch=0,
            average_state_every=1,
            grad_averager=grads[i],
            state_averager=states[i],
            tracker=SimpleNamespace(global_progress=SimpleNamespace(num_peers=2)),
            _average_gradients_and_load_into_optimizer=lambda control: control.result(timeout=MATCHMAKING),
        )
        wiring.skip_state_rounds_in_agreement(opt, lambda *args, _i=i: skipped[_i].append(args))
        opts.append(opt)

    def one_round() -> list[bool]:
        """A gradient round of both, then each one's epoch step as hivemind.Optimizer calls it: whether
        the state round was held, per peer."""
        for net, averager, seed in zip(nets, grads, (0, 1), strict=True):
            _gradients(net, 1.0, seed=seed)
            averager.accumulate_grads_(batch_size=4)
        controls = [averager.step(wait=False, timeout=MATCHMAKING + 10) for averager in grads]
        for opt, control in zip(opts, controls, strict=True):
            assert len(opt._average_gradients_and_load_into_optimizer(control)) == 2
        for opt, averager in zip(opts, grads, strict=True):
            opt.state_averager.step(
                increment_epoch=True, optimizer_step=True, averaging_round=True, averaging_opts={"timeout": 9}
            )
            averager.notify_used_averaged_gradients()
        return [h.pop()["averaging_round"] for h in held]

    try:
        for averager in grads:
            matchmaking.set_target_group_size(averager, 2, {})
        assert wiring.state_summary(opts[0]) == wiring.state_summary(opts[1])
        assert one_round() == [False, False]
        assert skipped == [[(1, 2)], [(1, 2)]], skipped
        with torch.no_grad():
            nets[1].weight[0, 0] += 1e-3
        assert wiring.state_summary(opts[0]) != wiring.state_summary(opts[1])
        assert one_round() == [True, True]
        with torch.no_grad():
            nets[1].weight.copy_(nets[0].weight)
        opts[1].tracker.global_progress.num_peers = 3
        assert one_round() == [True, True]
        assert len(skipped[0]) == len(skipped[1]) == 1, skipped
    finally:
        for averager in (*grads, *states):
            averager.shutdown()


def test_a_diloco_round_counts_as_formed_only_while_its_whole_group_awaits_the_trigger(dhts):
    """A DiLoCo peer that finished its inner phase begins the outer round once its group has formed
    (swarm/averaging/diloco.py ``group_formed``), without waiting for its reads of the swarm's progress. A
    round whose peer looks for a group alone is not formed; once the other peer looks too, both rounds are;
    once both triggered and the round ended, neither is; nor is a round whose lone search ended at its
    deadline."""
    node_a, node_b = dhts(2)
    nets = [torch.nn.Linear(4, 3) for _ in range(2)]
    common = dict(prefix="pytest-rounds-formed", min_matchmaking_time=MATCHMAKING, request_timeout=1.5)
    cls = grad_averager.keeping_local_gradients(GradientAverager)
    a, b = (
        cls(list(net.parameters()), dht=node, start=True, **common)
        for net, node in zip(nets, (node_a, node_b), strict=True)
    )
    try:
        for averager in (a, b):
            matchmaking.set_target_group_size(averager, 2, {})
        assert not group_formed(SimpleNamespace(scheduled_grads=None))
        peer_a = SimpleNamespace(scheduled_grads=a.schedule_step(timeout=MATCHMAKING + 10))
        time.sleep(2.0)
        assert not peer_a.scheduled_grads.done()
        assert not group_formed(peer_a), peer_a.scheduled_grads.stage
        peer_b = SimpleNamespace(scheduled_grads=b.schedule_step(timeout=MATCHMAKING + 10))
        wait_until(lambda: group_formed(peer_a) and group_formed(peer_b), timeout=MATCHMAKING - 10)
        for peer in (peer_a, peer_b):
            peer.scheduled_grads.allow_allreduce()
        gathered = [peer.scheduled_grads.result(timeout=20) for peer in (peer_a, peer_b)]
        assert all(len(g) == 2 for g in gathered), gathered
        # a search that found nobody by the round's deadline also awaits the trigger, without a group
        from hivemind.utils import get_dht_time

        control = a.schedule_step(scheduled_time=get_dht_time() + 1.0, timeout=2.0)
        lone = SimpleNamespace(scheduled_grads=control)
        assert wait_until(lambda: lone.scheduled_grads.stage == AveragingStage.AWAITING_TRIGGER, timeout=20)
        assert not group_formed(lone)
        lone.scheduled_grads.cancel()
    finally:
        for averager in (a, b):
            averager.shutdown()


def test_diloco_peers_with_one_anchor_agree_whatever_their_own_inner_adamw_state(dhts):
    """Item 16 for DiLoCo: the state averager also shares each peer's inner AdamW state (extra tensors),
    which in the paper stays each worker's own. Peers holding one anchor but different inner moments agree
    when the extra tensors are left out of the summary (and only then); a different anchor or outer momentum
    never agrees."""
    nodes = dhts(2)
    torch.manual_seed(0)
    nets = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    nets[1].load_state_dict(nets[0].state_dict())
    inner = [[torch.full((3, 4), float(i + 1)), torch.tensor(float(10 * i))] for i in range(2)]
    states = [
        state_averager.state_averager_class(TrainingStateAverager)(
            dht=node,
            params=net.parameters(),
            prefix="pytest-rounds-diloco-agree",
            optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
            extra_tensors=extra,
            start=True,
        )
        for node, net, extra in zip(nodes, nets, inner, strict=True)
    ]
    opts = [SimpleNamespace(state_averager=state, local_epoch=3) for state in states]
    try:
        shared, local = (
            [wiring.state_summary(opt, local_extras=flag) for opt in opts] for flag in (False, True)
        )
        assert not wiring.in_agreement({i: {"state": s, "peers": 2} for i, s in enumerate(shared)})
        assert wiring.in_agreement({i: {"state": s, "peers": 2} for i, s in enumerate(local)})
        with torch.no_grad():
            nets[1].bias[0] += 1e-3
        moved = [wiring.state_summary(opt, local_extras=True) for opt in opts]
        assert not wiring.in_agreement({i: {"state": s, "peers": 2} for i, s in enumerate(moved)})
        # one anchor again, but different outer momenta (never averaged): the next outer steps would part them
        with torch.no_grad():
            nets[1].bias.copy_(nets[0].bias)
        for state, scale in zip(states, (1.0, 2.0), strict=True):
            for p in state.optimizer.param_groups[0]["params"]:
                state.optimizer.state[p]["momentum_buffer"] = torch.full_like(p, scale)
        momenta = [wiring.state_summary(opt, local_extras=True) for opt in opts]
        assert not wiring.in_agreement({i: {"state": s, "peers": 2} for i, s in enumerate(momenta)})
        for state in states:
            for p in state.optimizer.param_groups[0]["params"]:
                state.optimizer.state[p]["momentum_buffer"].fill_(1.0)
        same = [wiring.state_summary(opt, local_extras=True) for opt in opts]
        assert wiring.in_agreement({i: {"state": s, "peers": 2} for i, s in enumerate(same)})
    finally:
        for state in states:
            state.shutdown()


def test_only_one_well_formed_state_across_a_whole_group_counts_as_agreement():
    """in_agreement (item 16) reads what groupmates sent: norms equal to rounding (1e-6), the same exact
    digest, a group of all the peers any member counts; anything malformed is disagreement."""
    state = {"norms": [3.0, 1.5, 2.0, 0.0], "exact": b"d" * 16}
    one = {"state": state, "peers": 2}

    def other(**changes: object) -> dict:
        return {**one, "state": {**state, **changes}}

    assert wiring.in_agreement({"a": one, "b": dict(one)})
    assert wiring.in_agreement({"a": one, "b": other(norms=[3.0 * (1 + 5e-7), 1.5, 2.0, 0.0])})
    assert not wiring.in_agreement({"a": one, "b": other(norms=[3.0 * (1 + 2e-6), 1.5, 2.0, 0.0])})
    assert not wiring.in_agreement({"a": one, "b": other(norms=[3.0, 1.5, 2.0, 1e-30])})
    assert not wiring.in_agreement({"a": one, "b": other(norms=[3.0, 1.5, 2.0])})
    assert not wiring.in_agreement({"a": one, "b": other(exact=b"e" * 16)})  # e.g. another epoch
    assert not wiring.in_agreement({"a": one})  # alone
    assert not wiring.in_agreement({"a": one, "b": {**one, "peers": 3}})  # B counts one more peer
    assert not wiring.in_agreement({"a": one, "b": {**one, "state": None}})  # not a state epoch for B
    malformed = (
        None,
        "state",
        7,
        [one],
        {**one, "peers": True},
        {**one, "peers": "2"},
        other(norms=[3.0, 1.5, 2.0, float("nan")]),
        other(norms=[3, 1.5, 2.0, 0.0]),
        other(norms="3.0"),
        other(exact="d" * 16),
    )
    for junk in malformed:
        assert not wiring.in_agreement({"a": one, "b": junk}), junk
    assert not wiring.in_agreement(allreduce.Gathered.without({"a": one, "b": one, "c": one}, {"c"}))


def test_peers_whose_adamw_counted_different_steps_take_the_same_update_at_one_epoch():
    """Item 17: two peers with the same parameters, AdamW moments and gradient but step counters 58 and 61
    (as three demo peers' were at global epoch 60: 58, 60, 61) update differently through AdamW's bias
    correction; with number_steps_by_epoch both count the epoch the update comes from, and update alike."""

    def peer(counter: int, numbered: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(net.parameters(), lr=0.003, weight_decay=0.05)
        _gradients(net, 1.0, seed=0)
        opt.step()  # moments exist
        for state in opt.state.values():
            state["step"].fill_(counter)
        _gradients(net, 1.0, seed=1)
        if numbered:  # the state averager has numbered the new epoch 61 when the update runs
            wiring.number_steps_by_epoch(SimpleNamespace(local_epoch=61), opt)
        opt.step()
        return net, opt

    for numbered in (False, True):
        (a, opt_a), (b, opt_b) = peer(58, numbered), peer(61, numbered)
        same = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
        assert same == numbered, numbered
    steps = {float(state["step"]) for o in (opt_a, opt_b) for state in o.state.values()}
    assert steps == {61.0}, steps


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


def test_a_round_starts_when_the_last_ones_control_is_still_there(dhts):
    """When no round was pre-scheduled for this epoch, hivemind.Optimizer still holds the previous round's
    control, drops it as "already used elsewhere", and starts no round at all (its groupmates then waited
    for it until averaging_timeout). With never_cancel_rounds a fresh round starts."""
    (node_a,) = dhts(1)
    with _optimizer_beside_a_progress_only_peer(node_a, torch.nn.Linear(4, 3)) as opt_a:

        def begin_with_a_used_control(opt: hivemind.Optimizer) -> bool:
            used = opt.grad_averager.schedule_step(timeout=4.0)
            used.cancel()  # as done as the last round's control
            opt.scheduled_grads = used
            began = opt._begin_averaging_gradients(None)
            fresh = opt.scheduled_grads
            if fresh is not None and fresh is not used and not fresh.done():
                fresh.cancel()
            # cancelled here, so not again by opt.shutdown(): a second cancel of a control whose stage the
            # averager process has not yet moved on raises InvalidStateError (a fresh-clone suite)
            opt.scheduled_grads = None
            return began and fresh is not None and fresh is not used

        assert not begin_with_a_used_control(opt_a)  # hivemind's own: no round
        wiring.never_cancel_rounds(opt_a)
        assert begin_with_a_used_control(opt_a)


def test_a_download_one_epoch_behind_the_swarm_keeps_the_epoch_number_of_its_state(dhts, caplog):
    """The only donor serves epoch 5 while another peer already announces epoch 6. hivemind.Optimizer would
    number the newcomer's download 6 ("Catching up with collaboration step"): epoch 5's parameters under 6's
    number. With item 13 it downloads again, and keeps epoch 5 with the donor's parameters exactly."""
    node_d, node_n = dhts(2)
    run = "pytest-rounds-behind"
    torch.manual_seed(0)
    donor_net, new_net = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    (donor,) = _state_averagers([node_d], [donor_net], f"{run}_state_averager")
    donor.local_epoch = donor.state_sharing_priority = 5
    ahead = _progress_only_peer(node_d, run, 6)
    opt = hivemind.Optimizer(
        dht=node_n,
        run_id=run,
        params=new_net.parameters(),
        optimizer=partial(torch.optim.SGD, lr=0.1),
        target_batch_size=8,
        batch_size_per_step=4,
        matchmaking_time=2.0,
        averaging_timeout=4.0,
        averager_opts={"request_timeout": 1.5},
        load_state_timeout=20.0,
    )
    try:
        wiring.download_the_epoch_it_names(opt, attempts=2, pause=0.2)
        assert wait_until(lambda: opt.tracker.global_epoch == 6, timeout=60), opt.tracker.global_progress
        with caplog.at_level("INFO", logger="swarm.patches.optimizer"):
            opt.load_state_from_peers()
        assert opt.local_epoch == 5 and opt.tracker.local_progress.epoch == 5
        for p, q in zip(new_net.parameters(), donor_net.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach())
        messages = [r.getMessage() for r in caplog.records if r.name == "swarm.patches.optimizer"]
        assert messages == [
            "Downloaded the state of global epoch 5 while the swarm is at 6; downloading again",
            "Kept global epoch 5, the epoch of the state downloaded (the swarm is at 6); the next step "
            "downloads again",
        ], messages
        # what this guards against: hivemind's own download, in the same swarm, numbers the same state 6
        hivemind.Optimizer.load_state_from_peers(opt)
        assert opt.local_epoch == 6
    finally:
        stop_group(ahead, grace=10.0)
        opt.shutdown()
        donor.shutdown()


@contextmanager
def _two_trackers(dhts, run: str, target: int):
    """Progress trackers A and B of run ``run`` on two DHT nodes, each signing with its own key (by default a
    tracker signs with the process-wide key: one record for both), reads at most a minute apart, item 14
    installed (as the strategy installs it)."""
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils.crypto import RSAPrivateKey

    trackers = []
    try:
        for node in dhts(2):
            tracker = ProgressTracker(
                node, run, target, max_refresh_period=60.0, private_key=RSAPrivateKey(), start=True
            )
            trackers.append(tracker)
            progress.read_soon_while_speeds_unknown(tracker)
        yield trackers
    finally:
        for tracker in trackers:
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


def test_a_diloco_peer_waiting_for_the_swarm_reads_its_progress_every_waiting_reads_every(dhts):
    """A DiLoCo peer that has done its inner steps waits for the swarm's reads to show the others done, and
    that read ended most outer rounds while it came every min_refresh_period (0.5 s). B's record says it is
    slow, so hivemind plans A's next read more than 30 s ahead; A then waits for 2 s as DiLoCo.outer_step
    waits (``read_while_waiting`` on every turn) and reads at least 10 times (about 40 expected at
    WAITING_READS_EVERY = 0.05 s; at most 5 at 0.5 s), each read planned for within WAITING_READS_EVERY."""
    from hivemind.utils import get_dht_time

    from swarm.averaging import diloco

    with _two_trackers(dhts, "pytest-rounds-diloco-reads", 16) as (a, b):
        b.performance_ema.samples_per_second = 0.1
        b.local_progress = b._get_local_progress(0, 1)
        b.should_report_progress.set()

        def a_read_b() -> bool:
            if a.global_progress.samples_accumulated >= 1:
                return True
            a.global_progress.next_fetch_time = get_dht_time()
            a.global_state_updated.set()
            return False

        assert wait_until(a_read_b, timeout=20, interval=0.25)
        assert a.global_progress.next_fetch_time - get_dht_time() > 30  # hivemind's plan from B's speed
        reads, seen, deadline = 0, a.global_progress, time.monotonic() + 2.0
        while time.monotonic() < deadline:
            diloco.read_while_waiting(a)
            assert a.global_progress.next_fetch_time - get_dht_time() <= diloco.WAITING_READS_EVERY + 0.01
            if a.global_progress is not seen:
                reads, seen = reads + 1, a.global_progress
            time.sleep(0.02)  # DiLoCo.outer_step's turn
        assert reads >= 10, reads


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


def test_a_peer_waiting_for_a_groupmate_reads_the_declared_averagers_at_most_every_leader_reads_every(dhts):
    """Item 20, with hivemind's own matchmaking pieces (PotentialLeaders, GroupKeyManager) on two real DHT
    nodes: peer A looks for a leader for 2 s with nobody declared, as a peer waits for a groupmate still
    computing. hivemind's loop reads the declared averagers back to back (each empty read asks for the next,
    matchmaking.py:469-522); the installed one keeps LEADER_READS_EVERY between two reads. Then B declares
    itself with an earlier expiration than A's, as a groupmate that finished later does, and A finds it as
    its leader within a few reads."""
    import asyncio

    from hivemind.averaging.key_manager import GroupKeyManager
    from hivemind.averaging.matchmaking import PotentialLeaders
    from hivemind.utils import get_dht_time

    a, b = dhts(2)
    reads: list[float] = []

    async def scenario() -> tuple[object, float]:
        key_a = GroupKeyManager(a, "pytest-leaders", initial_group_bits="", target_group_size=2)
        key_b = GroupKeyManager(b, "pytest-leaders", initial_group_bits="", target_group_size=2)
        real = key_a.get_averagers

        async def counted(*args, **kwargs):
            reads.append(time.monotonic())
            return await real(*args, **kwargs)

        key_a.get_averagers = counted
        leaders = PotentialLeaders(a.peer_id, min_matchmaking_time=1.0, target_group_size=2)
        leaders.running.set()
        leaders.search_end_time = get_dht_time() + 30.0
        leaders.declared_expiration_time = get_dht_time() + 20.0  # as _declare_averager_periodically sets it
        updates = asyncio.create_task(leaders._update_queue_periodically(key_a))
        popping = asyncio.create_task(leaders.pop_next_leader())
        await asyncio.sleep(2.0)
        assert not popping.done()
        declared = time.monotonic()
        await key_b.declare_averager(key_b.current_key, b.peer_id, expiration_time=get_dht_time() + 10.0)
        leader = await asyncio.wait_for(popping, 5.0)
        found = time.monotonic() - declared
        updates.cancel()
        await asyncio.gather(updates, return_exceptions=True)
        return leader, found

    leader, found = asyncio.run(scenario())
    gaps = [later - earlier for earlier, later in zip(reads[:-1], reads[1:], strict=True)]
    assert leader == b.peer_id
    assert len(reads) >= 5, reads  # it kept looking while alone
    assert min(gaps) >= matchmaking.LEADER_READS_EVERY * 0.95, gaps  # hivemind's own loop: a few ms apart
    assert len(reads) <= (2.0 + found) / matchmaking.LEADER_READS_EVERY + 2, len(reads)
    assert found < 5 * matchmaking.LEADER_READS_EVERY, found
