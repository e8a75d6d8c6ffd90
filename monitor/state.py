"""The monitor's copy of the swarm's model, and the best/last checkpoints it keeps.

The monitor downloads the swarm's current parameters the way a newcomer does (hivemind's state
download from the peer with the newest state), evaluates them on the full validation split, and keeps
``last.ckpt`` and ``best.ckpt``. It never trains, never takes part in an averaging round and never
serves state to others, so a buggy or stale monitor cannot change the swarm.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from swarm.averaging.diloco import shared_state, state_averager_prefix
from swarm.config import ExperimentConfig
from swarm.training.checkpoint import (
    CheckpointError,
    check_location,
    checkpoint_exists,
    join_url,
    load_checkpoint,
    make_checkpoint,
    save_checkpoint,
)
from swarm.training.model import SwarmClassifier

if TYPE_CHECKING:
    import hivemind

log = logging.getLogger(__name__)
BEST, LAST = "best.ckpt", "last.ckpt"


class SwarmModel:
    """A model of the swarm's architecture whose weights (and AdamW state) are refreshed from the peers."""

    def __init__(self, cfg: ExperimentConfig, dht: hivemind.DHT, device: str) -> None:
        from hivemind.optim.state_averager import TrainingStateAverager

        self.cfg = cfg
        self.module = SwarmClassifier(cfg.model, cfg.train, weights=False).to(device)  # the swarm's come next
        self.optimizer = self.module.configure_optimizers()["optimizer"]
        self.adamw = self.optimizer  # what a checkpoint holds (DiLoCo: the inner optimizer)
        swarm = cfg.swarm
        # DiLoCo: the swarm shares its anchors (downloaded into this model), outer momentum and inner state
        self.optimizer, extra_tensors = shared_state(
            self.adamw, list(self.module.parameters()), swarm.averaging, swarm.outer_lr, swarm.outer_momentum
        )
        self.averager = TrainingStateAverager(
            dht=dht,
            optimizer=self.optimizer,
            extra_tensors=extra_tensors,
            prefix=state_averager_prefix(swarm.run_id),
            min_matchmaking_time=swarm.matchmaking_time,
            request_timeout=swarm.request_timeout,
            allreduce_timeout=swarm.averaging_timeout,
            next_chunk_timeout=swarm.next_chunk_timeout,
            client_mode=True,  # download only: never serve state or join a round
            start=True,
        )

    def refresh(self) -> int | None:
        """Download the newest state from the peers; its global epoch, or None if no peer answered."""
        self.averager.local_epoch = -1  # hivemind refuses states older than its own epoch: accept any
        try:
            self.averager.load_state_from_peers(timeout=self.cfg.swarm.load_state_timeout)
        except Exception as exc:  # a peer that leaves mid-download is normal in a swarm
            log.warning(
                "Could not download the swarm's state: %s", str(exc).splitlines()[0] if str(exc) else exc
            )
            return None
        epoch = self.averager.local_epoch
        return epoch if epoch >= 0 else None

    def shutdown(self) -> None:
        if self.averager.is_alive():
            self.averager.shutdown()


class CheckpointKeeper:
    """Writes ``last.ckpt`` after every evaluation and ``best.ckpt`` when the accuracy beats every earlier
    one, also across monitor restarts (the best accuracy so far is read back from ``best.ckpt``)."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.base = cfg.checkpoint_dir
        self.endpoint = cfg.checkpoint.s3_endpoint_url
        self.best_acc: float | None = None
        self.best_epoch: int | None = None
        check_location(self.base, self.endpoint)  # a missing bucket fails now, not at the first save
        best = self.url(BEST)
        if checkpoint_exists(best, self.endpoint):
            try:
                payload = load_checkpoint(best, self.endpoint)
                self.best_acc = float(payload["metrics"]["val/acc"])
                self.best_epoch = int(payload["global_epoch"])
                log.info("Existing %s: val acc %.4f at global epoch %d", best, self.best_acc, self.best_epoch)
            except (CheckpointError, KeyError, TypeError, ValueError) as exc:
                log.warning("Ignoring the existing %s (%s); the next evaluation replaces it", best, exc)

    def url(self, name: str) -> str:
        return join_url(self.base, name)

    def save(
        self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int, result: dict[str, Any]
    ) -> bool:
        """Save last.ckpt, and best.ckpt if ``result`` is the best so far; True if best.ckpt was replaced."""
        metrics = {
            f"val/{k}": float(v) for k, v in result.items() if k in ("acc", "acc_top5", "loss", "samples")
        }
        run = f"{self.cfg.swarm.run_id}/monitor"  # the monitor's TensorBoard run
        payload = make_checkpoint(net, self.cfg, epoch, metrics, optimizer, run=run)
        started = time.perf_counter()
        save_checkpoint(self.url(LAST), payload, self.endpoint)
        improved = self.best_acc is None or result["acc"] > self.best_acc
        if improved:
            save_checkpoint(self.url(BEST), payload, self.endpoint)
            self.best_acc, self.best_epoch = float(result["acc"]), epoch
        log.info(
            "Saved %s%s in %.1f s",
            self.url(LAST),
            f" and {self.url(BEST)}" if improved else "",
            time.perf_counter() - started,
        )
        return improved
