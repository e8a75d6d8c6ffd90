"""What the tests of swarm/patches share: peers that only announce progress, the swarm's state averagers,
states of mixed sizes, screened gradient rounds."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.compression import CompressionInfo, TensorRole
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.state_averager import TrainingStateAverager

from swarm import patches
from swarm.averaging.screen import RoundScreen
from swarm.patches import allreduce, grad_averager, matchmaking, progress, state_averager
from swarm.patches import optimizer as wiring
from swarm.waiting import wait_until

MATCHMAKING = 30.0  # far longer than any test waits: a round that finishes sooner closed its group early
# every scenario runs twice: on hivemind as it is, and with the change. The first shows a failure of the
# pinned hivemind release (and that the scenario provokes it), the second that the swarm's patch mends it:
# the first is marked ``plain`` and runs in `make test-slow`, the second in `make test` too
PLAIN = pytest.mark.plain
PLAIN_OR_PATCHED = pytest.mark.parametrize(
    "patched", [pytest.param(False, marks=PLAIN, id="plain hivemind"), pytest.param(True, id="patched")]
)


def round_results(controls: list, size: int, timeout: float = MATCHMAKING - 5) -> list:
    """The results of one round's step controls, each of a group of ``size``. A round that has not ended
    within ``timeout`` fails with each control's stage, not a bare TimeoutError (a round of two that hung
    once in a fresh-clone suite left nothing to go on)."""
    ended = wait_until(lambda: all(c.done() for c in controls), timeout=timeout, interval=0.05)
    stages = [getattr(c.stage, "name", c.stage) for c in controls]
    assert ended, f"the round did not end within {timeout:.0f} s; the peers' stages: {stages}"
    results = [c.result() for c in controls]
    assert all(len(r) == size for r in results), [len(r) for r in results]
    return results


# the process-wide changes but the robust reducer (test_robust.py): for tests that check a plain mean of
# groupmates whose tensors are far apart (3 unrelated random tensors, or 1, 10 and 100), which that reducer,
# by design, does not give
ALL_BUT_ROBUST = tuple(p.name for p in patches.process_wide() if p.name != "robust")


def hivemind_as(patched: bool, *names: str):
    """Every process-wide change (or those ``names``) installed if ``patched``, else hivemind as it is."""
    return patches.installed(*names) if patched else patches.plain_hivemind()


def _vector_averagers(nodes: list, vectors: list, prefix: str, **options) -> list:
    """A DecentralizedAverager of each one-tensor state (a copy of each of ``vectors``) on each DHT node, in a
    group of all of them."""
    return [
        DecentralizedAverager(
            [vector.clone()],
            dht=node,
            prefix=prefix,
            target_group_size=len(vectors),
            min_matchmaking_time=MATCHMAKING,
            request_timeout=1.5,
            start=True,
            **options,
        )
        for node, vector in zip(nodes, vectors, strict=True)
    ]


def _state_averagers(nodes: list, nets: list, prefix: str, **options) -> list:
    """The swarm's state averager (SGD, lr 0.1) on each DHT node, over each net's parameters."""

    cls = state_averager.state_averager_class(TrainingStateAverager)
    sgd = partial(torch.optim.SGD, lr=0.1)
    return [
        cls(dht=node, params=net.parameters(), prefix=prefix, optimizer=sgd, start=True, **options)
        for node, net in zip(nodes, nets, strict=True)
    ]


def _state(seed: int) -> tuple[list[torch.Tensor], list[CompressionInfo]]:
    """A state like the state averager's: parameters, then Adam statistics, of mixed sizes and dtypes."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64,), (64, 64), (3,), (10, 64), (1, 65, 64), (7,)]
    params = [torch.randn(*s, generator=gen) for s in shapes]
    stats = [torch.rand(*s, generator=gen) for s in shapes]
    extra = [torch.randn(5, generator=gen).double()]
    infos = [CompressionInfo.from_tensor(t, key=i, role=TensorRole.PARAMETER) for i, t in enumerate(params)]
    infos += [
        CompressionInfo.from_tensor(t, key=(i, "m"), role=TensorRole.OPTIMIZER) for i, t in enumerate(stats)
    ]
    infos += [CompressionInfo.from_tensor(t, key=99, role=TensorRole.UNSPECIFIED) for t in extra]
    return params + stats + extra, infos


def _abandoning_join_request(abandoned: list):
    """Matchmaking._request_join_group of a follower whose process is starved right after it asks a leader to
    take it: the request reaches the leader, but the follower has given up before the answer (request_timeout)
    and looks on. Only the first request of each step is abandoned."""
    from hivemind.averaging.matchmaking import Matchmaking

    from swarm.faults import send_join_request

    original = Matchmaking._request_join_group

    async def request(self, leader):
        if id(self.step_control) in abandoned:
            return await original(self, leader)
        abandoned.append(id(self.step_control))
        abandoned.append(await send_join_request(self, leader))  # kept open: the answer is never read
        return None

    return request


