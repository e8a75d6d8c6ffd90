"""Peers that others cannot dial find out by themselves and switch to client mode (swarm/net/reach.py).

On 127.0.0.1 an unreachable peer is one that announces a port nothing listens on (a forgotten port forward, a
closed security group). In network namespaces (root only) two peers sit behind firewalls that let no
connection in, as a home router's NAT does, and train with a public one through the plain join line.
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import replace
from pathlib import Path

import pytest
from google.protobuf.wrappers_pb2 import BytesValue

from swarm.config import SwarmConfig
from swarm.net import reach
from swarm.net.node import DAEMON_ENV, start_node
from swarm.procs import p2p_daemons, remove_stale_sockets
from tests.helpers import PeerProcess, read_summary, synced_epochs

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _raw_request(payload: bytes, target: str, _dht, node) -> dict:
    from hivemind.p2p import PeerID

    peer = PeerID.from_base58(target.rsplit("/p2p/", 1)[1])
    answer = await node.p2p.call_protobuf_handler(peer, reach.HANDLER, BytesValue(value=payload), BytesValue)
    return json.loads(answer.value.decode())


def test_a_peer_that_no_one_can_dial_switches_to_client_mode_and_says_why(caplog):
    from functools import partial

    nodes = []
    try:
        first = start_node(SwarmConfig(host_maddrs=LOOPBACK, run_id="reach"))
        nodes.append(first)
        entry = [str(a) for a in first.dht.get_visible_maddrs()]
        joined = SwarmConfig(host_maddrs=LOOPBACK, run_id="reach", initial_peers=tuple(entry))

        reachable = start_node(joined, check_reach=True)
        nodes.append(reachable)
        assert not reachable.client_mode
        assert (reachable.reach.asked, reachable.reach.reached) == (1, 1), reachable.reach

        closed = f"/ip4/127.0.0.1/tcp/{_closed_port()}"
        with caplog.at_level(logging.WARNING, logger="swarm.net.node"):
            hidden = start_node(
                SwarmConfig(
                    host_maddrs=LOOPBACK,
                    run_id="reach",
                    initial_peers=tuple(entry),
                    announce_maddrs=(closed,),
                ),
                check_reach=True,
            )
        nodes.append(hidden)
        assert hidden.client_mode, "a peer no one could dial stays a full peer"
        assert hidden.reach.unreachable and hidden.reach.addresses == [closed]
        (warning,) = [r.getMessage() for r in caplog.records if "switching to client mode" in r.getMessage()]
        # both peers it knows were asked (the first and the reachable one)
        assert (
            f"0 of 2 peers could dial {closed}; all dials failed" in warning and "--announce-maddr" in warning
        ), warning
        # its join line names a peer that others can dial, not its own dead address
        assert entry[0] in hidden.join_command() and closed not in hidden.join_command()

        # with the check off, the announced address is trusted as given
        closed2 = f"/ip4/127.0.0.1/tcp/{_closed_port()}"
        trusting = start_node(
            replace(joined, announce_maddrs=(closed2,), auto_client_mode=False), check_reach=True
        )
        nodes.append(trusting)
        assert not trusting.client_mode and trusting.reach is None

        # a malformed request gets an answer that says so, and the server goes on serving others
        bad = trusting.dht.run_coroutine(partial(_raw_request, b"\xff{not json", entry[0]))
        assert bad == {"reached": None, "why": "malformed request"}
        other = start_node(joined)  # no check of its own: its first request
        nodes.append(other)
        good = other.dht.run_coroutine(partial(_raw_request, json.dumps(entry).encode(), entry[0]))
        assert good["reached"] is False  # `entry` is the server's own address, not the caller's
    finally:
        for node in reversed(nodes):
            node.stop()
        remove_stale_sockets(since=0, exclude_own=True, settle=1.0)


async def _answer_late(_dht, node) -> None:
    """Replace this node's dial-back handler by one that answers nothing for a minute (a peer on a small CPU
    budget, a slow link)."""
    import asyncio

    async def late(request: BytesValue, context) -> BytesValue:
        await asyncio.sleep(60.0)
        return BytesValue(value=b"{}")

    await node.p2p.remove_protobuf_handler(reach.HANDLER)
    await node.p2p.add_protobuf_handler(reach.HANDLER, late, BytesValue)


def test_the_first_peer_that_dials_back_settles_the_check():
    """A newcomer that knows a peer that answers late and one that dials it back is reachable as soon as the
    second answers: the late one is not waited for (its answer would have come only after the check's
    timeout, as an error). ``swarm-peer status`` still waits for every answer (``every``)."""
    nodes = []
    try:
        late = start_node(SwarmConfig(host_maddrs=LOOPBACK, run_id="reach-late"))
        nodes.append(late)
        late.dht.run_coroutine(_answer_late)
        prompt = start_node(SwarmConfig(host_maddrs=LOOPBACK, run_id="reach-late"))
        nodes.append(prompt)
        entries = [str(n.dht.get_visible_maddrs()[0]) for n in (late, prompt)]
        joined = SwarmConfig(host_maddrs=LOOPBACK, run_id="reach-late", initial_peers=tuple(entries))
        newcomer = start_node(joined, check_reach=True)
        nodes.append(newcomer)
        assert not newcomer.client_mode
        verdict = newcomer.reach
        # the late one was not waited for: its call, cancelled, left no error (a timeout would have). The
        # prompt one was asked once the late one had not answered for STAGGER seconds
        assert (verdict.asked, verdict.reached, verdict.errors) == (1, 1, []), verdict
        assert verdict.sent == 2 and verdict.seconds >= reach.STAGGER, verdict
    finally:
        for node in reversed(nodes):
            node.stop()
        remove_stale_sockets(since=0, exclude_own=True, settle=1.0)


def test_a_peer_that_the_first_peer_asked_dials_back_asks_no_other():
    """A newcomer that knows three peers that can all dial it asks the first alone: its dial-back settles
    the check, and the other two start no p2p daemon for it."""
    nodes = []
    try:
        first = start_node(SwarmConfig(host_maddrs=LOOPBACK, run_id="reach-one"))
        nodes.append(first)
        entry = tuple(str(a) for a in first.dht.get_visible_maddrs())
        joined = SwarmConfig(host_maddrs=LOOPBACK, run_id="reach-one", initial_peers=entry)
        for _ in range(2):
            nodes.append(start_node(joined))
        known = tuple(str(n.dht.get_visible_maddrs()[0]) for n in nodes)
        newcomer = start_node(
            SwarmConfig(host_maddrs=LOOPBACK, run_id="reach-one", initial_peers=known), check_reach=True
        )
        nodes.append(newcomer)
        verdict = newcomer.reach
        assert (verdict.sent, verdict.asked, verdict.reached, verdict.errors) == (1, 1, 1, []), verdict
        assert not newcomer.client_mode
    finally:
        for node in reversed(nodes):
            node.stop()
        remove_stale_sockets(since=0, exclude_own=True, settle=1.0)


def _lab_unavailable() -> str | None:
    from peer.bench.netns import unavailable

    return unavailable()


# 94 s; the NAT peers stop by --max-time
@pytest.mark.slow
@pytest.mark.skipif(_lab_unavailable() is not None, reason=f"network namespaces: {_lab_unavailable()}")
def test_two_peers_behind_firewalls_train_through_a_public_one(peers, tmp_path):
    """The join line alone: the firewalled peers switch to client mode and average through the public peer."""
    import sys

    from peer.bench.netns import Lab

    common = ["--config", "demo", "--run-id", "pytest-nat", "--log-dir", str(tmp_path), "--threads", "1"]
    common += ["--log-every", "0.5", "--target-batch-size", "512"]
    # the demo config stops at global epoch 120, which the public peer reached alone before the others had
    # joined (twice, in busy suites; the second time the joiners loaded epoch 117 and 120 and stopped at once)
    common += ["--max-epochs", "1000000"]
    with Lab(3, 100, tag=f"n{tmp_path.name[-4:]}", firewalled={1, 2}) as lab:
        # the public peer trains until the test stops it, so it is there however long the others take to join
        public = PeerProcess(
            "public",
            ["join", *common, "--peer-name", "public", "--seed", "0"]
            + ["--host-maddr", f"/ip4/{lab.address(0)}/tcp/0"],
            peers,
            launcher=[*lab.prefix(0), sys.executable],
        )
        address = public.join_address(timeout=120)
        hidden = [
            PeerProcess(
                f"nat{i}",
                ["join", *common, "--peer-name", f"nat{i}", "--seed", str(i), "--max-time", "40"]
                + ["--host-maddr", f"/ip4/{lab.address(i)}/tcp/0", "--initial-peers", address],
                peers,
                launcher=[*lab.prefix(i), sys.executable],
            )
            for i in (1, 2)
        ]
        for peer in hidden:
            everyone = "\n".join(f"--- {p.name}\n" + p.output()[-3000:] for p in [public, *hidden])
            assert peer.wait(timeout=300) == 0, everyone
        assert public.stop(grace=30) == 0, public.output()[-3000:]
    for peer in hidden:
        assert "switching to client mode" in peer.output(), peer.output()[-4000:]
    assert "switching to client mode" not in public.output()
    summaries = {p.name: read_summary(tmp_path, "pytest-nat", p.name) for p in [public, *hidden]}
    for name in ("nat1", "nat2"):
        # they averaged gradients with the others (their parts went to the public peer, the reducer) ...
        rounds = summaries[name]["round_ends"]
        assert rounds["averaged"] >= 5 and summaries[name]["bytes_sent_gradients"] > 0, (name, rounds)
        # ... and so held the public peer's parameters
        common_epochs, equal = synced_epochs(summaries["public"], summaries[name], rel=1e-6)
        assert len(common_epochs) >= 5 and equal, (name, common_epochs, equal)


def _daemon_environment(dht_pid: int) -> dict[str, str]:
    """The environment of the p2p daemon that the DHT process ``dht_pid`` started."""
    for pid in p2p_daemons(dht_pid):
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    raise AssertionError(f"no p2p daemon is a child of the DHT process {dht_pid}")


def test_the_p2p_daemon_runs_on_one_thread_with_a_lazier_garbage_collector_unless_the_user_says(monkeypatch):
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    monkeypatch.setenv("GOGC", "150")  # the user's value wins
    node = start_node(SwarmConfig(host_maddrs=LOOPBACK, run_id="daemon-env"))
    try:
        env = _daemon_environment(node.dht.pid)
        assert env.get("GOMAXPROCS") == "1" and env.get("GOGC") == "150", {k: env.get(k) for k in DAEMON_ENV}
    finally:
        node.stop()
    monkeypatch.delenv("GOGC")
    node = start_node(SwarmConfig(host_maddrs=LOOPBACK, run_id="daemon-env"))
    try:
        env = _daemon_environment(node.dht.pid)
        assert {k: env.get(k) for k in DAEMON_ENV} == DAEMON_ENV == {"GOMAXPROCS": "1", "GOGC": "400"}
    finally:
        node.stop()
