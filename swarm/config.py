"""Typed experiment configuration: one frozen dataclass per concern, YAML files, env vars and flags.

Precedence, highest first: command-line flags, ``SWARM_<FIELD>`` environment variables, the YAML file given
with ``--config``, then the defaults below. Field names are unique across sections, so a flag, an env var
and a YAML key all name the same thing: ``--target-batch-size``, ``SWARM_TARGET_BATCH_SIZE`` and
``swarm: {target_batch_size: ...}``. Unknown keys are an error, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
DEVICES = ("auto", "cpu", "cuda")
DATASETS = ("digits", "cifar10")
STRATEGIES = ("ddp", "fsdp", "ddp_spawn", "dp", "single")
AVERAGING = ("gradients", "diloco")
AGGREGATION = ("centered_clip", "mean")  # the rules of swarm/patches/robust.py


class ConfigError(ValueError):
    """A configuration value or file is wrong; the message says which and how to fix it."""


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: expected {allowed}")


@dataclass(frozen=True)
class ModelConfig:
    """Which timm model to build. Every peer of a swarm must use the same values."""

    model_name: str = "vit_base_patch32_224"
    """timm model name; the flagship is vit_base_patch32_224."""
    num_classes: int = 10
    """Number of output classes of the classification head."""
    img_size: int = 224
    """Input resolution; images are resized to this."""
    patch_size: int | None = None
    """Override the model's patch size (small ViTs on 32x32 images use 4)."""
    embed_dim: int | None = None
    """Override the transformer width (None keeps the timm default)."""
    depth: int | None = None
    """Override the number of transformer blocks."""
    num_heads: int | None = None
    """Override the number of attention heads; embed_dim must be divisible by it."""
    init_seed: int = 0
    """Seed of the initial weights. Shared by the swarm, so peers that start together start equal."""
    pretrained: bool = False
    """Start from timm's pretrained weights (through the Hugging Face hub and its cache; the classifier head
    is replaced for num_classes, seeded by init_seed). The flagship configs set it; the demo does not."""
    pretrained_file: str | None = None
    """Load the pretrained weights from this local file instead (safetensors or a torch state dict), for
    machines without internet; implies pretrained."""

    def __post_init__(self) -> None:
        _check(bool(self.model_name), "model_name", self.model_name, "a timm model name")
        _check(self.num_classes >= 2, "num_classes", self.num_classes, "an integer >= 2")
        _check(8 <= self.img_size <= 1024, "img_size", self.img_size, "an integer in [8, 1024]")
        for name in ("patch_size", "embed_dim", "depth", "num_heads"):
            value = getattr(self, name)
            _check(value is None or value >= 1, name, value, "a positive integer or null")
        if self.patch_size is not None:
            _check(
                self.img_size % self.patch_size == 0,
                "patch_size",
                self.patch_size,
                f"a divisor of img_size={self.img_size}",
            )
        if self.embed_dim is not None and self.num_heads is not None:
            _check(
                self.embed_dim % self.num_heads == 0,
                "num_heads",
                self.num_heads,
                f"a divisor of embed_dim={self.embed_dim}",
            )


@dataclass(frozen=True)
class DataConfig:
    """Where the images come from and how each peer batches them."""

    dataset: str = "cifar10"
    """'cifar10' (torchvision) or 'digits' (embedded in scikit-learn, needs no network)."""
    data_dir: str = "data"
    """Folder that holds (or will receive) cifar-10-batches-py."""
    download: bool = True
    """Download CIFAR-10 if it is missing. Set false on machines without internet."""
    batch_size: int = 64
    """Per-step (per-peer, per-device) batch size."""
    num_workers: int = 0
    """DataLoader worker processes; 0 loads in the training process."""
    augment: bool = True
    """Random crops (and flips for CIFAR-10) on the training split."""
    limit_train_samples: int | None = None
    """Use only the first N training images (tests and quick rehearsals)."""
    limit_val_samples: int | None = None
    """Evaluate on at most N validation images."""
    seed: int | None = None
    """This peer's shuffling seed; None draws a fresh one, so every peer sees its own order."""

    def __post_init__(self) -> None:
        _check(self.dataset in DATASETS, "dataset", self.dataset, f"one of {', '.join(DATASETS)}")
        _check(self.batch_size >= 1, "batch_size", self.batch_size, "an integer >= 1")
        _check(self.num_workers >= 0, "num_workers", self.num_workers, "an integer >= 0")
        for name in ("limit_train_samples", "limit_val_samples"):
            value = getattr(self, name)
            _check(value is None or value >= 1, name, value, "a positive integer or null")


