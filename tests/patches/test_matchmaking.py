"""What swarm/patches/matchmaking.py changes: groups close once every live peer is in (item 1), and a waiting
peer reads the declared averagers at most every LEADER_READS_EVERY (item 20)."""

from __future__ import annotations

import time

import torch
from hivemind.averaging import DecentralizedAverager

from swarm.patches import allreduce, matchmaking
from tests.patches.common import MATCHMAKING, _state


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
