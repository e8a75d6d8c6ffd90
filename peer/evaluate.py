"""`swarm-peer evaluate CHECKPOINT`: the final metrics of a checkpoint on a data split.

Any checkpoint of this project works: the monitor's best.ckpt (the swarm's model), or a local run's
``checkpoints/best.ckpt``, from a path or an ``s3://`` URL. The model and data set come from the config saved
in the checkpoint (or ``--config``, which must describe the same model). The results are top-1 and top-5
accuracy, the loss, the accuracy of each class and the confusion matrix. They are printed and written to
``<log_dir>/<run>/<split>/``:

* ``evaluation.json``: all the results;
* ``confusion.png``: the confusion matrix;
* TensorBoard scalars ``<split>/acc``, ``<split>/loss``, ``<split>/acc_top5`` and
  ``<split>/class_acc/<class>``, and the confusion matrix as an image, at the checkpoint's global epoch.

``<run>`` is the run that saved the checkpoint (``<run_id>/monitor`` or ``<run_id>/ddp``), so TensorBoard
shows the test figures beside the run's curves and ``swarm-peer report`` adds them to the run's row.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SPLITS = ("test", "train")
CLASS_NAMES = {
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
    "digits": tuple(str(d) for d in range(10)),
}


def checkpoint_config(payload: dict[str, Any], config: str | None, overrides: dict[str, Any], url: str):
    """The config to evaluate with: ``--config`` (checked against the checkpoint's model) or the one saved in
    the checkpoint, with the flags on top."""
    from swarm.config import build_config
    from swarm.training.checkpoint import CheckpointError, check_compatible

    if config is not None:
        cfg = build_config(config, overrides)
    elif payload.get("config"):
        cfg = build_config(None, overrides, base=payload["config"])
    else:
        raise CheckpointError(f"checkpoint {url} holds no config; pass the run's --config")
    check_compatible(payload, cfg.model, url)
    return cfg


@torch.no_grad()
def measure(
    net: torch.nn.Module,
    loader: torch.utils.data.DataLoader,
    num_classes: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Loss, top-1 and top-5 accuracy and the confusion matrix (rows: true class, columns: predicted)."""
    from swarm.training.model import accuracy_counts

    net.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)
    loss, top5, n = 0.0, 0, 0
    for images, target in loader:
        images, target = images.to(device), target.to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = net(images).float()
        loss += float(F.cross_entropy(logits, target, reduction="sum"))
        top5 += accuracy_counts(logits, target)[1]
        pairs = target.cpu() * num_classes + logits.argmax(-1).cpu()
        confusion += torch.bincount(pairs, minlength=num_classes**2).view(num_classes, num_classes)
        n += len(target)
    per_class = confusion.diag().double() / confusion.sum(1).clamp(min=1).double()
    return {
        "samples": n,
        "acc": float(confusion.diag().sum()) / max(n, 1),
        "acc_top5": top5 / max(n, 1),
        "loss": loss / max(n, 1),
        "per_class_acc": per_class.tolist(),
        "confusion": confusion.tolist(),
    }


