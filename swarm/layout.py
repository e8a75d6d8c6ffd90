"""Where a run's files live, and the join line every peer prints: one definition for the peers, the demo,
the bench and the tests.

``<log_dir>/<run_id>/volunteer/<peer>/`` holds a peer's ``config.yaml`` and ``summary.json``;
``<log_dir>/<run_id>/monitor/`` the monitor's TensorBoard run; ``<log_dir>/<run_id>/<strategy>[-N]/`` a
local cluster run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

JOIN_PREFIX = "swarm-peer join --initial-peers "
JOIN_RE = re.compile(re.escape(JOIN_PREFIX) + r"(\S+)")
# what a peer started with --min-peers logs once they are all there and it takes its first step
STARTING = "training peers of the run are ready; starting"


def join_line(address: str) -> str:
    """The start of the line a new peer pastes (``swarm.net.node.SwarmNode.join_command`` adds --config and
    --run-id)."""
    return JOIN_PREFIX + address


# the `join` flags of the settings all peers must share (swarm/net/fingerprint.py); the others have none
JOIN_FLAGS = {
    "model_name": "--model",
    "dataset": "--dataset",
    "target_batch_size": "--target-batch-size",
    "averaging": "--averaging",
    "compression": "--compression",
    "outer_lr": "--outer-lr",
    "outer_momentum": "--outer-momentum",
    "round_seconds": "--round-seconds",
    "lr": "--lr",
}


def join_words(overrides: dict[str, str]) -> tuple[list[str], list[str]]:
    """(flags, ``SWARM_<FIELD>=value`` words) that repeat ``overrides`` (field -> value) in a join line."""
    flags, environment = [], []
    for field, value in sorted(overrides.items()):
        if field in JOIN_FLAGS:
            flags += [JOIN_FLAGS[field], value]
        else:
            environment.append(f"SWARM_{field.upper()}={value}")
    return flags, environment


def join_address(text: str) -> str | None:
    """The address of the first join line in ``text`` (a log, or one line of one), or None."""
    found = JOIN_RE.search(text)
    return found.group(1) if found else None


def volunteer_dir(log_dir: str | Path, run_id: str, peer_name: str) -> Path:
    return Path(log_dir) / run_id / "volunteer" / peer_name


def summary_path(log_dir: str | Path, run_id: str, peer_name: str) -> Path:
    return volunteer_dir(log_dir, run_id, peer_name) / "summary.json"


def read_summary(log_dir: str | Path, run_id: str, peer_name: str) -> dict[str, Any]:
    return json.loads(summary_path(log_dir, run_id, peer_name).read_text())
