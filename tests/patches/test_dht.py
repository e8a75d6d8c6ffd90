"""What swarm/patches/dht.py changes: the DHT process survives requests from processes that exit
meanwhile, and a process hands it the pipe for its replies once, not with every request. Each scenario runs
on plain hivemind.DHT, where it shows the failure, and on the DHT of a swarm node (SwarmDHT).

A request to the DHT process carries the pipe for its reply, which the DHT process fetches from the sender's
resource sharer (multiprocessing/resource_sharer.py) when it unpickles the request. A sender that exits
between sending and that fetch is forced here, in the sender alone: its sharer hangs while it hands the pipe
over and the sender is killed there, or its sharer is stopped before the request is sent."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from contextlib import contextmanager
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler

import hivemind
from hivemind.utils import get_dht_time

from swarm.config import SwarmConfig
from swarm.net.node import start_node
from swarm.patches.dht import SwarmDHT
from swarm.procs import remove_stale_sockets
from swarm.waiting import wait_until
from tests.patches.common import PLAIN_OR_PATCHED

RUN_ID = "pytest-dht"
WAIT = 3.0  # hivemind's own wait_timeout of a DHT node (dht/node.py), passed to the plain DHT explicitly


@contextmanager
def _dht(patched: bool):
    """A swarm node's DHT (SwarmDHT, as swarm/net/node.py starts every node), or plain hivemind.DHT."""
    started = time.time()
    node = start_node(SwarmConfig(host_maddrs=("/ip4/127.0.0.1/tcp/0",), run_id=RUN_ID)) if patched else None
    dht = (
        node.dht
        if patched
        else hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], wait_timeout=WAIT)
    )
    assert isinstance(dht, SwarmDHT) == patched
    try:
        yield dht
    finally:
        node.stop() if patched else dht.shutdown()
        remove_stale_sockets(since=started, exclude_own=True, settle=1.0)


def _killed_while_handing_over(dht: hivemind.DHT, told) -> None:
    """A sender (forked) whose resource sharer hangs once the DHT process asks it for the reply pipe, and
    tells ``told``: the test kills it there, as a process that exits while the DHT reads its request."""
    sharer = resource_sharer._resource_sharer
    register = sharer.register

    def register_hanging(send, close):
        def hand_over_and_hang(conn, pid) -> None:
            told.send("handing over")
            threading.Event().wait()

        return register(hand_over_and_hang, close)

    sharer.register = register_hanging
    dht.get("some-key", return_future=True)
    threading.Event().wait()


def _gone_before_the_read(dht: hivemind.DHT) -> None:
    """A sender (forked) whose resource sharer is stopped (its socket removed) after it registered the reply
    pipe and before the request enters the DHT's pipe, as a process that exited before the DHT read it."""
    pipe = dht._outer_pipe

    def send_when_the_sharer_is_gone(request) -> None:
        data = ForkingPickler.dumps(request)  # registers the reply pipe with this process's resource sharer
        resource_sharer.stop()
        pipe.send_bytes(data)

    pipe.send = send_when_the_sharer_is_gone
    dht.get("some-key", return_future=True)
    os._exit(0)


@PLAIN_OR_PATCHED
def test_the_dht_survives_a_sender_that_exits_while_its_request_is_read(patched, capfd):
    """A sender exits while the DHT process fetches the reply pipe of its request (an averager at Ctrl-C): the
    fetch ends in EOFError, which hivemind's ``DHT.run`` does not catch (dht/dht.py:127-132 catches OSError,
    ConnectionError and RuntimeError): with plain hivemind the DHT process dies with an EOFError traceback.
    SwarmDHT skips the request and serves the next one."""
    context = mp.get_context("fork")
    with _dht(patched) as dht:
        ours, theirs = context.Pipe()
        sender = context.Process(target=_killed_while_handing_over, args=(dht, theirs))
        sender.start()
        assert ours.poll(30) and ours.recv() == "handing over"
        os.kill(sender.pid, signal.SIGKILL)
        sender.join(timeout=30)
        if not patched:
            assert wait_until(lambda: not dht.is_alive(), timeout=30, interval=0.05)
            assert dht.exitcode == 1
            assert "\nEOFError\n" in capfd.readouterr().err  # the end of the DHT process's traceback
            return
        assert dht.get("some-key", return_future=True).result(timeout=10) is None  # read after the other
        assert dht.is_alive()


