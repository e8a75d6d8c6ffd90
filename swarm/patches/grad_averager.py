"""The gradient averager (hivemind/optim/grad_averager.py): what a failed round leaves to step on.

**What hivemind does.** ``GradientAverager.step(reset_accumulators=True)`` (grad_averager.py:163-200) loads
the accumulated gradients into the averaged tensors, zeroes the accumulators and starts the all-reduce, which
changes the averaged tensors in place. When the round fails, hivemind.Optimizer "proceeds with local
gradients" by loading the accumulators again (``_load_local_gradients_into_optimizer``,
optim/optimizer.py:632-653).

**What goes wrong.** Those accumulators were zeroed: the update is weight decay and momentum only, and the
round's samples are lost (item 2 of docs/hivemind-patches.md).

**What this changes.** The class that :func:`keeping_local_gradients` builds keeps this peer's own mean
gradient of the round and loads it instead, counting how often (``local_fallbacks``). It also packs its
all-reduce into one buffer per dtype (item 3, swarm/patches/allreduce.py), names the groupmates that never
learnt of the group (item 11), sends what ``gather_hook`` returns with each round's all-gather (item 16,
swarm/patches/optimizer.py), and ends each round with the same numbers as its groupmates (item 35). The
class keeps hivemind's name (the p2p handlers' names come from it).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch

from swarm.patches import robust
from swarm.patches.allreduce import EndsWithOneResult, NamesStrangers, PacksParts


class KeepsLocalGradients:
    """Mixin for hivemind's GradientAverager and its subclasses (item 2)."""

    local_fallbacks: int
    _own_grads: list[torch.Tensor] | None
    _own_samples: int
    _own_valid: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.local_fallbacks = 0
        self._own_grads, self._own_samples, self._own_valid = None, 0, False
        self._keep_own = False
        self.on_local_fallback: Callable[[int], None] | None = None  # told the samples of a fallback step
        self.gather_hook: Callable[[], Any] | None = None  # what to send with each round's all-gather
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        # the averager's own process: its reducers judge the senders of gradient rounds (suspects.py)
        robust.score_senders_here()
        super().run()

    def schedule_step(self, *args: Any, **kwargs: Any) -> Any:
        # every round hivemind.Optimizer starts goes through here (optimizer.py, pre-scheduled or not)
        if self.gather_hook is not None and kwargs.get("gather") is None:
            kwargs["gather"] = self.gather_hook()
        return super().schedule_step(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        # hivemind's step loads the accumulators into the averaged tensors, then (reset_accumulators=True)
        # zeroes them and starts the all-reduce, which changes the averaged tensors in place
        self._own_samples = self.local_samples_accumulated
        self._keep_own = True
        try:
            return super().step(*args, **kwargs)
        finally:
            self._keep_own = False

    @torch.no_grad()
    def load_accumulators_into_averager_(self) -> None:
        if self._keep_own or self.local_times_accumulated > 0 or not self._own_valid:
            super().load_accumulators_into_averager_()
            if self._keep_own:
                self._remember_own()
            return
        # the accumulators were zeroed for a round that failed: use this peer's own gradient of that round
        self.use_own_gradients()
        self.local_fallbacks += 1
        if self.on_local_fallback is not None:
            self.on_local_fallback(self._own_samples)

    @property
    def holds_round_result(self) -> bool:
        """True between the end of a round that averaged this peer's gradient and the optimizer's use of it
        (the averaged tensors then hold the group's mean, and this peer's own gradient is kept)."""
        return self._own_valid

    @property
    def own_samples(self) -> int:
        """The samples of this peer's own gradient of the last round."""
        return self._own_samples

    @property
    def own_gradients(self) -> list[torch.Tensor] | None:
        """This peer's own mean gradient of the last round (None before the first)."""
        return self._own_grads

    @torch.no_grad()
    def use_own_gradients(self) -> None:
        """Put this peer's own mean gradient of the last round where the averaged one was."""
        if self._own_grads is None:
            raise RuntimeError("no round has kept this peer's own gradient yet")
        with self.get_tensors() as averaged:
            for mine, averaged_grad in zip(self._own_grads, averaged, strict=True):
                averaged_grad.copy_(mine)
        self._own_valid = False

    @torch.no_grad()
    def _remember_own(self) -> None:
        with self.get_tensors() as averaged:
            if self._own_grads is None:
                self._own_grads = [torch.empty_like(t) for t in averaged]
            for mine, t in zip(self._own_grads, averaged, strict=True):
                mine.copy_(t)
        self._own_valid = True

    def notify_used_averaged_gradients(self) -> None:
        self._own_valid = False  # the round's result (averaged, or this peer's own) went into the optimizer
        super().notify_used_averaged_gradients()


@cache
def keeping_local_gradients(base: type) -> type:
    """``base`` (hivemind's GradientAverager or a subclass, PowerSGD's included) with items 2, 3, 11, 16 and
    35."""
    bases = (KeepsLocalGradients, EndsWithOneResult, NamesStrangers, PacksParts, base)
    return type(base.__name__, bases, {"__module__": __name__})


def round_averager(factory: Any) -> Any:
    """A gradient averager factory (a ``functools.partial`` of a class, as swarm/compression.py makes them)
    whose class is :func:`keeping_local_gradients` of it."""
    return partial(keeping_local_gradients(factory.func), *factory.args, **factory.keywords)
