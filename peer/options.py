"""The command line's option sets, declared once: each is a decorator that adds a group of click options.

``join`` and ``local`` train the same model on the same data, so they share :func:`training_options` (the
model, the data, the schedule, stopping and reporting); where the two read an option differently (a DDP
run's seed is the same on every rank, a peer's is its own) the help text names the role's meaning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from swarm.config import AGGREGATION, AVERAGING, DATASETS, DEVICES, PRECISIONS

Decorator = Callable[[Callable], Callable]


class BatchSize(click.ParamType):
    """An integer >= 1, or 'auto' (find the largest that fits)."""

    name = "INTEGER|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if isinstance(value, int) or str(value).lower() == "auto":
            return value if isinstance(value, int) else "auto"
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a whole number nor 'auto'", param, ctx)
        if number < 1:
            self.fail(f"{number} is below 1; give a batch size >= 1 or 'auto'", param, ctx)
        return number


def auto_batch(params: dict[str, Any]) -> dict[str, Any]:
    """``--batch-size auto`` as the config sees it: ``auto_batch_size`` set and no fixed batch."""
    batch = params.pop("batch_size", None)
    params["auto_batch_size"] = True if batch == "auto" else None
    params["batch_size"] = None if batch == "auto" else batch
    return params


def apply(options: list[Decorator]) -> Decorator:
    """Decorate with several click options, in the order given (the first is listed first in --help)."""

    def decorate(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        return func

    return decorate


def swarm_options(func: Callable) -> Callable:
    """Options that every role uses to find the swarm."""
    return apply(
        [
            click.option(
                "--config",
                "config",
                default=None,
                help="YAML experiment file, or a bundled name: demo, flagship, internet.",
            ),
            click.option(
                "--run-id", default=None, help="Name of the run; peers with the same run id train together."
            ),
            click.option(
                "--initial-peers",
                multiple=True,
                help="Multiaddr of a running peer (repeatable). Omit to start a new swarm.",
            ),
            click.option(
                "--host-maddr",
                "host_maddrs",
                multiple=True,
                help="Listen address, e.g. /ip4/0.0.0.0/tcp/31337 (repeatable).",
            ),
            click.option(
                "--announce-maddr",
                "announce_maddrs",
                multiple=True,
                help="Public address others dial, e.g. /ip4/<public ip>/tcp/31337 (repeatable).",
            ),
            click.option("--identity-path", default=None, help="Private key file; keeps the peer id stable."),
            click.option(
                "--invite",
                default=None,
                help="Invite file from the run's owner (swarm-peer invite); an invite-only swarm needs it.",
            ),
            click.option(
                "--client-mode",
                is_flag=True,
                default=None,
                help="Accept no incoming connections (Colab, Kaggle, home NAT).",
            ),
            click.option(
                "--auto-client-mode/--no-auto-client-mode",
                default=None,
                help="Ask peers to dial this one back and switch to client mode if none can [on].",
            ),
            click.option("--log-dir", default=None, help="Root of runs/<run_id>/... [runs]."),
            click.option("--verbose", is_flag=True, help="Show hivemind's internal events."),
        ]
    )(func)


def data_options(dataset_help: str = "cifar10 or digits (offline).") -> Decorator:
    """Which data set, where it is, and whether to download it."""
    return apply(
        [
            click.option("--dataset", type=click.Choice(DATASETS), default=None, help=dataset_help),
            click.option("--data-dir", default=None, help="Folder holding cifar-10-batches-py."),
            click.option("--download/--no-download", default=None, help="Download CIFAR-10 if missing."),
        ]
    )


def model_options(func: Callable) -> Callable:
    """The timm model and its starting weights."""
    return apply(
        [
            click.option(
                "--model", "model_name", default=None, help="timm model name [vit_base_patch32_224]."
            ),
            click.option(
                "--pretrained/--no-pretrained",
                default=None,
                help="Start from timm's pretrained weights (hub or cache; a new head for the run's classes).",
            ),
            click.option(
                "--pretrained-file",
                default=None,
                metavar="PATH",
                help="Pretrained weights from this file (safetensors or a torch state dict); offline.",
            ),
        ]
    )(func)


MAX_DATA_EPOCHS = click.option(
    "--max-data-epochs",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Stop after this many passes over the training set.",
)

_SEED_HELP = {
    "join": "This peer's shuffling seed [random].",
    "local": "Sampler seed, the same on every rank [0].",
}
_DEVICE_HELP = {"join": "auto, cpu or cuda.", "local": "auto, cpu (gloo) or cuda (NCCL)."}
_THREADS_HELP = {
    "join": "torch threads (1 when peers share a machine).",
    "local": "torch threads per process.",
}


def training_options(role: str) -> Decorator:
    """What ``join`` (role "join") and ``local`` (role "local") share: the model, the data, the optimizer's
    schedule, when to stop, and how often to validate and report."""
    if role not in _SEED_HELP:
        raise ValueError(f"role must be one of {', '.join(_SEED_HELP)}, got {role!r}")
    return apply(
        [
            data_options(),
            model_options,
            click.option(
                "--target-batch-size",
                type=int,
                default=None,
                help="Samples per optimizer step (global epoch), summed over the swarm's peers or the ranks.",
            ),
            click.option(
                "--precision", type=click.Choice(PRECISIONS), default=None, help="Numeric precision."
            ),
            click.option("--device", type=click.Choice(DEVICES), default=None, help=_DEVICE_HELP[role]),
            click.option("--max-epochs", type=int, default=None, help="Stop at this global epoch."),
            click.option("--max-time", type=float, default=None, help="Stop after this many seconds."),
            MAX_DATA_EPOCHS,
            click.option("--lr", type=float, default=None, help="Peak learning rate."),
            click.option("--seed", type=int, default=None, help=_SEED_HELP[role]),
            click.option("--threads", type=int, default=None, help=_THREADS_HELP[role]),
            click.option("--eval-every", type=int, default=None, help="Validate every N global epochs."),
            click.option("--log-every", type=float, default=None, help="Seconds between progress lines."),
            click.option(
                "--limit-train-samples", type=int, default=None, help="Train on the first N images only."
            ),
            click.option(
                "--inject-fault", default=None, hidden=True, help="Tests only; see swarm/faults.py."
            ),
        ]
    )


def averaging_options(func: Callable) -> Callable:
    """How a peer averages with the swarm (only ``join`` has them: the cluster's ranks average every step)."""
    return apply(
        [
            click.option(
                "--batch-size",
                type=BatchSize(),
                default=None,
                help="Per-step batch size of this peer, or 'auto' for the largest that fits its GPU.",
            ),
            click.option(
                "--max-batch-size", type=click.IntRange(1), default=None, help="Upper end of the auto search."
            ),
            click.option("--peer-name", default=None, help="Name in logs and file names [host-pid]."),
            click.option(
                "--matchmaking-time", type=float, default=None, help="Seconds to form an averaging group."
            ),
            click.option(
                "--averaging-timeout",
                type=float,
                default=None,
                help="Seconds before an all-reduce is cancelled.",
            ),
            click.option(
                "--average-state-every",
                type=click.IntRange(1),
                default=None,
                help="Average parameters (in DiLoCo also the optimizers' state) every N global epochs [1].",
            ),
            click.option(
                "--min-peers",
                type=click.IntRange(1),
                default=None,
                help="Before the first step, wait until this many training peers (this one included) are in "
                "the swarm [1].",
            ),
            click.option(
                "--reject-factor",
                type=float,
                default=None,
                help="Reject an averaged gradient or state this many times larger than this peer's own; "
                "0: only non-finite ones [10].",
            ),
            click.option(
                "--aggregation",
                type=click.Choice(AGGREGATION),
                default=None,
                help="How a peer combines its groupmates' parts of a round: a robust mean (an honest round "
                "gives the plain mean) or hivemind's weighted mean [centered_clip].",
            ),
            click.option(
                "--check-downloads/--no-check-downloads",
                default=None,
                help="Check a state downloaded from a donor against the states the other peers published, "
                "and ask the next donor if they contradict it [on].",
            ),
            click.option(
                "--download-donors",
                type=click.IntRange(1),
                default=None,
                help="Download the swarm's state in slices from up to this many donors at once, checked "
                "as a whole [1].",
            ),
            click.option(
                "--judge-steps/--no-judge-steps",
                default=None,
                help="Also reject a gradient round when the step Adam would take on it raises the loss of "
                "this peer's latest and held-out batches far more than a step on its own gradient [off].",
            ),
            click.option(
                "--compression",
                default=None,
                metavar="none|fp16|int8|powersgd:<rank>",
                help="How gradients and parameters travel between peers [none].",
            ),
            click.option(
                "--averaging",
                type=click.Choice(AVERAGING),
                default=None,
                help="gradients: average every step's gradients; diloco: local steps, then an outer step.",
            ),
            click.option(
                "--local-steps", type=int, default=None, help="DiLoCo: inner steps per outer step [50]."
            ),
            click.option(
                "--round-seconds",
                type=float,
                default=None,
                help="DiLoCo: an outer round every this many seconds of the swarm's compute, whatever each "
                "peer's speed and however many peers (instead of --local-steps) [0: off].",
            ),
            click.option(
                "--overlap-rounds/--no-overlap-rounds",
                default=None,
                help="DiLoCo: keep taking inner steps while the outer round runs in the background, and "
                "apply its result one round late [off].",
            ),
            click.option(
                "--match-early/--no-match-early",
                default=None,
                help="DiLoCo with --round-seconds: look for the round's group before the inner phase ends, "
                "so that it is there when the phase ends [off].",
            ),
            click.option("--outer-lr", type=float, default=None, help="DiLoCo: outer Nesterov SGD lr [0.7]."),
            click.option("--outer-momentum", type=float, default=None, help="DiLoCo: outer momentum [0.9]."),
        ]
    )(func)


def checkpoint_options_for(default: str) -> Decorator:
    """Where checkpoints are read and written; ``default`` is the folder shown in --help."""
    return apply(
        [
            click.option(
                "--checkpoint-uri",
                default=None,
                help=f"Folder for best.ckpt/last.ckpt: a path, file://... or s3://bucket/prefix [{default}].",
            ),
            click.option(
                "--s3-endpoint-url",
                default=None,
                help="S3-compatible endpoint, e.g. http://127.0.0.1:9000 (MinIO).",
            ),
        ]
    )