@PLAIN_OR_PATCHED
def test_a_request_whose_sender_has_gone_costs_the_dht_no_pause(patched):
    """A sender is gone before the DHT process reads its request: fetching the reply pipe fails with
    FileNotFoundError (an OSError), which hivemind's ``DHT.run`` logs with a traceback and follows with a
    pause of ``wait_timeout`` (dht/dht.py:129-132; 3 s by default, dht/node.py:108): with plain hivemind the
    next request, sent at once, is answered only after that pause. SwarmDHT skips the request and answers the
    next one at once."""
    context = mp.get_context("fork")
    with _dht(patched) as dht:
        began = time.monotonic()  # before the sender sends: the DHT reads its request later
        sender = context.Process(target=_gone_before_the_read, args=(dht,))
        sender.start()
        sender.join(timeout=30)
        assert sender.exitcode == 0
        assert dht.get("some-key", return_future=True).result(timeout=WAIT + 10) is None
        answered = time.monotonic() - began
        assert dht.is_alive()
        if not patched:
            assert answered >= WAIT, answered
        else:
            assert answered < WAIT, answered


async def _kept_reply_pipes(dht: SwarmDHT, node) -> list[int]:
    """Run in the DHT process: the PIDs whose reply pipes it keeps."""
    return sorted(pid for pid, _ in dht._inner_pipe.pipes)


def _get_in_a_forked_process(dht: hivemind.DHT, key: str, told) -> None:
    told.send(dht.get(key).value)


@PLAIN_OR_PATCHED
def test_a_process_hands_its_reply_pipe_to_the_dht_once(patched, monkeypatch):
    """Every request to the DHT process carries the pipe for its reply, which hivemind hands over through the
    sender's resource sharer each time (a descriptor duplicated and registered, then fetched over a socket of
    its own and closed after the reply): with plain hivemind 40 requests register 40 descriptors. SwarmDHT
    hands a process's reply pipe over with its first request and names it in the later ones: replies still
    reach the process, its threads and a forked process, the DHT process keeps one pipe per sending process
    and closes those of processes that ended once it keeps more than ``KEPT_PIPES`` (1 here)."""
    from swarm.patches import dht as dht_patch

    monkeypatch.setattr(dht_patch, "KEPT_PIPES", 1)  # read in the DHT process, which is forked below
    sharer = resource_sharer._resource_sharer
    registered = []
    register = sharer.register

    def counted(send, close):
        registered.append(send)
        return register(send, close)

    context = mp.get_context("fork")
    with _dht(patched) as dht:
        expires = get_dht_time() + 600
        for i in range(4):
            assert dht.store(f"key{i}", i, expires)
        monkeypatch.setattr(sharer, "register", counted)
        answers: dict[int, list[int]] = {i: [] for i in range(4)}

        def ask(i: int) -> None:
            for _ in range(10):
                answers[i].append(dht.get(f"key{i}").value)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert answers == {i: [i] * 10 for i in range(4)}
        monkeypatch.setattr(sharer, "register", register)
        if not patched:
            assert len(registered) == 40, len(registered)
            return
        assert len(registered) <= 4, len(registered)  # once; at most once per thread that raced to be first
        for i in (1, 2):  # two forked processes, each asks once and ends
            ours, theirs = context.Pipe()
            child = context.Process(target=_get_in_a_forked_process, args=(dht, f"key{i}", theirs))
            child.start()
            assert ours.poll(30) and ours.recv() == i
            child.join(timeout=30)
            assert child.exitcode == 0
        assert dht.get("key3").value == 3
        assert dht.run_coroutine(_kept_reply_pipes) == [os.getpid()]
