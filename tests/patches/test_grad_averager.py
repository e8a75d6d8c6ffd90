"""What swarm/patches/grad_averager.py changes: a failed round steps on the peer's own gradient (item 2)."""

from __future__ import annotations

import torch

from tests.patches.common import _optimizer_beside_a_progress_only_peer


def test_failed_round_steps_on_own_gradient_not_zeros(dhts):
    """Peer A's swarm has a second peer B that reports progress but never averages: A's gradient round fails,
    and hivemind.Optimizer proceeds with local gradients. The SGD step (lr 1, no momentum) must move A's
    parameters by A's own mean gradient; hivemind's own averager moved them by zero."""
    (node_a,) = dhts(1)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in net.parameters()]
    with _optimizer_beside_a_progress_only_peer(node_a, net) as opt_a:
        grads = []
        for step in range(4):  # the round ends once A and B have 8 samples (or hivemind's ETA says so)
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(step))
            net.zero_grad()
            net(x).pow(2).sum().backward()
            grads.append([p.grad.detach().clone() for p in net.parameters()])
            opt_a.step()
            if opt_a.local_epoch == 1:
                break
        assert opt_a.local_epoch == 1
        assert opt_a.grad_averager.local_fallbacks == 1
        own = [sum(g) / len(grads) for g in zip(*grads, strict=True)]
        for p, b, g in zip(net.parameters(), before, own, strict=True):
            torch.testing.assert_close(p.detach(), b - g, rtol=1e-5, atol=1e-6)