@dataclass(frozen=True)
class SwarmConfig:
    """How this peer finds the swarm and averages with it (hivemind settings)."""

    run_id: str = "vit-cifar10"
    """Name of the training run; peers with the same run_id train together."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs of any running peers; empty starts a new swarm."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    """Multiaddrs to listen on; use a fixed port (e.g. /ip4/0.0.0.0/tcp/31337) on a public server."""
    announce_maddrs: tuple[str, ...] = ()
    """Multiaddrs that others should dial, e.g. /ip4/<public ip>/tcp/31337 behind AWS's NAT."""
    identity_path: str | None = None
    """Private key file; makes the peer ID (and thus the join address) stable across restarts."""
    client_mode: bool = False
    """Accept no incoming connections; required behind NAT (Colab, Kaggle, home routers)."""
    auto_client_mode: bool = True
    """After joining, ask up to 3 peers to dial this one back (swarm/net/reach.py); if none can (NAT, a closed
    port or security group), switch to client mode and say why in the log. Off: trust client_mode as given."""
    use_relay: bool = True
    """Let libp2p reach peers through relay circuits (hivemind's use_relay), e.g. a peer behind NAT that holds
    a reservation at a public one."""
    use_auto_relay: bool = True
    """When the dial-back check finds this peer unreachable, also let libp2p look for a public peer to relay
    connections to it (hivemind's use_auto_relay). Averaging does not need it: a client-mode peer sends its
    part to reachable peers and gets the average back."""
    invite: str | None = None
    """Invite file (from `swarm-peer invite`): this peer then takes part only with peers that hold an invite
    of the same owner, and they only with it (swarm/net/fence.py). None: an open swarm that anyone may
    join."""
    target_batch_size: int = 4096
    """Samples the whole swarm accumulates before one optimizer step (one global epoch)."""
    matchmaking_time: float = 5.0
    """Seconds to wait for peers to form an averaging group; must exceed request_timeout."""
    request_timeout: float = 3.0
    """Seconds before a single averaging request counts as lost."""
    averaging_timeout: float = 60.0
    """Cancel an all-reduce after this many seconds. Increase it if you often see
    'Proceeding with local gradients'."""
    next_chunk_timeout: float = 10.0
    """Seconds to wait for a peer's next chunk inside an all-reduce before averaging without it. Too low
    (hivemind's default equals matchmaking_time) gives 'received 66% results' and silently diverging peers."""
    average_state_every: int = 1
    """Average parameters (and Adam's moments) with peers every this many global epochs; realigns a peer
    whose gradient round failed. Each round costs one parameter all-reduce (ViT-B/32: 350 MB per peer)."""
    close_groups: bool = True
    """Start an averaging round as soon as every peer that reports progress has joined the group, instead
    of waiting the whole matchmaking_time (hivemind's default; false restores it, for comparisons)."""
    skip_agreed_state_rounds: bool = True
    """Skip an epoch's state round when the gradient round showed that every peer of the swarm already
    holds the same parameters, optimizer statistics and epoch (docs/hivemind-patches.md item 16); false
    averages the state at every ``average_state_every``-th epoch regardless, for comparisons."""
    report_every: float = 0.25
    """Seconds between two of this peer's progress records in the DHT within a global epoch (a new epoch and
    its first samples go at once); 0 stores one after every step, as hivemind does. 0.25 halves the DHT
    process's CPU on a 2-core machine (27 % of a core against 14 %, README's Performance section)."""
    min_peers: int = 1
    """Before its first training step, a peer waits until this many training peers of the run (itself
    included) have published their settings in the DHT. 1: start at once. Peers that start together then
    average from their first global epoch on, instead of the first one running ahead alone (benchmarks)."""
    reject_factor: float = 10.0
    """Reject an averaged gradient longer than this many times this peer's own (or the median of recent
    rounds), and averaged parameters or optimizer statistics this many times larger than this peer's own:
    the peer steps on its own gradient or keeps its own state instead (swarm/averaging/screen.py). 0 turns the
    size check off; non-finite results are always rejected. A per-peer policy, not part of the swarm's
    config."""
    aggregation: str = "centered_clip"
    """How the peer that reduces a slice of an averaging round combines its groupmates' parts:
    'centered_clip' (a robust mean: no part further than the others' typical distance from their median
    pulls harder than that; an honest round gives the plain mean) or 'mean' (hivemind's weighted mean). See
    swarm/patches/robust.py."""
    check_downloads: bool = True
    """Check every state downloaded from a donor against the states that the other peers published for its
    global epoch, and take it from the next donor when they contradict it (swarm/averaging/donors.py). A
    per-peer policy."""
    judge_steps: bool = False
    """Also judge each gradient round that passed the screen's norm and distance by the loss that the step
    Adam would take on it gives this peer's latest batch and one held out, against the same step on its own
    gradient (swarm/averaging/screen.py ``judge_step``). Off by default: it helps against two colluders of
    five that flip their gradients (final val acc 0.359, 0.727, 0.891 in three runs without it; 0.794, 0.822,
    0.891 with it), yet rejects 1 honest round in 100 to 200 on the demo's settings, and a peer that rejects
    a round holds another state than the others until the next state round it takes. A per-peer policy."""
    compression: str = "none"
    """How tensors travel: 'none', 'fp16', 'int8' or 'powersgd:<rank>' (see swarm/compression.py)."""
    averaging: str = "gradients"
    """'gradients' (average every global step's gradients) or 'diloco' (local steps, then an outer step)."""
    local_steps: int = 50
    """DiLoCo: inner (AdamW) steps a peer takes before it offers its pseudo-gradient to the outer step."""
    round_seconds: float = 0.0
    """DiLoCo: 0 ends each peer's inner phase after ``local_steps``; a number of seconds ends it when the
    swarm has computed what it computes in that time (its target batch follows the summed speed of its
    peers), so that slow and fast peers reach each outer round together, each contributing what it computed,
    however many peers there are."""
    overlap_rounds: bool = False
    """DiLoCo: run each outer round (matchmaking, the all-reduce, the outer step) in the background while
    this peer goes on with inner steps, and apply its result one round late, keeping the steps taken
    meanwhile. A per-peer choice: peers with and without it train together."""
    match_early: bool = False
    """DiLoCo with round_seconds: look for the round's group before the inner phase ends, once the swarm's
    estimated end of the phase is within matchmaking_time (hivemind's pre-scheduling), instead of after."""
    outer_lr: float = 0.7
    """DiLoCo: learning rate of the outer Nesterov SGD (the paper's 0.7)."""
    outer_momentum: float = 0.9
    """DiLoCo: momentum of the outer Nesterov SGD (the paper's 0.9)."""
    load_state_timeout: float = 60.0
    """Seconds to wait for a peer to send the swarm's state to a newcomer."""
    download_donors: int = 1
    """A newcomer (or a peer that fell behind) downloads the swarm's state from up to this many donors at
    once: the parameters from one, the optimizer's statistics in slices from the others at its global epoch
    (a home link downloads several times faster than one donor uploads). With ``check_downloads`` only; the
    state put together is judged as a whole. 1 (the default) takes it from one donor: in the volunteers lab
    under churn, 4 gave no better goodput (docs/benchmarks.md). A per-peer policy."""
    bootstrap_timeout: float = 20.0
    """Seconds to wait for the initial peers to answer before giving up with an error."""
    metrics_expiration: float = 60.0
    """Seconds a published metrics record stays in the DHT; a dead peer drops out after this."""
    linger: float = 0.0
    """Seconds a peer that reached max_epochs or max_time keeps sharing its final state before it leaves,
    so that a monitor can evaluate and save the final model; 0 leaves at once. Signals never wait."""

    def __post_init__(self) -> None:
        _check(
            bool(self.run_id) and self.run_id.replace("-", "").replace("_", "").isalnum(),
            "run_id",
            self.run_id,
            "letters, digits, '-' and '_'",
        )
        _check(self.target_batch_size >= 1, "target_batch_size", self.target_batch_size, "an integer >= 1")
        for name in (
            "request_timeout",
            "averaging_timeout",
            "load_state_timeout",
            "bootstrap_timeout",
            "metrics_expiration",
            "next_chunk_timeout",
        ):
            _check(getattr(self, name) > 0, name, getattr(self, name), "a number of seconds > 0")
        _check(
            self.matchmaking_time > self.request_timeout,
            "matchmaking_time",
            self.matchmaking_time,
            f"more seconds than request_timeout={self.request_timeout} (hivemind may deadlock otherwise)",
        )
        _check(self.linger >= 0, "linger", self.linger, "seconds >= 0")
        _check(self.report_every >= 0, "report_every", self.report_every, "seconds >= 0")
        _check(self.min_peers >= 1, "min_peers", self.min_peers, "an integer >= 1")
        _check(self.download_donors >= 1, "download_donors", self.download_donors, "an integer >= 1")
        _check(
            self.reject_factor == 0 or self.reject_factor > 1,
            "reject_factor",
            self.reject_factor,
            "0 (off) or a number > 1",
        )
        _check(
            self.average_state_every >= 1, "average_state_every", self.average_state_every, "an integer >= 1"
        )
        from swarm.compression import CompressionError, parse_compression

        try:
            parse_compression(self.compression)
        except CompressionError as exc:
            raise ConfigError(str(exc)) from None
        rules = ", ".join(AGGREGATION)
        _check(self.aggregation in AGGREGATION, "aggregation", self.aggregation, f"one of {rules}")
        _check(self.averaging in AVERAGING, "averaging", self.averaging, f"one of {', '.join(AVERAGING)}")
        _check(self.local_steps >= 1, "local_steps", self.local_steps, "an integer >= 1")
        _check(self.round_seconds >= 0, "round_seconds", self.round_seconds, "seconds >= 0 (0: local_steps)")
        _check(
            self.round_seconds == 0 or self.averaging == "diloco",
            "round_seconds",
            self.round_seconds,
            "0 unless averaging is 'diloco' (gradient rounds follow target_batch_size)",
        )
        _check(
            not self.overlap_rounds or self.averaging == "diloco",
            "overlap_rounds",
            self.overlap_rounds,
            "false unless averaging is 'diloco' (gradient rounds are waited for)",
        )
        _check(
            not self.match_early or (self.averaging == "diloco" and self.round_seconds > 0),
            "match_early",
            self.match_early,
            "false unless averaging is 'diloco' with round_seconds > 0 (phases that end together)",
        )
        _check(self.outer_lr > 0, "outer_lr", self.outer_lr, "a number > 0")
        _check(0 <= self.outer_momentum < 1, "outer_momentum", self.outer_momentum, "a number in [0, 1)")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, stopping, devices and reporting of one peer."""

    lr: float = 1e-3
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.05
    """AdamW weight decay."""
    warmup_epochs: int = 5
    """Global epochs (optimizer steps) of linear warm-up."""
    schedule_epochs: int = 1000
    """Global epochs of the cosine decay after warm-up; the LR stays at 5% of peak afterwards."""
    max_epochs: int | None = None
    """Stop once the swarm reaches this global epoch."""
    max_time: float | None = None
    """Stop after this many seconds of training."""
    max_data_epochs: float | None = None
    """Stop after this many passes over the training set: samples that went into the swarm's (or the
    cluster's) optimizer steps, divided by the number of training images."""
    precision: str = "32-true"
    """'32-true', 'bf16-mixed', or '16-mixed' (CUDA only, with a gradient scaler)."""
    device: str = "auto"
    """'auto' (CUDA when present), 'cpu' or 'cuda'."""
    eval_every: int = 5
    """Evaluate on the validation split every this many global epochs."""
    log_every: float = 5.0
    """Seconds between progress lines."""
    log_dir: str = "runs"
    """Root of runs/<run_id>/<role>/... (resolved config, summaries, TensorBoard)."""
    peer_name: str | None = None
    """Name of this peer in logs and file names; default is derived from the host and PID."""
    threads: int | None = None
    """torch intra-op threads; set 1 when several peers share a small machine."""
    inject_fault: str | None = None
    """For fault-tolerance tests only: faults this peer injects into itself, e.g. 'kill:allreduce@5' or
    'nan_grad@3x4' (see swarm/faults.py)."""

    def __post_init__(self) -> None:
        if self.inject_fault:
            from swarm.faults import parse_faults

            try:
                parse_faults(self.inject_fault)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        _check(self.lr > 0, "lr", self.lr, "a number > 0")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        _check(self.warmup_epochs >= 0, "warmup_epochs", self.warmup_epochs, "an integer >= 0")
        _check(self.schedule_epochs >= 1, "schedule_epochs", self.schedule_epochs, "an integer >= 1")
        _check(
            self.max_epochs is None or self.max_epochs >= 1,
            "max_epochs",
            self.max_epochs,
            "an integer >= 1 or null",
        )
        _check(self.max_time is None or self.max_time > 0, "max_time", self.max_time, "seconds > 0 or null")
        _check(
            self.max_data_epochs is None or self.max_data_epochs > 0,
            "max_data_epochs",
            self.max_data_epochs,
            "a number > 0 or null",
        )
        _check(self.precision in PRECISIONS, "precision", self.precision, f"one of {', '.join(PRECISIONS)}")
        _check(self.device in DEVICES, "device", self.device, f"one of {', '.join(DEVICES)}")
        _check(self.eval_every >= 1, "eval_every", self.eval_every, "an integer >= 1")
        _check(self.log_every > 0, "log_every", self.log_every, "seconds > 0")
        _check(self.threads is None or self.threads >= 1, "threads", self.threads, "an integer >= 1 or null")
        if self.precision == "16-mixed":
            _check(self.device != "cpu", "precision", self.precision, "'bf16-mixed' or '32-true' on the CPU")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints are written and read: a local path, file://... or s3://bucket/prefix."""

    checkpoint_uri: str | None = None
    """Folder (URL) for best.ckpt and last.ckpt; default <log_dir>/<run_id>/checkpoints."""
    s3_endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, Ceph, a test server); credentials come from the AWS_* variables."""
    resume_from: str | None = None
    """Checkpoint (path or URL) whose weights and global epoch seed a new swarm (`join --resume-from`)."""

    def __post_init__(self) -> None:
        for name in ("checkpoint_uri", "resume_from"):
            value = getattr(self, name)
            _check(value is None or bool(value.strip()), name, value, "a path or URL, or null")
        url = self.s3_endpoint_url
        _check(
            url is None or url.startswith(("http://", "https://")),
            "s3_endpoint_url",
            url,
            "an http:// or https:// URL, e.g. http://127.0.0.1:9000",
        )


@dataclass(frozen=True)
class MonitorConfig:
    """The monitor peer: how often it reads the DHT and evaluates the swarm's model."""

    evaluate_every: int = 5
    """Download the swarm's parameters and evaluate them every this many global epochs."""
    poll_every: float = 2.0
    """Seconds between reads of the peers' metrics records; keep it well below one global epoch."""
    settle_time: float = 5.0
    """Seconds to wait after the swarm reaches epoch E+1 before writing epoch E (late records still count)."""

    def __post_init__(self) -> None:
        _check(self.evaluate_every >= 1, "evaluate_every", self.evaluate_every, "an integer >= 1")
        _check(self.poll_every > 0, "poll_every", self.poll_every, "seconds > 0")
        _check(self.settle_time >= 0, "settle_time", self.settle_time, "seconds >= 0")


