"""Traffic counting (hivemind/averaging/allreduce.py): the bytes this peer sends in averaging rounds.

**What hivemind does.** Each round is an ``AllReduceRunner`` in the averager's own process (averager.py:543):
it streams this peer's tensor parts to their reducers (``_generate_input_for_peer``, allreduce.py:247) and,
as a reducer, streams the averaged parts back (``_accumulate_parts_streaming``, allreduce.py:335). It counts
nothing, and the averager process is not the training process.

**What this changes.** :func:`install` makes the averagers run a subclass that adds the serialized size of
every message it sends to a counter in shared memory, so the training process can read it
(:func:`bytes_sent`). Gradient rounds (the gradient averager, or DiLoCo's pseudo-gradients) and state rounds
(parameters, and the optimizers' statistics where they are averaged) are counted apart, by the averager's
prefix; state downloads by newcomers do not count (they are not rounds). The subclass keeps hivemind's class
name, as hivemind names its RPC handlers after the class.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

from swarm.patches._registry import Patch

_sent: Any = None  # {"gradients": mp.Value('d'), "state": mp.Value('d')}: bytes sent in all-reduce rounds


def _targets() -> list[tuple[Any, str, Any]]:
    """Count from now on; the averager processes started afterwards inherit the counters."""
    global _sent
    from hivemind.averaging import allreduce, averager

    context = mp.get_context("fork")
    if _sent is None:
        _sent = {"gradients": context.Value("d", 0.0), "state": context.Value("d", 0.0)}
    counters = _sent

    def add(prefix: str | None, n: int) -> None:
        # hivemind.Optimizer's prefixes: <run_id>_grad_averager and <run_id>_state_averager
        counter = counters["gradients" if (prefix or "").endswith("grad_averager") else "state"]
        with counter.get_lock():
            counter.value += n

    class AllReduceRunner(allreduce.AllReduceRunner):  # same name: hivemind derives RPC names from it
        async def _generate_input_for_peer(self, peer_index: int):  # this peer's parts, to their reducer
            async for message in super()._generate_input_for_peer(peer_index):
                add(self._prefix, message.ByteSize())
                yield message

        async def _accumulate_parts_streaming(self, stream: Any, sender_index: int):  # averaged, sent back
            async for message in super()._accumulate_parts_streaming(stream, sender_index):
                add(self._prefix, message.ByteSize())
                yield message

    return [(averager, "AllReduceRunner", AllReduceRunner)]


PATCH = Patch("traffic", _targets)


def bytes_sent(kind: str | None = None) -> float:
    """Bytes sent in averaging rounds since the patch was first installed (0 if never): all, or of ``kind``
    (gradients or state) only."""
    if _sent is None:
        return 0.0
    return float(sum(c.value for k, c in _sent.items() if kind in (None, k)))
