"""The patch package itself: the version check, and patches that install and uninstall one at a time."""

from __future__ import annotations

import hivemind
import pytest
from hivemind.averaging import matchmaking
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.optim import optimizer, state_averager

from swarm import patches


def test_another_hivemind_version_is_refused_with_the_version_and_the_fix():
    patches.check_version(patches.SUPPORTED)  # the installed one passes
    assert hivemind.__version__ == patches.SUPPORTED
    with pytest.raises(patches.HivemindVersionError) as refused:
        patches.check_version("1.2.0")
    message = str(refused.value)
    assert "\n" not in message
    assert f"supports hivemind {patches.SUPPORTED} only" in message
    assert "hivemind 1.2.0 is installed" in message
    assert f"pip install hivemind=={patches.SUPPORTED}" in message


def _attributes() -> dict:
    """What the process-wide patches replace, as hivemind's classes and modules hold it now."""
    return {
        "communicate": AllReduceRunner.__dict__["_communicate_with_peer"],
        "aggregate": DecentralizedAverager.__dict__["rpc_aggregate_part"],
        "run": DecentralizedAverager.__dict__["run"],
        "stub": DecentralizedAverager.__dict__.get("get_stub"),
        "queue": matchmaking.PotentialLeaders.__dict__["_update_queue_periodically"],
        "target": DecentralizedAverager.__dict__.get("_swarm_set_target_group_size"),
        "state": optimizer.TrainingStateAverager,
    }


def test_patches_install_one_at_a_time_and_uninstall_to_hivemind_own():
    was = [p.name for p in patches.process_wide() if p.installed]
    patches.uninstall()
    try:
        plain = _attributes()
        assert plain["state"] is state_averager.TrainingStateAverager and plain["target"] is None
        with patches.installed("matchmaking"):
            now = _attributes()
            changed = {k for k in plain if now[k] is not plain[k]}
            assert changed == {"queue", "target"}, changed
        assert _attributes() == plain
        with patches.installed():
            installed = {p.name: p.installed for p in patches.process_wide()}
            assert all(installed.values()), installed
            now = _attributes()
            assert {k for k in plain if now[k] is not plain[k]} == set(plain)
            assert now["state"].__name__ == "TrainingStateAverager"  # p2p handler names are built from it
        assert _attributes() == plain  # nothing of ours is left
        with pytest.raises(ValueError, match="no such patch: nonsense"):
            with patches.installed("nonsense"):
                pass
    finally:
        for patch in patches.process_wide():
            if patch.name in was:
                patch.install()
