"""What swarm/patches/dht_store.py changes: a store in a swarm that fits in one beam goes to the nodes this
node knows, without first asking each of them for its neighbours, and a read there asks the nodes nearest to
its key, where the stores went, not every node. On plain hivemind.DHT every store searches and every read of
the latest value asks every node; on the DHT of a swarm node (SwarmDHT) neither does, and the records land
on and are read from the same nodes, newcomers included."""

from __future__ import annotations

import time
from functools import partial

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time

from swarm.patches.dht import SwarmDHT
from swarm.waiting import wait_until
from tests.conftest import _dht_nodes
from tests.patches.common import PLAIN_OR_PATCHED

STORES = 4  # records stored per phase; each asserts the same
_FINDS = [0]  # in each DHT process: the rpc_find calls it made (hivemind's DHTProtocol.call_find)
_STORES = [0]  # and the rpc_store calls (DHTProtocol.call_store)


class _Counted:
    """Counts the rpc_find and rpc_store calls its DHT process makes."""

    def run(self) -> None:
        from hivemind.dht.protocol import DHTProtocol

        call_find, call_store = DHTProtocol.call_find, DHTProtocol.call_store

        async def counted(protocol, *args, **kwargs):
            _FINDS[0] += 1
            return await call_find(protocol, *args, **kwargs)

        async def counted_store(protocol, *args, **kwargs):
            _STORES[0] += 1
            return await call_store(protocol, *args, **kwargs)

        # in the DHT process only, which is forked for this test
        DHTProtocol.call_find, DHTProtocol.call_store = counted, counted_store
        super().run()


class _CountedDHT(_Counted, hivemind.DHT):
    pass


class _CountedSwarmDHT(_Counted, SwarmDHT):
    pass


async def _finds_and_known(dht, node) -> tuple[int, int]:
    return _FINDS[0], len(node.protocol.routing_table.uid_to_peer_id)


async def _calls(dht, node) -> tuple[int, int]:
    return _FINDS[0], _STORES[0]


async def _holds(key: str, dht, node) -> list:
    """The subkeys of ``key`` in this node's own storage (what other nodes stored here)."""
    found = node.protocol.storage.get(DHTID.generate(source=key))
    return sorted(subkey for subkey, _ in found.value.items()) if found is not None else []


async def _node_id(dht, node) -> DHTID:
    return node.node_id


def _finds(dht) -> int:
    return dht.run_coroutine(_finds_and_known)[0]


def _knows_all(nodes) -> bool:
    return all(d.run_coroutine(_finds_and_known)[1] == len(nodes) - 1 for d in nodes)


def _search_once(nodes) -> None:
    """Each node reads a key once, as a swarm's peers read their progress from the start: a get searches
    the swarm, and every node it asks adds it to its routing table, as it adds the nodes named in the
    answers. (Nodes started side by side, each bootstrapping through the first before the first knew the
    others, may otherwise not know each other until such a request.)"""
    for dht in nodes:
        dht.get("warm-up", latest=True)


def _knowing_each_other(more, n: int) -> list:
    """``n`` nodes of the factory ``more``, once every one knows every other."""
    nodes = more(n)
    _search_once(nodes)
    assert wait_until(lambda: _knows_all(nodes), timeout=30, interval=0.2)
    return nodes


def _store(dht, key: str, tag: str) -> None:
    for i in range(STORES):
        assert dht.store(key, f"{tag} {i}", get_dht_time() + 60, subkey=f"{tag}{i}")


