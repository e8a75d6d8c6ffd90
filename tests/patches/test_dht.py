"""What swarm/patches/dht.py changes: the DHT process survives requests from processes that exit meanwhile.
Each scenario runs on plain hivemind.DHT, where it shows the failure, and on the DHT of a swarm node
(SwarmDHT).

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
