"""Everything swarm trainer changes in hivemind, one module per hivemind area, for hivemind ``SUPPORTED``
only.

=====================  =========================================================================
module                 hivemind area (and the items of docs/hivemind-patches.md it holds)
=====================  =========================================================================
``matchmaking``        averaging/matchmaking.py: groups close when full (1), paced reads (20), a
                       search with nobody else in it ends (30)
``allreduce``          averaging/allreduce.py: one buffer per dtype and role (3), groupmates that
                       never join (8), strangers named (11), banned groupmates in a formed round (28),
                       one result for the whole group (35), differences added to the part as sent
                       and partial rounds named (36)
``state_averager``     optim/state_averager.py: untorn downloads (4), judged states (7), sane
                       epochs (9), bounded state matchmaking (12), held epoch (13), paced donor
                       records (18), downloads waited for while their chunks come (37)
``grad_averager``      optim/grad_averager.py: a failed round steps on the peer's own gradient (2)
``progress``           optim/progress_tracker.py: throttled records (6), reads when speeds are
                       unknown (14, 19), the swarm expected at a new epoch (15), records that
                       speak for their signer's member (26), silent peers left out (30)
``optimizer``          optim/optimizer.py: rounds never cancelled or skipped (5, 10), judged
                       gradients (7), strangers met (11), downloads numbered (13), agreed state
                       rounds skipped (16), AdamW counters by epoch (17)
``rpc_guard``          p2p/servicer.py: averagers serve and call only admitted peers (28)
``robust``             averaging/partition.py: a robust mean of each reduced slice (21)
``traffic``            averaging/allreduce.py: bytes sent in rounds, counted
``compression``        compression/quantization.py: 8-bit decoding with NumPy >= 2.4
``dht``                dht/dht.py: a DHT process that survives senders that exit
``dht_store``          dht/node.py: in a small swarm, stores to the known nodes, reads from the nearest
``auth``               utils/auth.py, dht/protocol.py: DHT tokens bound to the channel's PeerID
=====================  =========================================================================

Two entry points:

- :func:`install` applies the process-wide changes (attributes of hivemind's classes and modules), after
  checking hivemind's version. Call it before any averager starts: an averager process is forked with the
  classes as they are then. :func:`uninstall`, and the context managers :func:`installed` and
  :func:`plain_hivemind`, put hivemind's own back (for tests).
- :func:`swarm.patches.optimizer.wire` applies the changes to one running ``hivemind.Optimizer``, built with
the
  gradient averager of :func:`swarm.patches.grad_averager.round_averager`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SUPPORTED = "1.1.12"  # the hivemind release these changes were written against and tested with


class HivemindVersionError(RuntimeError):
    """The installed hivemind is not the release the changes were written for."""


def check_version(version: str | None = None) -> None:
    """Raise HivemindVersionError (one line, with the fix) unless hivemind is ``SUPPORTED``."""
    if version is None:
        import hivemind

        version = getattr(hivemind, "__version__", "unknown")
    if version != SUPPORTED:
        raise HivemindVersionError(
            f"swarm trainer supports hivemind {SUPPORTED} only (its changes to hivemind's averagers were "
            f"written against that release), and hivemind {version} is installed: run "
            f"`pip install hivemind=={SUPPORTED}` in this environment"
        )


def process_wide() -> list[Any]:
    """The process-wide patches (``swarm.patches._registry.Patch``), in the order :func:`install` applies
    them."""
    from swarm.patches import allreduce, compression, matchmaking, robust, rpc_guard, state_averager, traffic

    # traffic replaces the averagers' AllReduceRunner with a subclass, which inherits allreduce's method
    # either way; the others touch distinct attributes, so the order is only the reading order
    return [
        compression.PATCH,
        traffic.PATCH,
        allreduce.PATCH,
        robust.PATCH,
        matchmaking.PATCH,
        state_averager.PATCH,
        rpc_guard.PATCH,
    ]


def install() -> None:
    """Check hivemind's version, then apply every process-wide patch. Idempotent."""
    check_version()
    for patch in process_wide():
        patch.install()


def uninstall() -> None:
    """Put hivemind's own attributes back, in the reverse order."""
    for patch in reversed(process_wide()):
        patch.uninstall()


@contextmanager
def installed(*names: str) -> Iterator[None]:
    """Within the block, exactly the process-wide patches named are installed (all of them if none is named);
    those installed before are installed again afterwards. For tests that compare plain hivemind
    (:func:`plain_hivemind`) with hivemind and one patch."""
    with _only(names or tuple(p.name for p in process_wide())):
        yield


@contextmanager
def plain_hivemind() -> Iterator[None]:
    """Within the block no process-wide patch is installed; those installed before are installed again
    afterwards."""
    with _only(()):
        yield


@contextmanager
def _only(names: tuple[str, ...]) -> Iterator[None]:
    patches = process_wide()
    unknown = set(names) - {p.name for p in patches}
    if unknown:
        raise ValueError(f"no such patch: {', '.join(sorted(unknown))}")
    before = [p for p in patches if p.installed]
    for patch in reversed(patches):
        patch.uninstall()
    if names:
        check_version()
    for patch in patches:
        if patch.name in names:
            patch.install()
    try:
        yield
    finally:
        for patch in reversed(patches):
            patch.uninstall()
        for patch in before:
            patch.install()
