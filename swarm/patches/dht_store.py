"""Stores and reads in a small swarm (hivemind/dht/node.py): stores straight to the nearest nodes this node
knows, reads from the nodes nearest the key, and no copy pushed after a read.

**What hivemind does.** ``DHTNode.store_many`` (node.py:351-502) finds the ``num_replicas`` (5) nodes nearest
to each key with a beam search, ``find_nearest_nodes`` with a ``found_callback`` (node.py:485-492, 278-333;
dht/traverse.py), which asks the nodes of its beam (``bucket_size``, 20, of them) for their neighbours
(``rpc_find``), one RPC per node, and only then stores the record on the nearest (``rpc_store``).

**What goes wrong.** In a swarm that fits in one beam, as the volunteer swarms this tool is for do, every node
already knows every other: a store or find that a node receives adds its caller to the routing table
(protocol.py:236 and 339, through ``rpc_ping``, 144-160), and each node searched for its own neighbours when
it joined (node.py:256). So the search of every store asks every node for what this node
knew: in a swarm of 5 nodes, 4 ``rpc_find`` calls before the 4 ``rpc_store`` calls. A peer stores about six
records per global epoch (its progress, its metrics, its matchmaking declarations), and half of what a store
cost all DHT processes and daemons was that search (docs/benchmarks.md, "Stores without the search").

**What this changes.** In the DHT process (:func:`install_in_dht_process`, called by
``swarm.patches.dht.SwarmDHT.run``), a store whose node knows fewer nodes than a beam holds (its routing
table, replacements included) takes the known nodes, nearest first, as the candidates for its replicas,
without the search; ``store_many`` then stores on them as it does after a search, and moves on to the next
candidate when one fails. A node that knows a beam's worth of nodes or more searches as hivemind does. Nodes
go on learning of each other as before: from the RPCs they receive, from their gets (which search), and at
their own join. The join's search (``find_nearest_nodes`` without a ``found_callback``) runs as hivemind's.

**Reads.** A read of the latest value (``get(..., latest=True)``: every progress, matchmaking, metrics and
config read of a swarm) searches with a beam of ``bucket_size`` (20) nodes and never stops early, since no
value is recent enough (node.py:575-665), so in a swarm of fewer than 20 nodes it asks every node: a swarm of
N peers that each read once a second serves N - 1 ``rpc_find`` per read, N x (N - 1) a second in all, and each
node's share of that grows with N. hivemind then pushes what it found to one more node (``cache_nearest``,
node.py:776-792), an ``rpc_store`` of the whole record per read. In a swarm that fits in the beam,
:func:`get_many_by_id` searches with a beam of ``num_replicas`` (5) instead: the search asks the nearest nodes
it knows or learns of from their answers, until it has asked the 5 nearest to the key, which are where the
stores above put each record (a writer that does not yet know one of them stores on the next; the others
hold the record, and a dictionary's subkeys are merged over every node asked, node.py:827-845). SwarmDHT
passes ``cache_nearest=0`` (swarm/patches/dht.py). ``swarm-peer bench --scenario dht`` (each node stores a
1.5 KB subkey record under one key and reads it back, once a round): the DHT processes and daemons spent
0.81-0.87 times the CPU of hivemind's reads with 9 nodes, 0.41-0.45 with 17, and every read found every record
(docs/benchmarks.md, "Reads that asked every node").
"""

from __future__ import annotations

import asyncio
from typing import Any

_hivemind_find_nearest_nodes: Any = None
_hivemind_get_many_by_id: Any = None


async def find_nearest_nodes(
    self: Any,
    queries: Any,
    k_nearest: int | None = None,
    beam_size: int | None = None,
    num_workers: int | None = None,
    node_to_peer_id: dict | None = None,
    exclude_self: bool = False,
    **kwargs: Any,
) -> dict:
    """``DHTNode.find_nearest_nodes``; for a store (``found_callback`` and the routing table's nodes given, as
    only ``store_many`` passes them) in a swarm that fits in the beam, the known nodes without a search."""
    found = kwargs.get("found_callback")
    beam = beam_size if beam_size is not None else max(self.protocol.bucket_size, k_nearest or 0)
    known = len(self.protocol.routing_table.uid_to_peer_id)
    if found is None or node_to_peer_id is None or known >= beam:
        return await _hivemind_find_nearest_nodes(
            self, queries, k_nearest, beam_size, num_workers, node_to_peer_id, exclude_self, **kwargs
        )
    candidates = self._filter_blacklisted(dict(node_to_peer_id))
    candidates.pop(self.node_id, None)  # store_many adds this node itself unless exclude_self
    queries = tuple(queries)
    nearest = {query: sorted(candidates, key=query.xor_distance) for query in queries}
    await asyncio.gather(*(found(query, nearest[query], set(candidates)) for query in queries))
    return {
        query: {node: candidates[node] for node in nodes[: k_nearest or len(nodes)]}
        for query, nodes in nearest.items()
    }


async def get_many_by_id(
    self: Any,
    key_ids: Any,
    sufficient_expiration_time: Any = None,
    num_workers: int | None = None,
    beam_size: int | None = None,
    return_futures: bool = False,
    _is_refresh: bool = False,
) -> dict:
    """``DHTNode.get_many_by_id``; in a swarm that fits in the beam, a search without a ``beam_size`` of its
    own stops once it has asked the ``num_replicas`` nodes nearest to each key, where stores put it."""
    if beam_size is None and len(self.protocol.routing_table.uid_to_peer_id) < self.protocol.bucket_size:
        beam_size = self.num_replicas
    return await _hivemind_get_many_by_id(
        self, key_ids, sufficient_expiration_time, num_workers, beam_size, return_futures, _is_refresh
    )


def install_in_dht_process(reads: bool = True) -> None:
    """Make ``DHTNode.find_nearest_nodes`` skip a store's search in a swarm that fits in the beam, and (with
    ``reads``) ``DHTNode.get_many_by_id`` ask only the nodes nearest the key there. Call it in the DHT's own
    process (it replaces methods of hivemind's class there, for the life of that process)."""
    global _hivemind_find_nearest_nodes, _hivemind_get_many_by_id
    from hivemind.dht.node import DHTNode

    if _hivemind_find_nearest_nodes is None:
        _hivemind_find_nearest_nodes = DHTNode.find_nearest_nodes
        _hivemind_get_many_by_id = DHTNode.get_many_by_id
    DHTNode.find_nearest_nodes = find_nearest_nodes
    DHTNode.get_many_by_id = get_many_by_id if reads else _hivemind_get_many_by_id
