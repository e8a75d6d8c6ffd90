"""What swarm/patches/traffic.py changes: the bytes that averaging rounds send are counted, gradient rounds
and state rounds apart. The scenario runs on plain hivemind, which counts nothing, and with the patch."""

from __future__ import annotations

import torch
from hivemind.averaging import DecentralizedAverager

from swarm import patches
from swarm.patches import traffic
from tests.patches.common import MATCHMAKING, PLAIN_OR_PATCHED, hivemind_as

NUMBERS = 10_000  # one float32 tensor, one part (hivemind/averaging/partition.py: parts of up to 512 KiB)


def _counted() -> dict[str, float]:
    return {kind: traffic.bytes_sent(kind) for kind in ("gradients", "state")}


@PLAIN_OR_PATCHED
def test_bytes_sent_in_rounds_are_counted_gradients_and_state_apart(nodes, patched):
    """Two peers, each with a gradient averager and a state averager (hivemind.Optimizer's prefixes,
    ``<run>_grad_averager`` and ``<run>_state_averager``), average one round of each. hivemind's
    AllReduceRunner streams the parts and the averaged parts back (averaging/allreduce.py:247 and 335) and
    counts nothing: with plain hivemind the counters do not move. With the patch, the averager processes add
    every message they send to the counter of its kind: a round of NUMBERS float32 numbers between two peers
    sends them once as parts and once averaged back (the whole tensor is one part, which one peer sends and
    the other returns averaged), 2 x 4 x NUMBERS bytes and the messages' headers, counted as gradients or as
    state, never both."""
    run = f"pytest-traffic-{patched}"  # the shared nodes keep the other variant's records
    opts = dict(target_group_size=2, min_matchmaking_time=MATCHMAKING, request_timeout=1.5, start=True)
    with patches.installed("traffic"):
        pass  # the counters exist from the first install on: on plain hivemind too, they could move
    assert traffic._sent is not None
    with hivemind_as(patched):
        averagers = {
            kind: [
                DecentralizedAverager(
                    [torch.full((NUMBERS,), float(i))], dht=node, prefix=f"{run}_{kind}", **opts
                )
                for i, node in enumerate(nodes(2))
            ]
            for kind in ("grad_averager", "state_averager")
        }
    try:
        counted = [_counted()]
        for kind in ("grad_averager", "state_averager"):
            controls = [a.step(wait=False, timeout=MATCHMAKING + 10) for a in averagers[kind]]
            assert all(len(c.result(timeout=MATCHMAKING - 5)) == 2 for c in controls)
            counted.append(_counted())
        grads = {k: counted[1][k] - counted[0][k] for k in counted[0]}
        state = {k: counted[2][k] - counted[1][k] for k in counted[0]}
        if not patched:
            assert grads == state == {"gradients": 0.0, "state": 0.0}, (grads, state)
            return
        payload, headers = 2 * 4 * NUMBERS, 200  # two messages: 77 bytes of headers in all, measured
        assert payload < grads["gradients"] < payload + headers and grads["state"] == 0.0, grads
        assert payload < state["state"] < payload + headers and state["gradients"] == 0.0, state
    finally:
        for group in averagers.values():
            for averager in group:
                averager.shutdown()
