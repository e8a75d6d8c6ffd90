"""Shared fixtures: one thread per process, and a guarantee that no process or socket outlives a test."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from swarm.procs import group_members, remove_stale_sockets, stale_sockets
from tests.helpers import PeerProcess


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture
def peers(request):
    """Registry of PeerProcess objects; every one is stopped (its whole group) when the test ends.

    After stopping, the fixture fails the test if any process of those groups or any hivemind socket
    file created during the test is still there; it removes them either way.
    """
    started = time.time()
    registry: list[PeerProcess] = []
    yield registry
    for peer in reversed(registry):
        peer.stop(grace=15.0)
    leftovers = {p.name: group_members(p.pgid) for p in registry if group_members(p.pgid)}
    sockets = stale_sockets(since=started)
    remove_stale_sockets(since=started)
    assert not leftovers, f"processes outlived the test: {leftovers}"
    assert not sockets, f"socket files outlived the test: {sockets}"
