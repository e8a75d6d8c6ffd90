"""The DHT nodes that a module of tests/patches shares."""

from __future__ import annotations

import time

import pytest

from tests.conftest import _dht_nodes


@pytest.fixture(scope="module")
def nodes(request):
    """``nodes(n)``: n of the DHT nodes shared by this module's tests; the module's ``NODES`` (default 2) are
    started before its first test. No patch of swarm/patches changes a DHT process, so each test installs the
    patches, or not, around what it builds."""
    nodes_of = _dht_nodes(time.time())
    started = next(nodes_of)
    started(getattr(request.module, "NODES", 2))
    yield started
    next(nodes_of, None)  # shuts them down
