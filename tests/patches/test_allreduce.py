"""What swarm/patches/allreduce.py changes: one all-reduce part per buffer instead of one per tensor (item 3),
a groupmate that never joins is dropped (item 8) and named a stranger (item 11). Each scenario runs on plain
hivemind, where it shows the failure, and with the patch."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import TensorPartContainer

from swarm.patches import allreduce
from swarm.patches import optimizer as wiring
from swarm.waiting import wait_until
from tests.patches.common import (
    ALL_BUT_ROBUST,
    MATCHMAKING,
    PLAIN,
    PLAIN_OR_PATCHED,
    _abandoning_join_request,
    _state,
    hivemind_as,
    round_results,
)

PLAIN_ALLREDUCE_TIMEOUT = 3.0  # item 8: plain hivemind's leader waits all of it, so short in that variant

NODES = 3  # started before the first test


@pytest.mark.parametrize("patched", [False, True], ids=["a part per tensor", "packed"])
def test_one_all_reduce_part_per_buffer_not_per_tensor_and_the_average_is_exact(nodes, patched, monkeypatch):
    """Item 3. Three averagers hold a state like the state averager's: 13 tensors of mixed sizes, two dtypes
    and three roles (parameters, optimizer statistics, an extra float64 tensor), each under 512 KiB.
    hivemind's TensorPartContainer splits every tensor into parts of its own (averaging/partition.py:70-86),
    and each part costs a compression call in a thread, a message and a reply: with plain hivemind each
    peer's round has 13 parts, one per tensor. ``allreduce.packing`` averages one buffer per dtype and role:
    3 parts. Both average exactly. Counted in the averager processes, by a TensorPartContainer that reports
    its parts. The other process-wide changes are installed in both variants, so that they differ in the
    packing alone: without item 8, a reducer starved for longer than ``request_timeout`` at the start of a
    fresh-clone suite refused a groupmate's part, and hivemind's round ended with "received 73.2% results"."""
    states = [_state(seed) for seed in range(3)]
    expected = [sum(ts) / 3 for ts in zip(*(s for s, _ in states), strict=True)]
    cls = allreduce.packing(DecentralizedAverager) if patched else DecentralizedAverager
    assert cls.__name__ == "DecentralizedAverager"  # p2p handler names come from the class name
    containers = mp.get_context("fork").Queue()  # (tensors, parts), one per round of each averager process
    split = TensorPartContainer.__init__

    def counted(self, tensors, *args, **kwargs):
        split(self, tensors, *args, **kwargs)
        containers.put((len(tensors), sum(self.num_parts_by_tensor)))

    monkeypatch.setattr(TensorPartContainer, "__init__", counted)
    # the averager processes are forked with the counting container
    with hivemind_as(True, *ALL_BUT_ROBUST):
        group = [
            cls(
                tensors,
                dht=node,
                prefix=f"pytest-rounds-state-{patched}",  # the shared nodes keep the other variant's records
                tensor_infos=infos,
                target_group_size=3,  # hivemind's own: the group closes once full, with or without item 1
                min_matchmaking_time=MATCHMAKING,
                request_timeout=1.5,
                start=True,
            )
            for node, (tensors, infos) in zip(nodes(3), states, strict=True)
        ]
    monkeypatch.undo()  # this process splits as hivemind does
    try:
        controls = [a.step(wait=False, timeout=MATCHMAKING + 10) for a in group]
        results = [c.result(timeout=MATCHMAKING - 5) for c in controls]
        assert all(len(r) == 3 for r in results), results
        parts = [containers.get(timeout=10) for _ in group]
        # patched: float32 parameters, float32 optimizer statistics, the float64 extra tensor
        assert parts == ([(3, 3)] * 3 if patched else [(13, 13)] * 3), parts
        for averager in group:
            with averager.get_tensors() as got:
                for g, e in zip(got, expected, strict=True):
                    assert g.dtype == e.dtype
                    torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    finally:
        for averager in group:
            averager.shutdown()


@pytest.mark.parametrize(
    ("dropped", "named"),
    [
        pytest.param(False, False, marks=PLAIN, id="plain hivemind"),
        pytest.param(True, False, id="item 8 without item 11"),
        pytest.param(True, True, id="patched"),
    ],
)
def test_a_groupmate_that_never_joins_is_dropped_named_and_met_in_the_next_round(
    nodes, dropped, named, monkeypatch
):
    """Items 8 and 11. The leader accepts a follower that has already given up on it (the follower's process
    was starved for longer than request_timeout: ``_abandoning_join_request``), so the follower never learns
    of the group. The leader sends it its parts, and hivemind's ``rpc_aggregate_part`` holds them until a
    group registers (averaging/averager.py:581-598, ``_pending_groups_registered``), which never happens
    while the follower looks for a group in vain: with plain hivemind the leader's all-reduce waits the whole
    ``allreduce_timeout`` (averager.py:458-466; 15 s in the demo's config, 3 s here) and fails; only a retry
    of the step, where its timeout leaves time for one (here), averages the two in a new group. With item 8
    the follower answers BAD_GROUP_ID after request_timeout, and the leader drops it and ends its round long
    before sender_timeout (20 s here); but hivemind's result (``_aggregate_with_group``,
    averager.py:514-531) lists every member of the group, the follower among them, as if it had taken part,
    so the optimizer cannot tell (item 11). The swarm's gradient averagers (``NamesStrangers``) name it a
    stranger and leave it out. Then the two average together in the next round."""
    from hivemind.averaging.matchmaking import Matchmaking

    leader_node, follower_node = nodes(2)
    prefix = f"pytest-rounds-abandoned-{dropped}-{named}"  # the shared nodes keep other variants' records
    allreduce_timeout = MATCHMAKING if dropped else PLAIN_ALLREDUCE_TIMEOUT
    opts = dict(
        prefix=prefix,
        target_group_size=2,  # hivemind's own: the group closes once full, with or without item 1
        min_matchmaking_time=2.0,
        request_timeout=1.5,
        allreduce_timeout=allreduce_timeout,
        next_chunk_timeout=MATCHMAKING - 10,
        start=True,
    )
    # 300 k numbers: more than one part, so each peer reduces some of them (hivemind/averaging/partition.py)
    leader_class = DecentralizedAverager
    if named:  # the leader names the groupmates that never learnt of its group, as the swarm's averagers do
        leader_class = type("DecentralizedAverager", (allreduce.NamesStrangers, DecentralizedAverager), {})
    with hivemind_as(dropped):
        leader = leader_class([torch.ones(300_000)], dht=leader_node, **opts)
        # the follower's averager process is forked with the abandoning request; this process is restored
        monkeypatch.setattr(Matchmaking, "_request_join_group", _abandoning_join_request([]))
        follower = DecentralizedAverager([torch.zeros(300_000)], dht=follower_node, **opts)
        monkeypatch.undo()

    def leader_declared() -> bool:
        found = follower_node.get(f"{prefix}.0b", latest=True)  # hivemind's group key, no group bits
        entry = found.value.get(leader.peer_id.to_bytes()) if found is not None else None
        return entry is not None and entry.value is True

    try:
        first = leader.step(wait=False, timeout=MATCHMAKING + 10)
        # the leader declared first (the earlier expiration), so the follower asks it
        assert wait_until(leader_declared, timeout=10, interval=0.02)
        began = time.perf_counter()  # before the follower can join: the leader's all-reduce begins later
        lagging = follower.step(wait=False, timeout=MATCHMAKING + 10)
        gathered = first.result(timeout=MATCHMAKING + 15)
        spent = time.perf_counter() - began
        if not dropped:
            # the leader gave up on its group after allreduce_timeout ("received 50.0% of input tensors",
            # "caught MatchmakingException('Unable to run All-Reduce: '), retrying"), and only its step's
            # retry, within the step's timeout here, averaged the two in a new group
            assert spent >= PLAIN_ALLREDUCE_TIMEOUT, spent
            assert len(gathered) == 2 and len(lagging.result(timeout=MATCHMAKING + 15)) == 2
            return
        assert spent < MATCHMAKING - 10, spent  # before sender_timeout: the follower was dropped, not awaited
        with leader.get_tensors() as (got,):
            assert torch.equal(got, torch.ones(300_000))  # nothing averaged in: the follower sent nothing
        if named:
            # the result names the follower a stranger, and holds only the peers that took part
            assert gathered.strangers == {follower.peer_id} and list(gathered) == [leader.peer_id], gathered
            # and that the follower's slice came back as the leader's own numbers: the round was partial
            assert 0.3 < gathered.received < 0.7, gathered.received
        else:
            # hivemind's result: the group as matchmaking made it, the follower as if it had taken part
            assert type(gathered) is dict and set(gathered) == {leader.peer_id, follower.peer_id}, gathered
        second = leader.step(wait=False, timeout=MATCHMAKING + 10)
        gathered = second.result(timeout=MATCHMAKING + 15)
        assert len(gathered) == 2 and not getattr(gathered, "strangers", ()), gathered
        assert getattr(gathered, "received", 1.0) == 1.0, gathered.received
        assert len(lagging.result(timeout=MATCHMAKING + 15)) == 2
        for averager in (leader, follower):
            with averager.get_tensors() as (got,):
                torch.testing.assert_close(got, torch.full((300_000,), 0.5))
    finally:
        for averager in (leader, follower):
            averager.shutdown()


@PLAIN_OR_PATCHED
def test_a_groupmate_that_awaits_its_trigger_is_not_taken_for_a_stranger(nodes, patched):
    """Item 8's bound on the wait for an unknown group must not cut off a groupmate that knows the group: in a
    pre-scheduled round (hivemind.Optimizer's ``schedule_step``, ``require_trigger``) a peer assembles its
    group and then awaits its own trigger before it registers the group (averaging/averager.py:427-431 and
    455), while groupmates triggered earlier already send it their parts. Here peer 1 is triggered 3 times
    ``request_timeout`` after peers 0 and 2 began their all-reduce: hivemind holds their parts until the
    group registers, and every peer averages; so must the patched averagers (they once answered
    ``BAD_GROUP_ID`` after ``request_timeout``, and peers 0 and 2 kept their own tensors)."""
    from hivemind.averaging.control import AveragingStage
    from hivemind.utils import get_dht_time

    request_timeout = 0.3
    values = [1.0, 10.0, 100.0]
    with hivemind_as(patched, *ALL_BUT_ROBUST):
        group = [
            DecentralizedAverager(
                [torch.full((30_000,), v)],
                dht=node,
                prefix=f"pytest-trigger-{patched}",
                min_matchmaking_time=0.5,
                request_timeout=request_timeout,
                target_group_size=3,
                start=True,
            )
            for v, node in zip(values, nodes(3), strict=True)
        ]
        try:
            begin = get_dht_time() + 0.5
            controls = [
                a.step(wait=False, scheduled_time=begin, require_trigger=i == 1, timeout=60)
                for i, a in enumerate(group)
            ]
            assert wait_until(
                lambda: (
                    controls[1].stage == AveragingStage.AWAITING_TRIGGER
                    and controls[0].stage == controls[2].stage == AveragingStage.RUNNING_ALLREDUCE
                ),
                timeout=30,
                interval=0.01,
            ), [c.stage for c in controls]
            time.sleep(3 * request_timeout)  # the scenario: the trigger comes later than request_timeout
            controls[1].allow_allreduce()
            results = [c.result(timeout=60) for c in controls]
            assert all(len(r) == 3 for r in results), results
            assert not any(getattr(r, "strangers", ()) for r in results), results
            for averager in group:
                with averager.get_tensors() as (got,):
                    torch.testing.assert_close(got, torch.full((30_000,), sum(values) / 3))
        finally:
            for averager in group:
                averager.shutdown()


def test_a_reducer_starved_between_its_group_and_its_all_reduce_still_averages(nodes, monkeypatch):
    """Item 8's bound on the wait for an unknown group counts the reducer's own running time, not the wall
    clock. A groupmate's part can arrive just before this averager's matchmaking has noted the group it is
    in; if this averager's process is then starved (a volunteer's small CPU budget, a machine busy starting
    up) for longer than ``request_timeout``, the wall-clock bound ran out meanwhile, and the next look, a
    moment before matchmaking got its turn, answered ``BAD_GROUP_ID``: the groupmate's part was dropped and
    the round ended on half the numbers ("Reducer: received 50.0% of input tensors"). Here the first averager
    to end its matchmaking (in the averager processes, at hivemind's ``cancel_and_wait`` in
    ``look_for_group``'s ``finally``) waits 0.3 s, while its groupmate's parts arrive, then blocks its event
    loop for 3 x ``request_timeout``, then takes 0.2 s more before it notes the group."""
    import asyncio

    from hivemind.averaging import matchmaking

    request_timeout = 1.0
    armed = mp.get_context("fork").Value("i", 0)
    original = matchmaking.cancel_and_wait

    async def starved_once(task):
        with armed.get_lock():
            starve = armed.value == 1
            armed.value = 2 if starve else armed.value
        if starve:
            await asyncio.sleep(0.3)  # the groupmate's parts come, and wait for the group
            time.sleep(3 * request_timeout)  # the process gets no CPU
            await asyncio.sleep(0.2)  # then a few turns more before matchmaking notes the group
        return await original(task)

    monkeypatch.setattr(matchmaking, "cancel_and_wait", starved_once)  # forked into the averager processes
    with hivemind_as(True, *ALL_BUT_ROBUST):
        pair = [
            DecentralizedAverager(
                [torch.full((300_000,), value)],
                dht=node,
                prefix="pytest-rounds-starved-reducer",
                target_group_size=2,
                min_matchmaking_time=2.0,
                request_timeout=request_timeout,
                allreduce_timeout=MATCHMAKING,
                next_chunk_timeout=MATCHMAKING - 10,
                start=True,
            )
            for value, node in zip((0.0, 1.0), nodes(2), strict=True)
        ]
    try:
        armed.value = 1
        controls = [averager.step(wait=False, timeout=MATCHMAKING) for averager in pair]
        results = [control.result(timeout=MATCHMAKING + 15) for control in controls]
        assert armed.value == 2, "no averager was starved"
        assert all(len(r) == 2 and not getattr(r, "strangers", ()) for r in results), results
        for averager in pair:
            with averager.get_tensors() as (got,):
                torch.testing.assert_close(got, torch.full((300_000,), 0.5))
    finally:
        for averager in pair:
            averager.shutdown()


@pytest.mark.parametrize("drops", [False, True], ids=["awaited", "dropped"])
def test_a_groupmate_banned_in_the_middle_of_a_round_is_dropped_as_a_sender_at_once(
    nodes, drops, monkeypatch
):
    """Item 28. Peers A, B and X are in a round; A bans X after the round began and before X's parts came
    (here X holds them back until its trigger, as a pre-scheduled round does). A's averager then refuses X's
    parts (swarm/patches/rpc_guard.py), and hivemind's reducer awaited them until ``sender_timeout``: A's
    round, and B's, which needs A's slice, ended only then (the attack bench's 3 honest / 2 attackers row:
    rounds of 10 s, the demo's ``next_chunk_timeout``, right after an honest peer's bans). Dropped at the
    refusal, they end at once. Either way A's slice holds the mean of A's and B's numbers alone. Each averager
    is forked with its own peer's suspects table."""
    from hivemind.averaging.control import AveragingStage

    from swarm.patches import traffic
    from swarm.suspects import MIN_JUDGED, Suspects

    sender_timeout = 6.0
    size = 1_200_000  # large enough that each reduces a slice (hivemind gives a small vector to one reducer)
    gen = torch.Generator().manual_seed(7)
    a, b, x = (torch.randn(size, generator=gen) for _ in range(3))
    if not drops:  # the averager processes fork with it

        async def awaited(averager, peer_id):
            return None

        monkeypatch.setattr(allreduce, "drop_sender", awaited)
    tables = [Suspects() for _ in range(3)]
    group = []
    try:
        _fork_with_own_suspects(
            group, nodes(3), [a, b, x], tables, f"pytest-banned-in-round-{drops}", monkeypatch,
            min_matchmaking_time=MATCHMAKING, sender_timeout=sender_timeout,
        )  # fmt: skip
        # each awaits its trigger once in the group; A first: from then on A's reducer awaits X's parts, and
        # A's parts are on their way to X and B (sent once the bytes of some round go up: its calls to both
        # were made before it sent anything)
        controls = [averager.step(wait=False, timeout=60, require_trigger=True) for averager in group]
        assert wait_until(
            lambda: all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls),
            timeout=MATCHMAKING + 10,
            interval=0.01,
        ), [c.stage for c in controls]
        sent = traffic.bytes_sent()
        controls[0].allow_allreduce()
        triggered = time.monotonic()
        assert wait_until(lambda: traffic.bytes_sent() > sent, timeout=30, interval=0.01)
        for _ in range(MIN_JUDGED):  # A bans X (its table is shared with A's averager process)
            tables[0].record(str(group[2].peer_id), 0.0)
        assert tables[0].banned_for(str(group[2].peer_id)) > 0
        controls[1].allow_allreduce()
        controls[2].allow_allreduce()
        took, held = _first_two_ended(group, controls, since=triggered)
    finally:
        for averager in group:
            averager.shutdown()

    # A's slice: the mean of A and B, as both hold it; B's slice: the mean of all three, as both hold it
    both, all_three, without_a = (a + b) / 2, (a + b + x) / 3, (b + x) / 2

    def near(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
        return (got - expected).abs() <= 1e-5 * expected.abs() + 1e-6

    # B's copy tells which mean a position holds only where the means lie apart: where two of them lie within
    # the tolerance of each other (a few positions in 10^5), a value near one is near the other too, and
    # such a position of X's slice without A was taken for one with A (3 of 413,565 positions in one run)
    told = ~near(both, all_three) & ~near(all_three, without_a) & ~near(both, without_a)
    told &= ~near(all_three, both) & ~near(without_a, all_three) & ~near(without_a, both)
    assert told.float().mean() > 0.999, told.float().mean()
    own_slice = near(held[1], both) & told
    assert size / 5 < own_slice.sum() < size / 2, own_slice.sum()
    assert near(held[0], both)[own_slice].all()
    # X's slice: the mean of all three; or, where A's refusal reached X before A's parts did, X's reducer
    # dropped A as a sender (a groupmate whose reducer failed before it sent a part, item 8): the mean of B
    # and X, which A does not take (it keeps its own numbers there; seen in about 1 run in 20 under load)
    full = near(held[1], all_three) & told & ~own_slice
    dropped_a = near(held[1], without_a) & told & ~own_slice & ~full
    assert (own_slice | full | dropped_a | ~told).all()
    assert size / 5 < full.sum(), full.sum()  # B's slice at least
    assert near(held[0], all_three)[full].all(), _where_not(held[0], all_three, full, a=a, both=both)
    assert near(held[0], a)[dropped_a].all()
    # A's reducer began to await its senders after its trigger: a wait of sender_timeout ends later than that.
    # Where X's reducer dropped A, X's call back to A failed before X sent A a part, and A dropped X as a
    # sender then (item 8), whether or not its refusal did: A's round ended at once (0.81 s in a suite's run)
    if drops or dropped_a.any():
        assert took < sender_timeout, took
    else:
        assert took > sender_timeout, took


def _where_not(got: torch.Tensor, expected: torch.Tensor, among: torch.Tensor, **named: torch.Tensor) -> str:
    """Where ``got`` is not ``expected`` among the positions ``among``: how many, their first and last
    index, and how many of them hold each of the ``named`` vectors instead."""
    tolerance = 1e-5 * expected.abs() + 1e-6
    wrong = among & ((got - expected).abs() > tolerance)
    index = wrong.nonzero().flatten()
    if not len(index):
        return "none"
    held = {name: int(((got - v).abs() <= tolerance)[wrong].sum()) for name, v in named.items()}
    return f"{len(index)} of {int(among.sum())} positions, {int(index[0])}..{int(index[-1])}, holding {held}"


@pytest.mark.parametrize("sends", [False, True], ids=["refusing to call it", "sending its parts"])
def test_a_peer_sends_its_parts_to_a_groupmate_it_banned_and_takes_nothing_back(nodes, sends, monkeypatch):
    """Item 28. Peer B (which has banned nobody) assembles a group of A, B and X, where A has banned X; A
    reduces no slice (bandwidth 0, as a peer that relies on its groupmates), so X never calls A and does not
    learn of the ban. When A refused to call X, X's reducer waited ``sender_timeout`` for A's parts, and B as
    long for X's slice (in the attack bench, X had called A's reducer just before A banned it). Sending them,
    the round ends at once, and B's copy of X's slice counts A's numbers. A takes nothing from X: its copy of
    X's slice keeps its own numbers."""
    from hivemind.averaging.control import AveragingStage
    from hivemind.utils import get_dht_time

    from swarm.patches import rpc_guard
    from swarm.suspects import MIN_JUDGED, Suspects

    sender_timeout = 6.0
    size = 1_200_000  # large enough that B and X each reduce a slice
    gen = torch.Generator().manual_seed(8)
    a, b, x = (torch.randn(size, generator=gen) for _ in range(3))
    first, leader, banned = nodes(3)
    if not sends:  # the averager processes fork with it
        monkeypatch.setattr(rpc_guard, "banned_here", lambda peer_id: False)
    tables = [Suspects() for _ in range(3)]
    for _ in range(MIN_JUDGED):
        tables[0].record(str(banned.peer_id), 0.0)
    group = []
    try:
        # A reduces nothing; each declares its scheduled time (below), not 2 s from its step
        _fork_with_own_suspects(
            group, [first, leader, banned], [a, b, x], tables, f"pytest-parts-to-banned-{sends}", monkeypatch,
            min_matchmaking_time=2.0, sender_timeout=sender_timeout, bandwidths=[0.0, None, None],
        )  # fmt: skip
        # the earliest declared expiration leads: B; A and X join it (matchmaking.py, pop_next_leader), and
        # the group closes once it holds all three; each then awaits its trigger
        now = get_dht_time()
        controls = [
            averager.step(
                wait=False,
                scheduled_time=now + (8 if averager is group[1] else 14),
                timeout=60,
                require_trigger=True,
            )
            for averager in group
        ]
        assert wait_until(
            lambda: all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls),
            timeout=30,
            interval=0.01,
        ), [c.stage for c in controls]
        triggered = time.monotonic()
        for control in controls:
            control.allow_allreduce()
        took, held = _first_two_ended(group, controls, since=triggered)
    finally:
        for averager in group:
            averager.shutdown()

    # X's reducer began to await its senders once triggered: a wait of sender_timeout ends later than that
    assert (took < sender_timeout) if sends else (took > sender_timeout), took
    # B's slice: the mean of all three, as both hold it; X's slice: A's own numbers in A's copy, and in B's
    # the mean of all three if A sent its parts (else of B's and X's, after the wait)
    everyone = (a + b + x) / 3
    banned_slice = (held[0] - a).abs() < (held[0] - everyone).abs()
    assert size / 5 < banned_slice.sum() < size * 4 / 5, banned_slice.sum()
    torch.testing.assert_close(held[0][~banned_slice], everyone[~banned_slice], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(held[0][banned_slice], a[banned_slice])
    torch.testing.assert_close(held[1][~banned_slice], everyone[~banned_slice], rtol=1e-5, atol=1e-6)
    in_banned_slice = everyone if sends else (b + x) / 2
    torch.testing.assert_close(held[1][banned_slice], in_banned_slice[banned_slice], rtol=1e-5, atol=1e-6)


def _fork_with_own_suspects(
    group: list,
    nodes: list,
    vectors: list,
    tables: list,
    prefix: str,
    monkeypatch,
    bandwidths=None,
    **options,
) -> None:
    """Append to ``group`` a DecentralizedAverager of each vector on each node (groups of 3), each forked with
    its own peer's suspects table (``tables``), every process-wide change but the robust reducer installed."""
    from swarm.patches import robust

    with hivemind_as(True, *ALL_BUT_ROBUST):
        for node, vector, table, bandwidth in zip(
            nodes, vectors, tables, bandwidths or [None] * len(nodes), strict=True
        ):
            monkeypatch.setattr(robust, "_suspects", table)  # forked into this averager's process
            group.append(
                DecentralizedAverager(
                    [vector.clone()],
                    dht=node,
                    prefix=prefix,
                    target_group_size=3,
                    request_timeout=1.5,
                    bandwidth=bandwidth,
                    start=True,
                    **options,
                )
            )


def _first_two_ended(group: list, controls: list, since: float) -> tuple[float, list[torch.Tensor]]:
    """Once the round of the first two averagers has ended (in a group of 3): the seconds since ``since``,
    and what each of them holds."""
    assert wait_until(lambda: controls[0].done() and controls[1].done(), timeout=30, interval=0.01)
    took = time.monotonic() - since
    assert all(len(c.result()) == 3 for c in controls[:2]), [c.result() for c in controls[:2]]
    held = []
    for averager in group[:2]:
        with averager.get_tensors() as (got,):
            held.append(got.clone())
    return took, held


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param("plain", marks=PLAIN, id="plain hivemind"),
        pytest.param("patched", id="patched"),
        pytest.param("mixed", id="one groupmate without the change"),
    ],
)
def test_an_int8_round_ends_with_the_same_numbers_in_every_groupmate(nodes, variant):
    """Item 35. Three averagers average gradient-like vectors (one shared direction, each with noise of its
    own) in 8 bits, each reducing a third of them. hivemind's reducer sends each sender the difference between
    the average and that sender's part, compressed (allreduce.py:353-355), so each groupmate ends the round
    with the average plus a rounding error of its own. The gradient averager's class (``EndsWithOneResult``)
    asks its reducers for the average itself, serialized once, so that every groupmate holds the same numbers
    to float rounding, and as close to the exact mean. A groupmate without the change (an older peer) still
    averages correctly with the others: it neither asks for the average nor answers with it, so the two with
    the change hold the same numbers except in its third."""
    from hivemind.compression import Uniform8BitQuantization

    gen = torch.Generator().manual_seed(35)
    size = 300_000
    shared = torch.randn(size, generator=gen)
    vectors = [shared + 2 * torch.randn(size, generator=gen) for _ in range(3)]
    mean = sum(vectors) / 3
    ends_alike = type("DecentralizedAverager", (allreduce.EndsWithOneResult, DecentralizedAverager), {})
    changed = {"plain": [False] * 3, "patched": [True] * 3, "mixed": [True, True, False]}[variant]
    # the averager processes are forked as hivemind is then: a plain mean (the vectors' noise is large), and
    # hivemind's 8-bit decoding mended (the compression patch) with or without this change
    without = tuple(name for name in ALL_BUT_ROBUST if name != "allreduce")
    group = []
    for node, vector, patched in zip(nodes(3), vectors, changed, strict=True):
        with hivemind_as(True, *(ALL_BUT_ROBUST if patched else without)):
            group.append(
                (ends_alike if patched else DecentralizedAverager)(
                    [vector.clone()],
                    dht=node,
                    prefix=f"pytest-one-result-{variant}",  # the shared nodes keep other variants' records
                    compression=Uniform8BitQuantization(),
                    # parts of 50,000 numbers in 8 bits (partition.py:70-72): two for each peer to reduce
                    # (with hivemind's 512 KiB the whole vector is one part, and one peer reduces it all)
                    part_size_bytes=50_000,
                    target_group_size=3,
                    min_matchmaking_time=MATCHMAKING,
                    request_timeout=1.5,
                    start=True,
                )
            )
    try:
        round_results([a.step(wait=False, timeout=MATCHMAKING + 10) for a in group], size=3)
        held = []
        for averager in group:
            with averager.get_tensors() as (got,):
                held.append(got.clone())
    finally:
        for averager in group:
            averager.shutdown()
    # 256 buckets over +-3 standard deviations of what is sent: about 0.7 % of its spread in each number
    errors = [float(torch.linalg.vector_norm(h - mean) / torch.linalg.vector_norm(mean)) for h in held]
    assert max(errors) < 0.03, errors
    scale = float(mean.abs().max())
    differ = [int(((h - held[0]).abs() > 1e-6 * scale).sum()) for h in held[1:]]
    if variant == "plain":
        assert min(differ) > size * 0.9, differ
    elif variant == "patched":
        assert differ == [0, 0], differ
        norms = [float(torch.linalg.vector_norm(h, dtype=torch.float64)) for h in held]
        assert max(norms) - min(norms) <= wiring.AGREEMENT_RTOL * max(norms), norms  # item 16 sees one state
    else:  # the third reduced by the groupmate without the change differs, and it alone
        assert size / 3 * 0.9 < differ[0] <= size / 3, differ
        assert differ[1] > size * 0.9, differ


