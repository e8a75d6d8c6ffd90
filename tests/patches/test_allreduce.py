"""What swarm/patches/allreduce.py changes: a groupmate that never joins is dropped (item 8) and named a
stranger (item 11)."""

from __future__ import annotations

import time

import torch
from hivemind.averaging import DecentralizedAverager

from swarm.patches import allreduce, matchmaking
from tests.patches.common import MATCHMAKING, _abandoning_join_request


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
