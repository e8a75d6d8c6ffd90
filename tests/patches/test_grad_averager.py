"""What swarm/patches/grad_averager.py changes: a failed round steps on the peer's own gradient (item 2)."""

from __future__ import annotations

from functools import partial

import hivemind
import torch
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils.crypto import RSAPrivateKey

from swarm.patches import grad_averager
from swarm.waiting import wait_until
from tests.patches.common import PLAIN_OR_PATCHED, hivemind_as

FAST_READS = dict(min_refresh_period=0.1, max_refresh_period=0.5, default_refresh_period=0.2)
# B's own key, the same in both variants: a DHT node signs with the first key a tracker gave it
KEY_B = RSAPrivateKey()


@PLAIN_OR_PATCHED
def test_a_failed_round_steps_on_the_peers_own_gradient_not_on_zeros(patched, nodes):
    """Item 2. Peer A (a hivemind.Optimizer, SGD lr 1, no momentum) counts a second peer B, which reports
    progress but never averages (a peer that is busy or stuck): A's gradient round fails ("could not find a
    group"), and hivemind.Optimizer proceeds with local gradients. hivemind's GradientAverager.step zeroed the
    accumulators before that round (optim/grad_averager.py:197-198, ``reset_accumulated_grads_``), and
    ``_load_local_gradients_into_optimizer`` (optim/optimizer.py:632-639) loads those zeros: with plain
    hivemind the parameters do not move at all. The swarm's round averager loads A's own mean gradient of the
    round instead: SGD moves the parameters by exactly that gradient."""
    node_a, node_b = nodes(2)
    run = f"pytest-rounds-fail-{patched}"  # the nodes keep the other variant's records
    factory = partial(GradientAverager, request_timeout=0.5)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in net.parameters()]
    # B signs its records with a key of its own (by default every tracker of a process signs with one key)
    tracker_b = ProgressTracker(node_b, run, 8, private_key=KEY_B, start=True)
    try:
        with hivemind_as(patched):
            opt = _hivemind_optimizer(
                node_a, run, net, grad_averager.round_averager(factory) if patched else factory
            )
    except BaseException:
        tracker_b.shutdown()
        raise
    fallbacks = []
    load_local = opt._load_local_gradients_into_optimizer
    opt._load_local_gradients_into_optimizer = lambda: fallbacks.append(True) or load_local()
    try:
        tracker_b.report_local_progress(0, 1)

        def both_seen() -> bool:
            opt.tracker.report_local_progress(0, 1)  # a tracker reports once it has samples
            return opt.tracker.global_progress.num_peers == 2

        assert wait_until(both_seen, timeout=30), opt.tracker.global_progress
        grads = []
        for step in range(4):  # the epoch ends once A and B have 8 samples (or hivemind's ETA says so)
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
            net.zero_grad()
            net(x).pow(2).sum().backward()
            grads.append([p.grad.detach().clone() for p in net.parameters()])
            opt.step()
            if opt.local_epoch == 1:
                break
        assert opt.local_epoch == 1
        assert fallbacks == [True]  # the round failed, and hivemind proceeded with local gradients once
        if not patched:
            for p, b in zip(net.parameters(), before, strict=True):
                assert torch.equal(p.detach(), b)  # stepped on zeros
            return
        assert opt.grad_averager.local_fallbacks == 1
        own = [sum(g) / len(grads) for g in zip(*grads, strict=True)]
        for p, b, g in zip(net.parameters(), before, own, strict=True):
            torch.testing.assert_close(p.detach(), b - g, rtol=1e-5, atol=1e-6)
    finally:
        opt.shutdown()
        tracker_b.shutdown()


def _hivemind_optimizer(node, run: str, net: torch.nn.Module, factory) -> hivemind.Optimizer:
    """A hivemind.Optimizer (SGD, lr 1) whose rounds fail within 1.5 s when nobody joins, reading the swarm's
    progress every few tenths of a second; no state rounds (only gradients matter here)."""
    return hivemind.Optimizer(
        dht=node,
        run_id=run,
        params=net.parameters(),
        optimizer=partial(torch.optim.SGD, lr=1.0),
        target_batch_size=8,
        batch_size_per_step=4,
        matchmaking_time=1.0,
        averaging_timeout=1.5,
        average_state_every=1000,
        averager_opts={"request_timeout": 0.5},
        tracker_opts=FAST_READS,
        grad_averager_factory=factory,
    )
