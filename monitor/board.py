"""The monitor's TensorBoard run, ``runs/<run_id>/monitor``: one point per global epoch and tag.

A restarted monitor reads the event files already there (with TensorBoard's own reader) and appends only
steps after the last one written, so no global epoch is written twice. Hyperparameters are logged once.
"""

from __future__ import annotations

import logging
from pathlib import Path

from monitor.aggregate import EpochPoint
from swarm.config import ExperimentConfig
from swarm.net.metrics import (
    ROUND_CLIPPED,
    ROUND_LOCAL,
    ROUND_REJECTED,
    ROUND_SUSPECTS,
    ROUND_TAGS,
    SWARM_EPOCH,
    SWARM_PEERS,
    SWARM_SPS,
    SYS_GPU_MEM,
    SYS_GPU_UTIL,
    TRAIN_DATA_EPOCH,
    TRAIN_LOSS,
    VAL_ACC,
    VAL_ACC_TOP5,
    VAL_LOSS,
)
from swarm.training.logbook import read_run, write_hparams

log = logging.getLogger(__name__)
EVAL_PREFIX = "monitor/"
EVAL_ACC, EVAL_ACC_TOP5, EVAL_LOSS = (EVAL_PREFIX + t for t in (VAL_ACC, VAL_ACC_TOP5, VAL_LOSS))


class Board:
    """Writes the monitor's scalars; ``last_step``/``last_eval_step`` start from what is already on disk."""

    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = logdir
        existing, self.hparams_written = read_run(logdir)
        steps = [s for tag, points in existing.items() if not tag.startswith(EVAL_PREFIX) for s, _ in points]
        self.last_step = max(steps, default=-1)
        self.last_eval_step = max((s for s, _ in existing.get(EVAL_ACC, [])), default=-1)
        self.best_logged = max((v for _, v in existing.get(EVAL_ACC, [])), default=None)
        if existing:
            log.info(
                "Appending to the TensorBoard run in %s after global epoch %d (evaluation after %d)",
                logdir,
                self.last_step,
                self.last_eval_step,
            )
        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(logdir), flush_secs=5)

    def write_hparams(self, cfg: ExperimentConfig) -> None:
        """Log the run's hyperparameters and its config as text, once per TensorBoard run."""
        if self.hparams_written:
            return
        write_hparams(self.writer, cfg, [EVAL_ACC, VAL_ACC, TRAIN_LOSS])
        self.hparams_written = True

    def write_point(self, point: EpochPoint) -> bool:
        """One point per tag at step = global epoch; False (nothing written) if that step exists already."""
        if point.epoch <= self.last_step:
            return False
        step, add = point.epoch, self.writer.add_scalar
        add(SWARM_PEERS, point.peers, step)
        if point.train_records:
            add(SWARM_SPS, point.samples_per_second, step)
        add(SWARM_EPOCH, point.epoch, step)
        if point.loss is not None:
            add(TRAIN_LOSS, point.loss, step)
        if point.data_epoch is not None:
            add(TRAIN_DATA_EPOCH, point.data_epoch, step)
        for peer, (mem_gb, util) in sorted(point.gpus.items()):  # GPU peers only; nothing from CPU peers
            add(f"{SYS_GPU_MEM}/{peer}", mem_gb, step)
            add(f"{SYS_GPU_UTIL}/{peer}", util, step)
        if point.val_acc is not None:
            add(VAL_ACC, point.val_acc, step)
        if point.val_loss is not None:
            add(VAL_LOSS, point.val_loss, step)
        for part, seconds in point.rounds.items():
            add(ROUND_TAGS[part], seconds, step)
        if point.rounds:
            add(ROUND_LOCAL, point.local_steps, step)
            add(ROUND_REJECTED, point.rejected, step)
            add(ROUND_CLIPPED, point.clipped, step)
            add(ROUND_SUSPECTS, len(point.suspects), step)
        self.writer.flush()
        self.last_step = step
        return True

    def write_eval(self, epoch: int, result: dict[str, float]) -> bool:
        """The monitor's own evaluation at ``epoch``; False if that step was written before."""
        if epoch <= self.last_eval_step:
            return False
        self.writer.add_scalar(EVAL_ACC, result["acc"], epoch)
        self.writer.add_scalar(EVAL_ACC_TOP5, result["acc_top5"], epoch)
        self.writer.add_scalar(EVAL_LOSS, result["loss"], epoch)
        self.writer.flush()
        self.last_eval_step = epoch
        return True

    def close(self) -> None:
        self.writer.close()