def plot_confusion(confusion: list[list[int]], classes: list[str], title: str, path: Path) -> Any:
    """Write the confusion matrix as a PNG; returns the matplotlib figure (for TensorBoard)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = torch.tensor(confusion)
    fig, ax = plt.subplots(figsize=(7.5, 6.5))
    image = ax.imshow(counts.numpy(), cmap="Blues")
    fig.colorbar(image, ax=ax)
    ticks = range(len(classes))
    ax.set_xticks(list(ticks), classes, rotation=45, ha="right")
    ax.set_yticks(list(ticks), classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    high = float(counts.max()) / 2 if counts.numel() else 0.0
    for i in ticks:
        for j in ticks:
            value = int(counts[i, j])
            if value:
                color = "white" if value > high else "black"
                ax.text(j, i, str(value), ha="center", va="center", fontsize=7, color=color)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return fig


def default_out(payload: dict[str, Any], cfg: Any, log_dir: str | None, split: str) -> Path:
    """``<log_dir>/<run that saved the checkpoint>/<split>``; ``<run_id>/evaluate`` for a checkpoint that
    does not say which run saved it."""
    run = payload.get("run") or f"{cfg.swarm.run_id}/evaluate"
    return Path(log_dir or cfg.train.log_dir) / run / split


def run_evaluate(
    checkpoint: str,
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    split: str = "test",
    out: str | None = None,
    endpoint_url: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``checkpoint`` on ``split``; returns the results (also written, see the module docstring)."""
    from torch.utils.tensorboard import SummaryWriter

    from swarm.config import replace
    from swarm.training.checkpoint import CheckpointError, load_checkpoint, load_weights
    from swarm.training.data import build_datasets, val_loader
    from swarm.training.model import autocast_dtype, create_model, resolve_device

    overrides = dict(overrides or {})
    log_dir = overrides.pop("log_dir", None)
    payload = load_checkpoint(checkpoint, endpoint_url)
    cfg = checkpoint_config(payload, config, overrides, checkpoint)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = torch.device(resolve_device(cfg.train.device))
    net = create_model(cfg.model, weights=False)  # the checkpoint's weights come next
    load_weights(net, payload, checkpoint)
    net.to(device)
    # every image of the split (a run may have validated on fewer), without augmentation
    whole = replace(cfg, augment=False, limit_val_samples=None, limit_train_samples=None)
    train, test = build_datasets(whole.data, cfg.model.img_size)
    data = test if split == "test" else train
    classes_in_data = int(data.labels.max()) + 1 if len(data) else 0
    if classes_in_data > cfg.model.num_classes:
        raise CheckpointError(
            f"checkpoint {checkpoint} classifies {cfg.model.num_classes} classes, but {cfg.data.dataset} has "
            f"{classes_in_data}; evaluate it on the data set it was trained on (--config of its run)"
        )
    dtype = autocast_dtype(cfg.train.precision) if device.type == "cuda" else None
    started = time.perf_counter()
    result = measure(net, val_loader(data, cfg.data), cfg.model.num_classes, device, dtype)
    seconds = time.perf_counter() - started
    names = CLASS_NAMES.get(cfg.data.dataset, ())
    classes = (
        list(names) if len(names) == cfg.model.num_classes else list(map(str, range(cfg.model.num_classes)))
    )
    result = {
        "checkpoint": checkpoint,
        "run": payload.get("run"),
        "model_name": cfg.model.model_name,
        "global_epoch": int(payload.get("global_epoch", 0)),
        "checkpoint_val_acc": (payload.get("metrics") or {}).get("val/acc"),
        "dataset": cfg.data.dataset,
        "split": split,
        **result,
        "classes": classes,
        "seconds": round(seconds, 3),
        "evaluated_at": time.time(),
    }
    folder = Path(out) if out else default_out(payload, cfg, log_dir, split)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "evaluation.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(folder / "evaluation.json")
    title = f"{cfg.model.model_name}, global epoch {result['global_epoch']}: {split} acc {result['acc']:.4f}"
    figure = plot_confusion(result["confusion"], classes, title, folder / "confusion.png")
    step = result["global_epoch"]
    writer = SummaryWriter(log_dir=str(folder))
    try:
        for key in ("acc", "acc_top5", "loss"):
            writer.add_scalar(f"{split}/{key}", result[key], step)
        for name, value in zip(classes, result["per_class_acc"], strict=True):
            writer.add_scalar(f"{split}/class_acc/{name}", value, step)
        writer.add_figure(f"{split}/confusion", figure, step)
    finally:
        writer.close()
    result["out"] = str(folder)
    return result


def describe(result: dict[str, Any]) -> list[str]:
    """The lines `swarm-peer evaluate` prints."""
    lines = [
        f"{result['split']} split of {result['dataset']} ({result['samples']} images), "
        f"{result['model_name']} at global epoch {result['global_epoch']}: "
        f"acc {result['acc']:.4f}, top-5 {result['acc_top5']:.4f}, loss {result['loss']:.4f}"
    ]
    per_class = ", ".join(
        f"{name} {acc:.3f}" for name, acc in zip(result["classes"], result["per_class_acc"], strict=True)
    )
    lines.append(f"per class: {per_class}")
    lines.append(f"Wrote evaluation.json, confusion.png and TensorBoard scalars to {result['out']}")
    return lines
