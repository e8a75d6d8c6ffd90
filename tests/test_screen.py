"""The round screen (swarm/averaging/screen.py) on its own: what it accepts and rejects, by the figures."""

from __future__ import annotations

import torch

from swarm.averaging.screen import RoundScreen, total_norm

ROLES = ["parameters", "extra tensors"]


def _state(params: float, moments: float) -> list[torch.Tensor]:
    return [torch.full((100,), params / 10), torch.full((100,), moments / 10)]


def test_young_moments_are_judged_against_the_recent_accepted_states_and_outsized_ones_still_rejected():
    screen = RoundScreen(10.0)
    # a peer whose moments grew with the swarm's: rounds of the same size pass and are remembered
    for _ in range(3):
        assert screen.judge_state(_state(50, 9.0), _state(50, 9.5), ROLES) is None
    # its moments then start over (a DiLoCo peer after its first inner steps in the swarm): the pair's honest
    # average of 9.14 is 11x its own 0.805, and within 10x of the median of the states it accepted
    young, honest = _state(50, 0.805), _state(50, 9.14)
    assert total_norm(honest[1:]) / total_norm(young[1:]) > 10
    assert screen.judge_state(young, honest, ROLES) is None
    # an attacker's moments (exp_avg_sq after 10,000x gradients) are rejected all the same, with the figures
    reason = screen.judge_state(young, _state(50, 9.5e8), ROLES, kind="download")
    assert reason is not None and "the downloaded extra tensors have norm 9.5e+08" in reason, reason
    assert "reference 9.5 (its own 0.805; the limit is 10x)" in reason, reason
    assert screen.rejected_downloads == 1 and screen.rejected_state_rounds == 0


def test_a_peer_without_history_judges_against_its_own_and_an_all_zero_part_by_finiteness_alone():
    screen = RoundScreen(10.0)
    reason = screen.judge_state(_state(50, 0.805), _state(50, 9.14), ROLES)
    assert reason == (
        "the averaged extra tensors have norm 9.14, 11x this peer's reference 0.805 "
        "(its own 0.805; the limit is 10x)"
    ), reason
    assert screen.rejected_state_rounds == 1 and screen.in_row["state"] == 1
    # a newcomer's optimizer statistics are all zeros: any finite size passes, a non-finite one does not
    assert screen.judge_state(_state(50, 0.0), _state(50, 9.14), ROLES, kind="download") is None
    bad = _state(50, 9.14)
    bad[1][0] = float("nan")
    assert screen.judge_state(_state(50, 0.0), bad, ROLES, kind="download") == (
        "the downloaded extra tensors are non-finite"
    )
    # a rejected state teaches the screen nothing; an accepted one does
    assert "extra tensors" in screen.part_norms and list(screen.part_norms["extra tensors"]) == [
        total_norm(_state(50, 9.14)[1:])
    ]