@PLAIN_OR_PATCHED
def test_a_float16_state_round_leaves_its_groupmates_in_one_state(nodes, patched):
    """Item 36. Three peers' state averagers (``--compression fp16``: parameters as float16) hold weights near
    1 (LayerNorm's), apart by about 1e-2, as after a round that one of them missed. hivemind's reducer
    answers each sender with the difference between the average and the sender's part as it decoded it,
    float16 (allreduce.py:353-355), and the sender added that to its own float32 numbers: each groupmate
    then held the average plus its own float16 rounding of its weights, up to 4.9e-4 at 1, the peers never
    agreed (item 16) and every later state round ran and left them apart again. With the change the sender
    adds the difference to the part it sent, as decoded: the groupmates differ only by the rounding of the
    difference, about 2^-11 of their distance, and agree."""
    from hivemind.optim.state_averager import TrainingStateAverager

    from swarm.compression import parse_compression
    from swarm.patches import state_averager

    gen = torch.Generator().manual_seed(36)
    size = 20_000
    weights = [1 + 1e-2 * torch.randn(size, generator=gen) for _ in range(3)]
    mean = sum(weights) / 3
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    cls = state_averager.state_averager_class(TrainingStateAverager) if patched else TrainingStateAverager
    group = []
    with hivemind_as(patched, *ALL_BUT_ROBUST):  # a plain mean: the robust reducer clips far groupmates
        for node, p in zip(nodes(3), params, strict=True):
            group.append(
                cls(
                    dht=node,
                    params=[p],
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                    prefix=f"pytest-state-fp16-{patched}",
                    compression=parse_compression("fp16").state_compression(),
                    target_group_size=3,
                    min_matchmaking_time=MATCHMAKING,
                    request_timeout=1.5,
                    start=True,
                )
            )
    try:
        with ThreadPoolExecutor(len(group)) as pool:
            steps = [
                pool.submit(a.step, averaging_round=True, averaging_opts=dict(timeout=MATCHMAKING + 10))
                for a in group
            ]
            for step in steps:
                step.result(timeout=MATCHMAKING + 20)
    finally:
        for averager in group:
            averager.shutdown()
    held = [p.detach().clone() for p in params]
    apart = [float((h - held[0]).abs().max()) for h in held[1:]]
    errors = [float((h - mean).abs().max()) for h in held]
    spread = float(max((w - mean).abs().max() for w in weights))
    norms = [float(torch.linalg.vector_norm(h, dtype=torch.float64)) for h in held]
    one_state = max(norms) - min(norms) <= wiring.AGREEMENT_RTOL * max(norms)
    if patched:
        # the differences back are below the spread, and are rounded to 2^-11 of it; the two senders' parts
        # are rounded on their way (2^-11 of a weight at most), and the mean moves by a third of each
        top = float(max(w.abs().max() for w in weights))
        assert max(apart) <= 2 * 2**-11 * spread, (apart, spread)
        assert max(errors) <= 2 / 3 * 2**-11 * top + 2**-11 * spread, (errors, top, spread)
        assert one_state, norms
    else:
        assert min(apart) > 1e-4, apart  # float16's rounding of the weights themselves, each its own
        assert not one_state, norms


