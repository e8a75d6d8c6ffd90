"""What swarm/patches/matchmaking.py changes: groups close once every live peer is in (item 1), and a waiting
peer reads the declared averagers at most every LEADER_READS_EVERY, or LEADER_READS_QUIET once no newcomer can
be its leader (item 20), and a peer alone stops looking
after a grace (item 30). Each scenario runs on plain hivemind, where it shows the failure, and with the
patch."""

from __future__ import annotations

import asyncio
import time

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.partition import AllreduceException

from swarm.patches import matchmaking
from swarm.waiting import wait_until
from tests.patches.common import MATCHMAKING, PLAIN_OR_PATCHED, hivemind_as

PLAIN_MATCHMAKING = 3.0  # plain hivemind waits all of it: short, so that the plain variant stays cheap
ALONE = 1.0  # item 20: seconds that peer A looks for a leader with nobody declared

NODES = 3  # started before the first test


@PLAIN_OR_PATCHED
def test_a_group_closes_once_every_live_peer_is_in_it(nodes, patched):
    """Item 1. Three averagers start as the swarm's do, with no target_group_size (the swarm's size is not
    known then, and changes), and all three look for a group at once. hivemind's leader accepts followers
    until the group reaches target_group_size, fixed when the averager process started, or until its declared
    expiration, min_matchmaking_time after it began looking (averaging/matchmaking.py:262-330,
    ``rpc_join_group``: outcome 1 needs target_group_size, outcome 2 waits for the expiration): with plain
    hivemind the round takes the whole matchmaking time although every peer joined within milliseconds.
    ``set_target_group_size(averager, 3)`` sets the size in the running averager process: the round ends
    long before the 30 s matchmaking time."""
    matchmaking_time = MATCHMAKING if patched else PLAIN_MATCHMAKING
    with hivemind_as(patched):
        group = [
            DecentralizedAverager(
                [torch.full((3,), float(i))],
                dht=node,
                prefix=f"pytest-full-{patched}",  # the shared nodes keep the other variant's records
                min_matchmaking_time=matchmaking_time,
                request_timeout=1.5,
                start=True,
            )
            for i, node in enumerate(nodes(3))
        ]
    try:
        if patched:
            for averager in group:
                matchmaking.set_target_group_size(averager, 3, {})
        began = time.perf_counter()
        controls = [a.step(wait=False, timeout=matchmaking_time + 10) for a in group]
        results = [c.result(timeout=MATCHMAKING - 5) for c in controls]
        spent = time.perf_counter() - began
        assert all(len(r) == 3 for r in results), results
        if patched:
            assert spent < MATCHMAKING - 5, spent
        else:
            assert spent >= PLAIN_MATCHMAKING, spent  # the leader waited for its declared expiration
        for averager in group:
            with averager.get_tensors() as (got,):
                assert torch.equal(got, torch.ones(3))
    finally:
        for averager in group:
            averager.shutdown()


