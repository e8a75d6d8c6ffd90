"""DiLoCo (swarm/averaging/diloco.py) on real averagers: when a round counts as formed, agreement with each
peer's own inner state, and the reads of a peer that waits for the swarm."""

from __future__ import annotations

import threading
import time
from functools import partial
from types import SimpleNamespace

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager

from swarm.averaging.diloco import averaged_statistics, group_formed, outer_optimizer
from swarm.patches import grad_averager, matchmaking, state_averager
from swarm.patches import optimizer as wiring
from swarm.waiting import wait_until
from tests.patches.common import MATCHMAKING, _two_trackers


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


def test_a_diloco_state_round_averages_the_outer_momentum_and_the_peers_agree_after_it(dhts):
    """Two DiLoCo peers with one anchor but different outer momenta (one took its first outer steps alone)
    disagree (item 16). One real state round of their state averagers, built as the strategy builds them
    (``averaged_statistics`` of the outer SGD), averages the momenta with the anchors: afterwards the two
    hold one momentum and agree, so later state rounds are skipped and their outer steps stay equal. Before,
    the round averaged the anchors alone, the next outer step parted them again, and every epoch needed a
    state round (a missed one left the peers' anchors apart). The extras (the inner moments: here 30,000
    numbers, against 30 of anchors and momenta) stay each peer's own and out of the round (``own_extras``,
    item 40): the round sends fewer bytes than there are numbers in one peer's extras, and its result, applied
    after this peer's extras changed (an overlapped peer's inner steps), leaves them as they are."""
    from swarm.patches import traffic

    nodes = dhts(2)
    torch.manual_seed(0)
    nets = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
    nets[1].load_state_dict(nets[0].state_dict())
    outers = [outer_optimizer(list(net.parameters()), lr=0.7, momentum=0.9) for net in nets]
    assert averaged_statistics(outers[0]) == ("momentum_buffer",)
    states = [
        state_averager.state_averager_class(TrainingStateAverager)(
            dht=node,
            params=net.parameters(),
            prefix="pytest-diloco-momentum-round",
            optimizer=outer,
            average_opt_statistics=averaged_statistics(outer),
            extra_tensors=[torch.full((30_000,), float(i))],
            own_extras=True,
            min_matchmaking_time=MATCHMAKING,
            request_timeout=1.5,
            start=True,
        )
        for i, (node, net, outer) in enumerate(zip(nodes, nets, outers, strict=True))
    ]
    opts = [SimpleNamespace(state_averager=state, local_epoch=3) for state in states]
    try:
        with torch.no_grad():
            for outer, value in zip(outers, (1.0, 3.0), strict=True):
                for p in outer.param_groups[0]["params"]:
                    outer.state[p]["momentum_buffer"].fill_(value)

        def agree() -> bool:
            summaries = [wiring.state_summary(opt, local_extras=True) for opt in opts]
            return wiring.in_agreement({i: {"state": s, "peers": 2} for i, s in enumerate(summaries)})

        assert not agree()
        for state in states:
            matchmaking.set_target_group_size(state, 2, {})
        done: list = []
        held = dict(averaging_round=True, averaging_opts={"timeout": 60})
        threads = [threading.Thread(target=lambda s=state: done.append(s.step(**held))) for state in states]
        sent = traffic.bytes_sent("state")
        for t in threads:
            t.start()
        for t in threads:
            t.join(MATCHMAKING + 30)
        assert len(done) == 2, done
        for outer in outers:
            for p in outer.param_groups[0]["params"]:
                torch.testing.assert_close(outer.state[p]["momentum_buffer"], torch.full_like(p, 2.0))
        assert agree()
        for i, state in enumerate(states):
            torch.testing.assert_close(state.extra_tensors[0], torch.full((30_000,), float(i)))
        assert 0 < traffic.bytes_sent("state") - sent < 30_000, traffic.bytes_sent("state") - sent
        # inner steps taken while the round ran (an overlapped peer) stay: its result leaves the extras alone
        with torch.no_grad():
            states[0].extra_tensors[0].fill_(7.0)
            nets[0].bias.add_(1.0)
        states[0]._apply_averaging_results_()
        torch.testing.assert_close(states[0].extra_tensors[0], torch.full((30_000,), 7.0))
        torch.testing.assert_close(nets[0].bias, nets[1].bias)  # the round's anchors, as before
    finally:
        for state in states:
            state.shutdown()


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


def test_a_peer_with_a_round_in_flight_expects_groupmates_that_computed_until_now():
    """--overlap-rounds: while this peer's pseudo-gradient of 16 steps (taken in 0.5 s since its previous
    launch) is in flight, a groupmate may have computed through a stalled round of its own, from about this
    peer's previous launch until now. After 1.5 s more, an honest phase may hold 4x this peer's steps at its
    speed, and the screen's scale (DiLoCo.pseudo_gradient_scale) says so; with no round in flight it is 1."""
    import threading

    from swarm.averaging.diloco import DiLoCo

    inner = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters())
    diloco = DiLoCo(inner, local_steps=16, outer_lr=0.7, outer_momentum=0.9, overlap=True)
    diloco.sent_steps = 16
    assert diloco.pseudo_gradient_scale() == 1.0
    now = time.perf_counter()
    diloco._flight = threading.Event()
    diloco._sent_phase_began, diloco._flight_began = now - 2.0, now - 1.5
    assert 3.9 <= diloco.pseudo_gradient_scale() <= 4.1, diloco.pseudo_gradient_scale()