def _gradients(net: torch.nn.Module, scale: float, seed: int) -> list[torch.Tensor]:
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))
    net.zero_grad()
    (net(x).pow(2).sum() * scale).backward()
    return [p.grad.detach().clone() for p in net.parameters()]


@contextmanager
def _screened_gradient_pair(dhts, prefix: str, own_scale=None, request_timeout: float = 1.5):
    """A (the swarm's round averager, its screen wired by ``screen_rounds``) and B, whose averager speaks the
    swarm's packed format (docs/hivemind-patches.md item 3) but has no screen, on two real DHT nodes. Yields
    (nets, averagers, opt, screen, rejected, loaded); ``opt`` carries the two attributes of hivemind.Optimizer
    that screen_rounds wraps, and ``loaded`` counts the calls of hivemind's own loading after the screen."""
    node_a, node_b = dhts(2)
    torch.manual_seed(0)
    net_a = torch.nn.Linear(4, 3)
    net_b = torch.nn.Linear(4, 3)
    net_b.load_state_dict(net_a.state_dict())  # the same gradients at the same seed
    common = dict(
        prefix=prefix, min_matchmaking_time=MATCHMAKING, request_timeout=request_timeout, start=True
    )
    a = grad_averager.keeping_local_gradients(GradientAverager)(
        list(net_a.parameters()), dht=node_a, **common
    )
    b = allreduce.packing(GradientAverager)(list(net_b.parameters()), dht=node_b, **common)
    screen, rejected, loaded = RoundScreen(10.0), [], []
    opt = SimpleNamespace(
        dht=node_a,
        grad_averager=a,
        state_averager=SimpleNamespace(),
        _load_averaged_gradients_into_optimizer_=lambda: loaded.append(True),
    )
    # as hivemind.Optimizer does it (optim/optimizer.py:593-610): wait for the round, then load its result
    opt._average_gradients_and_load_into_optimizer = lambda control: (
        control.result(),
        opt._load_averaged_gradients_into_optimizer_(),
    )
    wiring.screen_rounds(opt, screen, lambda *args: rejected.append(args), own_scale=own_scale)
    try:
        for averager in (a, b):
            matchmaking.set_target_group_size(averager, 2, {})
        yield (net_a, net_b), (a, b), opt, screen, rejected, loaded
    finally:
        for averager in (a, b):
            averager.shutdown()


def _screened_round(pair, a_grads: tuple[float, int], b_grads: tuple[float, int], seed: int, b_seed: int):
    """One real round of the pair: A and B accumulate the gradients of their batches (drawn with ``seed``
    and ``b_seed``) times (scale, batch size) each; then A's screened loading runs. Returns A's own gradient
    and B's."""
    (net_a, net_b), (a, b), opt, *_ = pair
    own = _gradients(net_a, a_grads[0], seed=seed)
    a.accumulate_grads_(batch_size=a_grads[1])
    theirs = _gradients(net_b, b_grads[0], seed=b_seed)
    b.accumulate_grads_(batch_size=b_grads[1])
    controls = [x.step(wait=False, timeout=MATCHMAKING + 10) for x in (a, b)]
    round_results(controls, 2)
    if hasattr(opt, "_average_gradients_and_load_into_optimizer"):
        opt._average_gradients_and_load_into_optimizer(controls[0])
    else:  # hivemind's own loading alone
        opt._load_averaged_gradients_into_optimizer_()
    return own, theirs


def _assert_a_holds(pair, expected: list[torch.Tensor]) -> None:
    (_, (a, b), *_) = pair
    with a.get_tensors() as got:
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    for x in (a, b):
        x.notify_used_averaged_gradients()


@contextmanager
def _two_trackers(dhts, run: str, target: int, patched: bool = True):
    """Progress trackers A and B of run ``run`` on two DHT nodes, each signing with its own key (by default a
    tracker signs with the process-wide key: one record for both), reads at most a minute apart; with
    ``patched``, item 14 installed (as swarm.patches.optimizer.wire installs it)."""
    from hivemind.optim.progress_tracker import ProgressTracker
    from hivemind.utils.crypto import RSAPrivateKey

    trackers = []
    try:
        for node in dhts(2):
            tracker = ProgressTracker(
                node, run, target, max_refresh_period=60.0, private_key=RSAPrivateKey(), start=True
            )
            trackers.append(tracker)
            if patched:
                progress.read_soon_while_speeds_unknown(tracker)
        yield trackers
    finally:
        for tracker in trackers:
            tracker.shutdown()