@pytest.mark.parametrize("zero", [False, True], ids=["hivemind: own numbers", "one result: zeros"])
def test_a_slice_whose_reducer_died_comes_back_alike_in_every_survivor(zero):
    """Item 38. Two survivors of a group of three, whose third groupmate died in the middle of the round: each
    holds the live reducers' averages for their slices (one result, item 35), and neither got the dead
    reducer's slice back. hivemind's ``register_failed_reducer`` (partition.py:128-136) keeps each survivor's
    own numbers there, so the two end the round apart by the difference of their own parts (with DiLoCo
    pseudo-gradients, their anchors part, and the outer momentum carries it on); in a round that must end with
    one result the slice comes back as zeros, alike in both. hivemind's own TensorPartContainer, as its
    all-reduce fills and reads it (averager.py:553-557 adds each output to the local tensor)."""
    gen = torch.Generator().manual_seed(38)
    size, dead = 30_000, 2
    average = torch.randn(size, generator=gen)  # what the live reducers answered (the same to both)
    held, missing = [], []
    for _ in range(2):
        local = torch.randn(size, generator=gen)
        container = TensorPartContainer([local], [1.0, 1.0, 1.0], part_size_bytes=4_000)
        offset, lost = 0, slice(0, 0)
        for peer in range(3):
            parts = [part for part, _ in container._input_parts_by_peer[peer]]
            if peer == dead:
                lost = slice(offset, offset + sum(len(p) for p in parts))
                allreduce.register_missing(container, peer, zero=zero)
            else:
                for index, part in enumerate(parts):
                    container.register_processed_part(
                        peer, index, average[offset : offset + len(part)] - part
                    )
                    offset += len(part)

        async def outputs(container=container) -> list[torch.Tensor]:
            return [delta async for delta in container.iterate_output_tensors()]

        (delta,) = asyncio.run(outputs())
        held.append(local + delta)
        assert container.failed_size == lost.stop - lost.start  # what Gathered.received reads
        container.finalize()  # as the runner does ("Averaging: received 66.7% results")
        missing.append((lost, local[lost].clone()))
    (lost, _), (lost_too, _) = missing
    assert lost == lost_too and size / 3 * 0.9 < lost.stop - lost.start < size / 3 * 1.1, lost
    kept = torch.ones(size, dtype=torch.bool)
    kept[lost] = False
    for h in held:  # the live reducers' slices: their average, in both variants
        torch.testing.assert_close(h[kept], average[kept])
    if zero:  # the same numbers, to the float rounding of local + (average - local)
        torch.testing.assert_close(held[0], held[1], rtol=0, atol=1e-6)
        assert not held[0][lost].any() and not held[1][lost].any()
    else:
        for h, (_, own) in zip(held, missing, strict=True):
            assert torch.equal(h[lost], own)
        assert float((held[0] - held[1]).abs().max()) > 1.0  # two survivors, two results