@dataclass(frozen=True)
class ClusterConfig:
    """`swarm-peer local`: standard distributed training of the same model and data through Lightning."""

    strategy: str = "ddp"
    """'ddp' (one process per device), 'fsdp' (parameters, gradients and optimizer state sharded; the ViT
    block is the wrap unit), 'ddp_spawn', 'dp' (one process splits each batch over its GPUs) or 'single'."""
    devices: int | None = None
    """Devices (processes) per node; None uses torchrun's --nproc_per_node, else every GPU, else 1 CPU."""
    num_nodes: int = 1
    """Machines in the run; under torchrun it must match --nnodes."""
    auto_batch_size: bool = False
    """Find the largest per-device batch that fits (a binary search of real training steps) and use it
    (``--batch-size auto``; for ``join`` too, on a GPU: a swarm peer on the CPU keeps its batch)."""
    max_batch_size: int = 4096
    """Upper end of the batch-size search; on the CPU, where memory is no hard limit, it stops here."""
    snapshot_every: int = 0
    """Global epochs between snapshots of the whole training state (model, optimizer with FSDP's shards,
    scheduler, Lightning's loops, RNG) in <run>/snapshots/; a run that torchrun restarts resumes from the
    newest. 0: no snapshots."""
    resume_snapshot: str | None = None
    """`local --resume-from`: resume from this snapshot file (or a run folder holding snapshots/)."""

    def __post_init__(self) -> None:
        _check(self.snapshot_every >= 0, "snapshot_every", self.snapshot_every, "an integer >= 0")
        _check(self.strategy in STRATEGIES, "strategy", self.strategy, f"one of {', '.join(STRATEGIES)}")
        _check(self.devices is None or self.devices >= 1, "devices", self.devices, "an integer >= 1")
        _check(self.num_nodes >= 1, "num_nodes", self.num_nodes, "an integer >= 1")
        _check(self.max_batch_size >= 1, "max_batch_size", self.max_batch_size, "an integer >= 1")
        if self.strategy in ("single", "dp"):
            _check(self.num_nodes == 1, "num_nodes", self.num_nodes, f"1 with strategy {self.strategy!r}")
        if self.strategy == "single":
            _check(self.devices in (None, 1), "devices", self.devices, "1 with strategy 'single'")


