"""Shared fixtures: one thread per process, and a guarantee that no process or socket outlives a test."""

from __future__ import annotations

import ast
import functools
import os
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

from swarm import patches
from swarm.procs import (
    _bound_unix_paths,
    _live_processes,
    _socket_inodes,
    group_members,
    remove_stale_sockets,
    stale_sockets,
)
from tests.helpers import PeerProcess, SharedLauncher


def pytest_collection_modifyitems(config, items):
    """The tests marked ``first`` run first."""
    items.sort(key=lambda item: item.get_closest_marker("first") is None)  # stable: the rest keep their order


def pytest_xdist_make_scheduler(config, log):
    """`make test` spreads the suite over two workers (pytest-xdist, ``--dist loadgroup``): one worker runs
    the tests that start peers as processes (those that take the ``peers`` fixture), one after another, while
    the other runs the in-process tests (with more workers, they share them). Two of the former side by side
    each took 1.3-3 times as long as alone (the monitor's 31 s -> 62 s, the faulty peer's 13 s -> 36 s), since
    each keeps more than one core busy (the 26 of them: 379 CPU-s in 284 s alone), where the in-process tests
    mostly wait (267: 157 CPU-s in 311 s). The group is found here, in the controller, which collects nothing:
    from each test function's parameters in its file. (pytest-xdist's own ``xdist_group`` marker renames node
    ids, which pytest 9 no longer lets it do.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ProcessesApart(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "processes" if _starts_processes(self.config.rootpath, nodeid) else nodeid

    return ProcessesApart(config, log)


@functools.cache
def _functions_taking_peers(path: Path) -> frozenset[str]:
    if path.suffix != ".py" or not path.is_file():
        return frozenset()
    tree = ast.parse(path.read_text())
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and "peers" in [a.arg for a in node.args.args]
    )


def _starts_processes(root: Path, nodeid: str) -> bool:
    path, _, name = nodeid.partition("::")
    return name.split("::")[-1].split("[")[0] in _functions_taking_peers(root / path)


@pytest.fixture(autouse=True, scope="session")
def _launcher():
    """The p2p daemons of the tests' own hivemind nodes run as the product's do; the launcher that forks the
    tests' peers (peer/launcher.py) ends with the session. (hivemind is imported here, in the workers, not
    when pytest-xdist's controller reads this file: that import held up the workers' start by 2 s.)"""
    from swarm.net.node import lean_daemon_env

    lean_daemon_env()
    yield
    SharedLauncher.close()


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture
def peers(request, tmp_path):
    """Registry of PeerProcess objects; every one is stopped (its whole group) when the test ends.

    Each process's whole output is kept in ``<tmp_path>/output/<name>.log`` (pytest keeps the last three
    runs' temporary directories), since a failure message shows only its tail. After stopping, the fixture
    fails the test if any process of those groups or any hivemind socket file created during the test is
    still there; it removes them either way.
    """
    started = time.time()
    registry: list[PeerProcess] = []
    held: set[str] = set()  # socket files that this test's processes held, sampled while they ran
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            held.update(_held_by([p.pgid for p in list(registry)]))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    yield registry
    done.set()
    sampler.join()
    held.update(_held_by([p.pgid for p in registry]))
    for peer in reversed(registry):
        peer.stop(grace=15.0)
    kept = tmp_path / "output"
    kept.mkdir(exist_ok=True)
    for peer in registry:
        (kept / f"{peer.name}.log").write_text(peer.output())
    leftovers = {p.name: group_members(p.pgid) for p in registry if group_members(p.pgid)}
    sockets = _lasting_stale_sockets(since=started, among=held)
    remove_stale_sockets(since=started)
    assert not leftovers, f"processes outlived the test: {leftovers}"
    assert not sockets, f"socket files outlived the test: {sockets}"


def _held_by(pgids: list[int]) -> set[str]:
    """Paths of the unix sockets that live processes of the process groups ``pgids`` hold. (The process table
    is read once for all groups: read once per group, a sample of five groups took 28 ms of CPU, four times a
    second, for as long as a test's peers ran.)"""
    wanted = set(pgids)
    pids = [pid for pid, (_, group) in _live_processes().items() if group in wanted]
    return _bound_unix_paths(mine=_socket_inodes(pids))[1] if pids else set()


def _lasting_stale_sockets(since: float, among: set[str], wait: float = 30.0) -> list[str]:
    """hivemind socket files among ``among`` (those this test's processes held) newer than ``since`` that no
    process is bound to and that nobody removes within ``wait`` seconds. With the suite spread over two
    workers (pytest-xdist), a test that runs beside this one may be stopping or killing its own peers, whose
    socket files lie in the same folder until that test removes them: a fresh-clone suite saw two such files
    still there after 5 s, and once after 30 s, at the end of a test that starts no hivemind process at all
    (two torchrun agents). Those are not this test's leftovers. A socket file that this test's processes held
    and left stays, and is reported."""
    stale = set(stale_sockets(since=since)) & among
    deadline = time.time() + wait
    while stale and time.time() < deadline:
        time.sleep(0.2)
        stale &= set(stale_sockets(since=since))
    return sorted(stale)


def _dht_nodes(started: float, cls: type | None = None):
    """A factory of DHT nodes (of class ``cls``, hivemind.DHT by default) on 127.0.0.1 that join the first;
    yields it, then shuts every node down."""
    import hivemind

    cls = cls or hivemind.DHT
    first = cls(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    nodes = [first]

    def more(n: int) -> list[hivemind.DHT]:
        # started side by side: each waits mostly for its daemon and its first contact with ``first``
        initial_peers = [str(a) for a in first.get_visible_maddrs()]
        new = [
            cls(start=False, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial_peers)
            for _ in range(n - len(nodes))
        ]
        for node in new:
            node.run_in_background(await_ready=False)
            nodes.append(node)  # shut down in the end even if another one fails to start
        for node in new:
            node.wait_until_ready()
        return nodes[:n]

    try:
        yield more
    finally:
        stops = [threading.Thread(target=node.shutdown) for node in nodes]  # each waits for its process
        for stop in stops:
            stop.start()
        for stop in stops:
            stop.join()
        remove_stale_sockets(since=started, settle=1.0)


@pytest.fixture
def dhts():
    """``dhts(n)``: n DHT nodes of a swarm node (SwarmDHT, as swarm/net/node.py starts them), with every
    process-wide patch of swarm/patches installed for the test (and taken out again after it): the averagers
    the test builds are forked with them."""
    from swarm.patches.dht import SwarmDHT

    started = time.time()
    with patches.installed():
        yield from _dht_nodes(started, SwarmDHT)


@pytest.fixture
def plain_dhts():
    """``plain_dhts(n)``: n DHT nodes with hivemind as it is, no patch installed during the test."""
    started = time.time()
    with patches.plain_hivemind():
        yield from _dht_nodes(started)
