"""The DHT nodes that a module of tests/patches shares."""

from __future__ import annotations

import time

import pytest

from swarm.patches.dht import SwarmDHT
from tests.conftest import _dht_nodes


@pytest.fixture(scope="module")
def nodes(request):
    """``nodes(n)``: n of the DHT nodes shared by this module's tests; the module's ``NODES`` (default 2) are
    started before its first test. Each test installs the patches, or not, around the averagers it builds.

    The nodes are SwarmDHT (swarm/patches/dht.py), the DHT of every swarm node: they outlive each test, and
    a plain hivemind.DHT process dies when an averager process exits while the DHT reads its request (as one
    can when a test shuts its averagers down), which hung the module's next test for pytest's 600 s (seen
    once in a fresh-clone suite, ``add_validators`` of the next test's optimizer never answered). What the
    tests show about averagers is the same on either DHT."""
    nodes_of = _dht_nodes(time.time(), SwarmDHT)
    started = next(nodes_of)
    started(getattr(request.module, "NODES", 2))
    yield started
    next(nodes_of, None)  # shuts them down