@PLAIN_OR_PATCHED
def test_a_store_in_a_small_swarm_asks_nobody_for_its_neighbours(patched):
    """Five nodes that all know each other: on plain hivemind each store from the first searches (one
    ``rpc_find`` per node it knows) before it stores; with the change, none does. Either way every node holds
    every record and reads it back. A sixth node that joins is known to the storing node at once, and the
    next records land on the five nodes nearest their key, as hivemind's search would have found them."""
    nodes_of = _dht_nodes(time.time(), _CountedSwarmDHT if patched else _CountedDHT)
    more = next(nodes_of)
    try:
        nodes = _knowing_each_other(more, 5)
        before = _finds(nodes[0])
        _store(nodes[0], "small-swarm", "a")
        searched = _finds(nodes[0]) - before
        if patched:
            assert searched == 0, searched
        else:
            assert searched >= STORES * (len(nodes) - 1), searched  # one rpc_find per known node and store
        expected = sorted(f"a{i}" for i in range(STORES))
        for dht in nodes:
            assert dht.run_coroutine(partial(_holds, "small-swarm")) == expected
            got = dht.get("small-swarm", latest=True)
            assert got is not None and sorted(got.value) == expected

        nodes = more(6)  # the factory starts one more that joins through the first
        assert wait_until(lambda: nodes[0].run_coroutine(_finds_and_known)[1] == 5, timeout=30, interval=0.2)
        before = _finds(nodes[0])
        _store(nodes[0], "with-a-newcomer", "b")
        if patched:
            assert _finds(nodes[0]) == before
        key = DHTID.generate(source="with-a-newcomer")
        ids = [dht.run_coroutine(_node_id) for dht in nodes]
        nearest = sorted(range(len(nodes)), key=lambda i: key.xor_distance(ids[i]))[:5]
        expected = sorted(f"b{i}" for i in range(STORES))
        holding = [i for i, dht in enumerate(nodes) if dht.run_coroutine(partial(_holds, "with-a-newcomer"))]
        assert sorted(holding) == sorted(nearest), (holding, nearest)
        for i in holding:
            assert nodes[i].run_coroutine(partial(_holds, "with-a-newcomer")) == expected
    finally:
        next(nodes_of, None)


def test_a_node_that_knows_a_beams_worth_of_nodes_searches_as_hivemind_does():
    """With a beam of two (``bucket_size`` 2, two replicas), a node of four knows more nodes than the beam
    holds: its stores search as hivemind's do, and the records are read back from the other nodes."""
    nodes_of = _dht_nodes(time.time(), partial(_CountedSwarmDHT, bucket_size=2, num_replicas=2))
    try:
        nodes = next(nodes_of)(4)
        assert wait_until(lambda: nodes[0].run_coroutine(_finds_and_known)[1] >= 2, timeout=30, interval=0.2)
        before = _finds(nodes[0])
        _store(nodes[0], "a-full-beam", "c")
        assert _finds(nodes[0]) - before >= STORES
        got = nodes[1].get("a-full-beam", latest=True)
        assert got is not None and sorted(got.value) == sorted(f"c{i}" for i in range(STORES))
    finally:
        next(nodes_of, None)


@PLAIN_OR_PATCHED
def test_a_read_in_a_small_swarm_asks_the_nodes_nearest_its_key_and_finds_every_record(patched):
    """Seven nodes that all know each other; six of them each store their record under one key. On plain
    hivemind each read of the latest value asks every other node (6 rpc_find) and then pushes what it found
    to one more node (rpc_store, hivemind's ``cache_nearest``); with the change a read asks the 5 nodes
    nearest the key (``num_replicas``; 4 if the reader is one of them) and pushes nothing. Either way every
    read finds all six records, as does that of a newcomer that joins afterwards and reads at once, and every
    node then finds the record that the newcomer stores at once."""
    nodes_of = _dht_nodes(time.time(), _CountedSwarmDHT if patched else _CountedDHT)
    more = next(nodes_of)
    try:
        nodes = _knowing_each_other(more, 7)
        for i, dht in enumerate(nodes[1:]):
            assert dht.store("read-key", f"record {i}", get_dht_time() + 60, subkey=f"w{i}")
        expected = sorted(f"w{i}" for i in range(len(nodes) - 1))
        asked, pushed = [], []
        for _ in range(2):
            for dht in nodes:
                finds, stores = dht.run_coroutine(_calls)
                got = dht.get("read-key", latest=True)
                after = dht.run_coroutine(_calls)
                asked.append(after[0] - finds)
                pushed.append(after[1] - stores)
                assert got is not None and sorted(got.value) == expected, (got, expected)
        if patched:
            assert all(4 <= n <= 5 for n in asked), asked
            assert sum(pushed) == 0, pushed
        else:
            assert all(n == len(nodes) - 1 for n in asked), asked
            assert sum(pushed) >= 1, pushed
        newcomer = more(8)[-1]
        got = newcomer.get("read-key", latest=True)
        assert got is not None and sorted(got.value) == expected, (got, expected)
        assert newcomer.store("read-key", "the newcomer's", get_dht_time() + 60, subkey="new")
        for dht in nodes:
            got = dht.get("read-key", latest=True)
            assert got is not None and sorted(got.value) == sorted([*expected, "new"]), got
    finally:
        next(nodes_of, None)
