"""Bytes this peer sends in averaging rounds, counted by the averagers themselves (not estimated).

hivemind's all-reduce is a ``AllReduceRunner`` per round, inside each averager's own process: it streams this
peer's tensor parts to their reducers, and, as a reducer, streams the averaged parts back. ``install()``
replaces the runner with a subclass that adds the serialized size of every message it sends to a counter in
shared memory, so the training process can read it. Gradient rounds (the gradient averager, or DiLoCo's
pseudo-gradients) and state rounds (parameters, and the optimizers' statistics where they are averaged) are
counted apart, by the averager's prefix; state downloads by newcomers do not count (they are not rounds).

The subclass keeps hivemind's class name, as hivemind names its RPC handlers after the class.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

_sent: Any = None  # {"gradients": mp.Value('d'), "state": mp.Value('d')}: bytes sent in all-reduce rounds


def install() -> None:
    """Count from now on; call before any averager process starts (they inherit the counter). Idempotent."""
    global _sent
    if _sent is not None:
        return
    from hivemind.averaging import allreduce, averager

    context = mp.get_context("fork")
    counters = {"gradients": context.Value("d", 0.0), "state": context.Value("d", 0.0)}

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

    averager.AllReduceRunner = AllReduceRunner
    _sent = counters


def bytes_sent(kind: str | None = None) -> float:
    """Bytes sent in averaging rounds since install() (0 if not installed): all, or of ``kind`` (gradients or
    state) only."""
    if _sent is None:
        return 0.0
    return float(sum(c.value for k, c in _sent.items() if kind in (None, k)))
