"""The monitor's TensorBoard run, ``runs/<run_id>/monitor``: one point per global epoch and tag.

A restarted monitor reads the event files already there (with TensorBoard's own reader) and appends only
steps after the last one written, so no global epoch is written twice. Hyperparameters are logged once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from monitor.aggregate import EpochPoint
from swarm.config import ExperimentConfig
from swarm.metrics import SWARM_EPOCH, SWARM_PEERS, SWARM_SPS, TRAIN_LOSS, VAL_ACC, VAL_ACC_TOP5, VAL_LOSS

log = logging.getLogger(__name__)
EVAL_PREFIX = "monitor/"
EVAL_ACC, EVAL_ACC_TOP5, EVAL_LOSS = (EVAL_PREFIX + t for t in (VAL_ACC, VAL_ACC_TOP5, VAL_LOSS))


def read_run(logdir: Path) -> tuple[dict[str, list[tuple[int, float]]], bool]:
    """The event files of ``logdir``, read once by TensorBoard itself: every scalar as tag -> [(step, value)]
    in file order (nothing de-duplicated), and whether hyperparameters were logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not logdir.is_dir():
        return {}, False
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    try:
        has_hparams = bool(acc.PluginTagToContent("hparams"))
    except KeyError:
        has_hparams = False
    return scalars, has_hparams


def flat_hparams(cfg: ExperimentConfig) -> dict[str, Any]:
    """The resolved config as section.field -> int/float/str/bool (what the HPARAMS tab takes)."""
    out: dict[str, Any] = {}
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            out[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


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
        import yaml
        from torch.utils.tensorboard.summary import hparams

        metrics = {EVAL_ACC: 0.0, VAL_ACC: 0.0, TRAIN_LOSS: 0.0}
        for summary in hparams(flat_hparams(cfg), metrics):
            self.writer.file_writer.add_summary(summary)
        text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)
        self.writer.flush()
        self.hparams_written = True

    def write_point(self, point: EpochPoint) -> bool:
        """One point per tag at step = global epoch; False (nothing written) if that step exists already."""
        if point.epoch <= self.last_step:
            return False
        step, add = point.epoch, self.writer.add_scalar
        add(SWARM_PEERS, point.peers, step)
        add(SWARM_SPS, point.samples_per_second, step)
        add(SWARM_EPOCH, point.epoch, step)
        if point.loss is not None:
            add(TRAIN_LOSS, point.loss, step)
        if point.val_acc is not None:
            add(VAL_ACC, point.val_acc, step)
        if point.val_loss is not None:
            add(VAL_LOSS, point.val_loss, step)
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