@PLAIN_OR_PATCHED
def test_a_peer_waiting_for_a_groupmate_reads_the_declared_averagers_at_most_every_leader_reads_every(
    nodes, patched
):
    """Item 20, with hivemind's own matchmaking pieces (PotentialLeaders, GroupKeyManager) on two real DHT
    nodes: peer A looks for a leader for ALONE seconds with nobody declared, as a peer waits for a groupmate
    still computing. hivemind's ``PotentialLeaders.pop_next_leader`` asks for a new read whenever the queue
    holds no leader to try, and ``_update_queue_periodically`` reads at once
    (averaging/matchmaking.py:469-522): with plain hivemind the reads come back to back, each as soon as the
    one before returned. The installed loop keeps LEADER_READS_EVERY between two reads. Then B declares
    itself with an earlier expiration than A's, as a groupmate that finished later does, and A finds it as
    its leader within a few reads."""
    from hivemind.averaging.key_manager import GroupKeyManager
    from hivemind.averaging.matchmaking import PotentialLeaders
    from hivemind.utils import get_dht_time

    a, b = nodes(2)
    prefix = f"pytest-leaders-{patched}"  # the shared nodes keep the other variant's declarations
    reads: list[float] = []  # when each read began
    returned: list[float] = []  # when each read returned

    async def scenario() -> tuple[object, float]:
        key_a = GroupKeyManager(a, prefix, initial_group_bits="", target_group_size=2)
        key_b = GroupKeyManager(b, prefix, initial_group_bits="", target_group_size=2)
        real = key_a.get_averagers

        async def counted(*args, **kwargs):
            reads.append(time.monotonic())
            try:
                return await real(*args, **kwargs)
            finally:
                returned.append(time.monotonic())

        key_a.get_averagers = counted
        leaders = PotentialLeaders(a.peer_id, min_matchmaking_time=1.0, target_group_size=2)
        leaders.running.set()
        leaders.search_end_time = get_dht_time() + 30.0
        leaders.declared_expiration_time = get_dht_time() + 20.0  # as _declare_averager_periodically sets it
        updates = asyncio.create_task(leaders._update_queue_periodically(key_a))
        popping = asyncio.create_task(leaders.pop_next_leader())
        await asyncio.sleep(ALONE)  # the time A spends alone: no thread or task is ordered by it
        assert not popping.done()
        await key_b.declare_averager(key_b.current_key, b.peer_id, expiration_time=get_dht_time() + 10.0)
        # from the moment B's declaration is stored: the store's own round trip (up to 0.12 s on a loaded
        # 2-core machine) is the DHT's, not the pacing's
        declared = time.monotonic()
        leader = await asyncio.wait_for(popping, 5.0)
        found = time.monotonic() - declared
        updates.cancel()
        await asyncio.gather(updates, return_exceptions=True)
        return leader, found

    with hivemind_as(patched):
        leader, found = asyncio.run(scenario())
    gaps = [later - earlier for earlier, later in zip(reads[:-1], reads[1:], strict=True)]
    assert leader == b.peer_id
    assert len(reads) >= 5, reads  # it kept looking while alone
    assert found < 5 * matchmaking.LEADER_READS_EVERY, found
    paced = (ALONE + found) / matchmaking.LEADER_READS_EVERY + 2  # the most reads that the pacing allows
    if patched:
        assert min(gaps) >= matchmaking.LEADER_READS_EVERY * 0.95, gaps
        assert len(reads) <= paced, len(reads)
    else:
        # each read began as soon as the one before had returned: nothing waits between two reads
        pauses = [began - ended for ended, began in zip(returned[:-1], reads[1:], strict=True)]
        assert min(gaps) < matchmaking.LEADER_READS_EVERY * 0.95, gaps
        assert sorted(pauses)[len(pauses) // 2] < 0.005, pauses


QUIET_READS = 4  # item 20: reads of peer A at the quiet pace before B declares itself


@PLAIN_OR_PATCHED
def test_a_peer_that_no_newcomer_can_lead_reads_the_declared_averagers_quietly(nodes, patched):
    """Item 20, the quiet pace: peer A declared itself 2 s ahead, its ``min_matchmaking_time`` being 1 s, and
    waits for a groupmate still computing. A peer that declares itself from now on declares at least 1 s ahead
    (matchmaking.py:528-531): for A's first second (less the clock skew allowed) such a newcomer could still
    come before A as a leader, and A reads every LEADER_READS_EVERY; after that any newcomer comes after A and
    finds A by its own first read, and A reads every LEADER_READS_QUIET. With plain hivemind, back to back
    all along. B then declares itself, later than A, and A still takes no leader: B would join A."""
    from hivemind.averaging.key_manager import GroupKeyManager
    from hivemind.averaging.matchmaking import PotentialLeaders
    from hivemind.utils import get_dht_time

    a, b = nodes(2)
    prefix = f"pytest-quiet-{patched}"
    reads: list[float] = []  # when each read began, in dht time
    returned: list[float] = []  # when each read returned

    async def scenario() -> float:
        key_a = GroupKeyManager(a, prefix, initial_group_bits="", target_group_size=2)
        key_b = GroupKeyManager(b, prefix, initial_group_bits="", target_group_size=2)
        real = key_a.get_averagers

        async def counted(*args, **kwargs):
            reads.append(get_dht_time())
            try:
                return await real(*args, **kwargs)
            finally:
                returned.append(get_dht_time())

        key_a.get_averagers = counted
        leaders = PotentialLeaders(a.peer_id, min_matchmaking_time=1.0, target_group_size=2)
        leaders.running.set()
        leaders.search_end_time = get_dht_time() + 30.0
        declared = leaders.declared_expiration_time = get_dht_time() + 2.0
        quiet_from = declared - 1.0 + matchmaking.CLOCK_SKEW  # from then on no newcomer comes before A
        updates = asyncio.create_task(leaders._update_queue_periodically(key_a))
        popping = asyncio.create_task(leaders.pop_next_leader())
        deadline = get_dht_time() + 60.0
        while sum(t >= quiet_from for t in reads) < QUIET_READS and get_dht_time() < deadline:
            await asyncio.sleep(0.05)  # A looks for a leader, QUIET_READS reads past quiet_from
        await key_b.declare_averager(key_b.current_key, b.peer_id, expiration_time=get_dht_time() + 1.0)
        await asyncio.sleep(0.5)
        assert not popping.done()  # B comes after A: nobody to join
        popping.cancel()
        updates.cancel()
        await asyncio.gather(popping, updates, return_exceptions=True)
        return quiet_from

    with hivemind_as(patched):
        quiet_from = asyncio.run(scenario())
    early = [t for t in reads if t < quiet_from]
    late = [t for t in reads if t >= quiet_from]
    gaps = [later - earlier for earlier, later in zip(late[:-1], late[1:], strict=True)]
    assert len(early) >= 5 and len(late) >= QUIET_READS, (len(early), len(late))
    if patched:
        assert min(gaps) >= matchmaking.LEADER_READS_QUIET * 0.95, gaps
        assert len(late) <= (reads[-1] - quiet_from) / matchmaking.LEADER_READS_QUIET + 2, len(late)
    else:
        # each read began as soon as the one before had returned: nothing waits between two reads
        pauses = [began - ended for ended, began in zip(returned[:-1], reads[1:], strict=True)]
        assert sorted(pauses)[len(pauses) // 2] < 0.005, pauses


GRACE = 2.0  # item 30: seconds a peer looks for a group with nobody else declared before it gives up
ALONE_DEADLINE = 8.0  # the step's timeout: plain hivemind looks until then


@PLAIN_OR_PATCHED
def test_a_peer_whose_groupmates_left_gives_up_its_round_after_the_grace(nodes, patched):
    """Item 30. A peer whose groupmates left is still counted by its tracker, so it looks for a group of
    two while nobody else is there. hivemind's leader alone declares itself again at every expiration and
    looks on until the step's deadline (matchmaking.py:161-170, 126-128): on plain hivemind the step fails
    there with "could not find a group". ``give_up_alone`` ends it once nobody else was read as declared
    for GRACE seconds, with NobodyElseLooking, which the optimizer's wiring takes as the sign that the
    peers it counted are gone."""
    with hivemind_as(patched):
        (alone,) = [
            DecentralizedAverager(
                [torch.zeros(3)],
                dht=node,
                prefix=f"pytest-alone-{patched}",
                min_matchmaking_time=1.0,
                request_timeout=0.5,
                start=True,
            )
            for node in nodes(1)
        ]
    try:
        if patched:
            matchmaking.set_target_group_size(alone, 2, {})
            matchmaking.give_up_alone(alone, GRACE)
        control = alone.step(wait=False, timeout=ALONE_DEADLINE)
        assert wait_until(control.done, timeout=ALONE_DEADLINE + 20, interval=0.05)
        error = control.exception()
        if patched:
            assert isinstance(error, matchmaking.NobodyElseLooking), repr(error)
        else:
            assert isinstance(error, AllreduceException), repr(error)
            assert "could not find a group" in str(error), repr(error)
    finally:
        alone.shutdown()


def test_a_groupmate_that_comes_within_the_grace_is_averaged_with(nodes):
    """Item 30, the other side: a groupmate that begins looking LATE seconds after this peer (one still
    computing its last step), within the grace, is read as declared and joins: the round averages both."""
    late = 1.5
    with hivemind_as(True):
        pair = [
            DecentralizedAverager(
                [torch.full((3,), float(i))],
                dht=node,
                prefix="pytest-late-groupmate",
                min_matchmaking_time=1.0,
                request_timeout=0.5,
                start=True,
            )
            for i, node in enumerate(nodes(2))
        ]
    try:
        for averager in pair:
            matchmaking.set_target_group_size(averager, 2, {})
            matchmaking.give_up_alone(averager, late + GRACE)
        first = pair[0].step(wait=False, timeout=30.0)
        time.sleep(late)  # the groupmate's last step: no thread or task is ordered by it
        second = pair[1].step(wait=False, timeout=30.0)
        results = [c.result(timeout=MATCHMAKING) for c in (first, second)]
        assert all(len(r) == 2 for r in results), results
        for averager in pair:
            with averager.get_tensors() as (got,):
                assert torch.equal(got, torch.full((3,), 0.5))
    finally:
        for averager in pair:
            averager.shutdown()
