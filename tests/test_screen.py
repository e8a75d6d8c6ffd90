"""The round screen (swarm/averaging/screen.py) on its own: what it accepts and rejects, by the figures."""

from __future__ import annotations

import torch

from swarm.averaging.screen import RoundScreen, total_norm

ROLES = ["parameters", "extra tensors"]


def _state(params: float, moments: float) -> list[torch.Tensor]:
    """Parameters and moments of these norms, 100 numbers each."""
    return [torch.full((100,), params / 10), torch.full((100,), moments / 10)]


def test_moments_get_the_squared_limit_and_young_ones_are_judged_against_the_recent_accepted_states():
    screen = RoundScreen(10.0)
    # honest DiLoCo peers' inner moments differed by more than 10x: 11x passes for moments...
    assert screen.judge_state(_state(50, 0.98), _state(50, 10.8), ROLES) is None
    # ... but not for parameters
    reason = screen.judge_state(_state(50, 0.98), _state(550, 0.98), ROLES)
    assert reason == (
        "the averaged parameters have norm 550, 11x this peer's reference 50 (its own 50; the limit is 10x)"
    ), reason
    # a peer whose moments start over (a newcomer's first inner steps) is judged against the median of the
    # states it accepted, not its own alone: 183x its own, 0.85x that median
    for _ in range(2):
        assert screen.judge_state(_state(50, 9.0), _state(50, 10.8), ROLES) is None
    assert total_norm(_state(50, 9.14)[1:]) / total_norm(_state(50, 0.05)[1:]) > 100
    assert screen.judge_state(_state(50, 0.05), _state(50, 9.14), ROLES) is None
    # an attacker's moments (exp_avg_sq after 10,000x gradients) are rejected all the same, with the figures
    reason = screen.judge_state(_state(50, 0.05), _state(50, 9.5e8), ROLES, kind="download")
    assert reason is not None and "the downloaded extra tensors have norm 9.5e+08" in reason, reason
    assert "reference 10.8 (its own 0.05; the limit is 100x)" in reason, reason
    assert (screen.rejected_state_rounds, screen.rejected_downloads) == (1, 1)


def test_an_all_zero_part_is_judged_by_finiteness_alone_and_a_rejected_state_teaches_nothing():
    screen = RoundScreen(10.0)
    # a newcomer's optimizer statistics are all zeros: any finite size passes, a non-finite one does not
    assert screen.judge_state(_state(50, 0.0), _state(50, 9.14), ROLES, kind="download") is None
    bad = _state(50, 9.14)
    bad[1][0] = float("nan")
    assert screen.judge_state(_state(50, 0.0), bad, ROLES, kind="download") == (
        "the downloaded extra tensors are non-finite"
    )
    assert screen.in_row["download"] == 1
    # the accepted state is remembered, the rejected one not
    assert list(screen.part_norms["extra tensors"]) == [total_norm(_state(50, 9.14)[1:])]
    # factor 0: only non-finite numbers are rejected
    assert RoundScreen(0.0).judge_state(_state(50, 1.0), _state(5e9, 1e9), ROLES) is None
