"""TensorBoard runs, read and written the same way by every role: ``runs/<run_id>/<role or strategy>/``.

Reading goes through TensorBoard's own ``EventAccumulator``, so what we read is what a person sees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swarm.config import ExperimentConfig


def read_scalars(logdir: Path) -> tuple[dict[str, list[tuple[float, int, float]]], bool]:
    """The event files of ``logdir`` as tag -> [(wall_time, step, value)] in file order (nothing
    de-duplicated), and whether hyperparameters were logged. An absent folder reads as empty."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not logdir.is_dir():
        return {}, False
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    scalars = {
        tag: [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
    }
    try:
        has_hparams = bool(acc.PluginTagToContent("hparams"))
    except KeyError:
        has_hparams = False
    return scalars, has_hparams


def read_run(logdir: Path) -> tuple[dict[str, list[tuple[int, float]]], bool]:
    """Like ``read_scalars`` without wall times: tag -> [(step, value)]."""
    scalars, has_hparams = read_scalars(logdir)
    return {tag: [(s, v) for _, s, v in points] for tag, points in scalars.items()}, has_hparams


def flat_hparams(cfg: ExperimentConfig) -> dict[str, Any]:
    """The resolved config as section.field -> int/float/str/bool (what the HPARAMS tab takes)."""
    out: dict[str, Any] = {}
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            out[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


def write_hparams(writer: Any, cfg: ExperimentConfig, metric_tags: list[str]) -> None:
    """Log the run's hyperparameters (HPARAMS tab, linked to ``metric_tags``) and its config as text."""
    import yaml
    from torch.utils.tensorboard.summary import hparams

    for summary in hparams(flat_hparams(cfg), dict.fromkeys(metric_tags, 0.0)):
        writer.file_writer.add_summary(summary)
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)
    writer.flush()