@dataclass(frozen=True)
class ExperimentConfig:
    """The whole experiment: everything a role needs, resolved and validated."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        if self.swarm.target_batch_size < self.data.batch_size:
            raise ConfigError(
                f"target_batch_size={self.swarm.target_batch_size} is smaller than batch_size="
                f"{self.data.batch_size}: the swarm's target must be at least one peer's per-step batch"
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (tuples as lists), ready for YAML or a checkpoint."""
        out: dict[str, dict[str, Any]] = {}
        for section in dataclasses.fields(self):
            values = dataclasses.asdict(getattr(self, section.name))
            out[section.name] = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
        return out

    @property
    def checkpoint_dir(self) -> str:
        """Where best.ckpt and last.ckpt live (a path or URL)."""
        return self.checkpoint.checkpoint_uri or str(
            Path(self.train.log_dir) / self.swarm.run_id / "checkpoints"
        )


_SECTION_TYPES = {
    "model": ModelConfig,
    "data": DataConfig,
    "swarm": SwarmConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "monitor": MonitorConfig,
    "cluster": ClusterConfig,
}
FIELD_SECTION: dict[str, str] = {
    f.name: section for section, cls in _SECTION_TYPES.items() for f in dataclasses.fields(cls)
}
# one name per field across sections: flags, SWARM_* variables and YAML keys are flat
_NAMES = [f.name for cls in _SECTION_TYPES.values() for f in dataclasses.fields(cls)]
assert len(_NAMES) == len(FIELD_SECTION), sorted({n for n in _NAMES if _NAMES.count(n) > 1})


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML or environment value to the field's declared type, or raise ConfigError."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{name} must not be null")
    if type(None) in args:  # Optional[X]
        inner = [a for a in args if a is not type(None)][0]
        if isinstance(value, str) and value.lower() in ("none", "null", ""):
            return None
        return _coerce(name, value, inner)
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name}={value!r} must be a list")
        return tuple(str(v).strip() for v in items if str(v).strip())
    try:
        if annotation is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if annotation is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if annotation is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a valid {annotation.__name__}") from None
    raise ConfigError(f"{name}: unsupported type {annotation}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def resolve_config_path(path_or_name: str) -> Path:
    """Accept a path to a YAML file, or the name of a bundled config such as 'demo' or 'flagship'."""
    candidate = Path(path_or_name).expanduser()
    if candidate.is_file():
        return candidate
    bundled = CONFIG_DIR / f"{path_or_name}.yaml"
    if bundled.is_file():
        return bundled
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(
        f"config file {path_or_name!r} not found; give a YAML path or one of: {', '.join(names)}"
    )


def read_yaml(path: Path) -> dict[str, dict[str, Any]]:
    """Read a nested YAML experiment file, rejecting unknown sections and keys."""
    import yaml

    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections ({', '.join(_SECTION_TYPES)})")
    for section, values in raw.items():
        if section not in _SECTION_TYPES:
            raise ConfigError(
                f"{path}: unknown section {section!r}; expected one of {', '.join(_SECTION_TYPES)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping")
        for key in values:
            if FIELD_SECTION.get(key) != section:
                raise ConfigError(f"{path}: unknown key {section}.{key}")
    return raw


def env_overrides(environ: typing.Mapping[str, str] | None = None) -> dict[str, str]:
    """``SWARM_<FIELD>`` variables as flat overrides; an unknown SWARM_ variable is an error."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for key, value in environ.items():
        if not key.startswith("SWARM_"):
            continue
        name = key[len("SWARM_") :].lower()
        if name not in FIELD_SECTION:
            raise ConfigError(f"environment variable {key} names no config field; unset it or fix the name")
        out[name] = value
    return out


def build_config(
    config: str | None = None,
    overrides: dict[str, Any] | None = None,
    environ: typing.Mapping[str, str] | None = None,
    base: dict[str, dict[str, Any]] | None = None,
) -> ExperimentConfig:
    """Resolve defaults < YAML < environment < flat overrides (flags) into a validated ExperimentConfig.
    ``base`` (a config as ``to_dict`` wrote it, e.g. a checkpoint's) takes the YAML file's place; fields
    this version does not know are left out."""
    layered: dict[str, dict[str, Any]] = {name: {} for name in _SECTION_TYPES}
    for section, values in (base or {}).items():
        if section in layered and isinstance(values, dict):
            layered[section].update({k: v for k, v in values.items() if FIELD_SECTION.get(k) == section})
    if config is not None:
        for section, values in read_yaml(resolve_config_path(config)).items():
            layered[section].update(values)
    flat = {**env_overrides(environ), **{k: v for k, v in (overrides or {}).items() if v is not None}}
    for key, value in flat.items():
        if key not in FIELD_SECTION:
            raise ConfigError(f"unknown config field {key!r}")
        layered[FIELD_SECTION[key]][key] = value
    sections = {}
    for section, cls in _SECTION_TYPES.items():
        hints = _hints(cls)
        values = {k: _coerce(k, v, hints[k]) for k, v in layered[section].items()}
        sections[section] = cls(**values)
    return ExperimentConfig(**sections)


def save_config(cfg: ExperimentConfig, path: Path) -> None:
    """Write the resolved config as YAML beside a run's logs."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def replace(cfg: ExperimentConfig, **flat: Any) -> ExperimentConfig:
    """Return a copy with some flat fields changed (validated again)."""
    sections = {name: getattr(cfg, name) for name in _SECTION_TYPES}
    for key, value in flat.items():
        section = FIELD_SECTION[key]
        sections[section] = dataclasses.replace(sections[section], **{key: value})
    return ExperimentConfig(**sections)
