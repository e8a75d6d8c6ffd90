"""`swarm-peer local`: the same LightningModule and data as `join`, trained the standard way by Lightning.

DDP and FSDP use NCCL on GPUs and gloo on the CPU (the CPU case rehearses a cluster run on a laptop).
Under torchrun every process runs this role; without it Lightning starts the other processes itself.
One global epoch is one optimizer step over about ``target_batch_size`` samples (gradients are
accumulated to reach it), exactly as in the swarm, so ``--max-epochs``, the learning-rate schedule and
the TensorBoard x-axis mean the same thing in both ways of training.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

from swarm.config import ConfigError, ExperimentConfig, save_config
from swarm.log import quiet_libraries
from swarm.net.metrics import (
    SYS_GPU_MEM,
    SYS_GPU_UTIL,
    TRAIN_DATA_EPOCH,
    TRAIN_LOSS,
    TRAIN_SPS,
    VAL_ACC,
    VAL_ACC_TOP5,
    VAL_LOSS,
)
from swarm.training.checkpoint import (
    CheckpointError,
    check_location,
    join_url,
    make_checkpoint,
    save_checkpoint,
)
from swarm.training.data import build_datasets, shard_loaders
from swarm.training.logbook import write_hparams
from swarm.training.model import (
    SwarmClassifier,
    autocast_dtype,
    cheap_cuda_checks,
    local_tensor,
    param_checksum,
    resolve_device,
)
from swarm.training.sysmetrics import CpuMeter, GpuSampler
from swarm.training.tuning import largest_batch, step_fits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """The resolved shape of the run: who trains where, and with which batch."""

    strategy: str
    accelerator: str  # 'cuda' or 'cpu'
    devices: int  # devices per node (for 'dp': the GPUs one process splits each batch over)
    num_nodes: int

    @property
    def world_size(self) -> int:
        """Data-parallel processes."""
        return 1 if self.strategy in ("dp", "single") else self.devices * self.num_nodes

    @property
    def per_process_factor(self) -> int:
        """Per-device batches in one process's batch ('dp' splits one batch over its GPUs)."""
        return self.devices if self.strategy == "dp" else 1

    @property
    def devices_total(self) -> int:
        """Devices that each take a per-device batch in one step."""
        return self.devices * self.num_nodes

    def accumulation(self, batch_size: int, target: int) -> int:
        """Micro-batches per optimizer step so that one step covers about ``target`` samples."""
        return max(1, round(target / (batch_size * self.devices_total)))


@dataclass(frozen=True)
class DistEnv:
    """What the launcher (torchrun, or Lightning for the processes it starts) told this process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    torchrun: bool = False


def dist_env(environ: dict[str, str] | None = None) -> DistEnv:
    """The one helper that reads the launcher's variables (RANK, LOCAL_RANK, WORLD_SIZE, ...)."""
    e = os.environ if environ is None else environ
    local_rank = int(e.get("LOCAL_RANK", 0))
    node_rank = int(e.get("GROUP_RANK", e.get("NODE_RANK", 0)))
    local_world = int(e.get("LOCAL_WORLD_SIZE", 1))
    rank = int(e.get("RANK", node_rank * local_world + local_rank))
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=int(e.get("WORLD_SIZE", 1)),
        local_world_size=local_world,
        node_rank=node_rank,
        torchrun="TORCHELASTIC_RUN_ID" in e,
    )


def make_plan(cfg: ExperimentConfig, env: DistEnv) -> Plan:
    """Check the cluster flags against the machine and the launcher; a mismatch is a ConfigError."""
    c, strategy = cfg.cluster, cfg.cluster.strategy
    try:
        accelerator = resolve_device(cfg.train.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.train.max_epochs is None and cfg.train.max_time is None and cfg.train.max_data_epochs is None:
        raise ConfigError(
            "local training needs a stop: pass --max-epochs N (global epochs), --max-data-epochs N (passes "
            "over the training set) or --max-time SECONDS"
        )
    if cfg.train.precision == "16-mixed" and accelerator == "cpu":
        raise ConfigError("precision='16-mixed' needs a CUDA GPU; use 'bf16-mixed' or '32-true' on the CPU")
    if strategy == "fsdp" and cfg.train.precision == "16-mixed":
        raise ConfigError(
            "--strategy fsdp runs in '32-true' or 'bf16-mixed' (FSDP2 has no fp16 gradient scaler here)"
        )
    gpus = torch.cuda.device_count() if accelerator == "cuda" else 0
    nodes = c.num_nodes
    if env.torchrun:
        if strategy in ("ddp_spawn", "dp", "single") and env.world_size > 1:
            raise ConfigError(
                f"--strategy {strategy} starts its own processes (or none); under torchrun use ddp or fsdp"
            )
        if c.devices is not None and c.devices != env.local_world_size:
            raise ConfigError(
                f"torchrun started {env.local_world_size} processes per node (--nproc_per_node), --devices "
                f"says {c.devices}; drop --devices or make them equal"
            )
        torchrun_nodes = max(1, env.world_size // env.local_world_size)
        if nodes not in (1, torchrun_nodes):
            raise ConfigError(
                f"torchrun has {torchrun_nodes} node(s) (--nnodes), --num-nodes says {nodes}; make them equal"
            )
        devices, nodes = env.local_world_size, torchrun_nodes
    elif strategy == "single":
        devices = 1
    else:
        devices = c.devices or (gpus if accelerator == "cuda" else 1)
    if accelerator == "cuda" and devices > gpus:
        raise ConfigError(
            f"--devices {devices} but this machine has {gpus} visible GPU(s); use at most {gpus}"
        )
    if strategy == "dp" and accelerator == "cpu" and devices > 1:
        raise ConfigError(
            "--strategy dp splits each batch over GPUs; on the CPU rehearse with --strategy ddp"
        )
    return Plan(strategy, accelerator, devices, nodes)


def lightning_strategy(plan: Plan) -> Any:
    """Lightning's strategy for the plan: DDP/ddp_spawn (NCCL on GPUs, gloo on the CPU), FSDP2 through
    ModelParallelStrategy (it shards on the CPU too), or one device."""
    if plan.strategy == "fsdp":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(
            data_parallel_size=plan.world_size, tensor_parallel_size=1, save_distributed_checkpoint=False
        )
    if plan.strategy in ("dp", "single"):
        from lightning.pytorch.strategies import SingleDeviceStrategy

        return SingleDeviceStrategy(device=torch.device("cuda", 0) if plan.accelerator == "cuda" else "cpu")
    return plan.strategy


class ShardedData(L.LightningDataModule):
    """Train and validation loaders for this rank: disjoint shards, the same sampler seed on every rank."""

    def __init__(self, train_set: Any, val_set: Any, cfg: ExperimentConfig, plan: Plan, seed: int) -> None:
        super().__init__()
        self.train_set, self.val_set, self.cfg, self.plan, self.seed = train_set, val_set, cfg, plan, seed
        self.batch_size = cfg.data.batch_size  # per device; --batch-size auto changes it before fitting
        self.passes = 1  # passes over the training set per loader epoch (LocalReporter.setup sets it)

    @property
    def per_process(self) -> int:
        """The batch one process loads per step."""
        return self.batch_size * self.plan.per_process_factor

    def _loaders(self) -> tuple[Any, Any]:
        t = self.trainer
        return shard_loaders(
            self.train_set,
            self.val_set,
            self.cfg.data,
            self.per_process,
            t.global_rank,
            t.world_size,
            self.seed,
            self.passes,
        )

    def batches_per_pass(self, world_size: int) -> int:
        """Batches one rank loads per pass over the training set."""
        return len(self.train_set) // world_size // self.per_process

    def train_dataloader(self) -> Any:
        return self._loaders()[0]

    def val_dataloader(self) -> Any:
        return self._loaders()[1]


SNAPSHOT = "snapshot.ckpt"


def find_snapshot(cfg: ExperimentConfig, plan: Plan) -> tuple[Path | None, Path | None]:
    """(snapshot to resume from, folder of the run it belongs to); (None, None) for a fresh run.

    ``--resume-from`` names a snapshot or a run folder. Under torchrun, an attempt after a restart
    (``TORCHELASTIC_RESTART_COUNT`` > 0) goes on in the newest ``<strategy>*`` folder of the run, from its
    snapshot if it has one. Every rank looks for itself: across machines the log directory must be shared."""
    if cfg.cluster.resume_snapshot:
        path = Path(cfg.cluster.resume_snapshot).expanduser()
        if path.is_dir() and (path / "snapshots" / SNAPSHOT).exists():
            path = path / "snapshots" / SNAPSHOT
        if path.name != SNAPSHOT or not path.exists():
            raise ConfigError(
                f"--resume-from {cfg.cluster.resume_snapshot!r} is no snapshot: give "
                f"<run>/snapshots/{SNAPSHOT} or the run folder that holds it (--snapshot-every N writes them)"
            )
        return path, path.parent.parent
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
        return None, None
    root = Path(cfg.train.log_dir) / cfg.swarm.run_id
    runs = sorted(
        (p for p in root.glob(f"{plan.strategy}*") if (p / "config.yaml").is_file()),
        key=lambda p: (p / "config.yaml").stat().st_mtime,
    )
    if not runs:
        return None, None
    snapshot = runs[-1] / "snapshots" / SNAPSHOT
    return (snapshot if snapshot.exists() else None), runs[-1]


def _free_run_dir(root: Path, name: str) -> Path:
    """runs/<run_id>/<strategy>, or <strategy>-2, -3, ... when an earlier run is there."""
    candidate, n = root / name, 1
    while candidate.exists():
        n += 1
        candidate = root / f"{name}-{n}"
    return candidate


class LocalReporter(L.Callback):
    """Per global epoch: loss and samples/s summed over ranks, GPU figures, TensorBoard on rank 0, the stop;
    after each validation: val metrics, last.ckpt and best.ckpt. Writes the run's summary.json at the end."""

    def __init__(
        self, cfg: ExperimentConfig, plan: Plan, data: ShardedData, run_dir: Path | None = None
    ) -> None:
        """``run_dir``: the folder of the run this one resumes (a restart); None makes a new one."""
        self.cfg, self.plan, self.data = cfg, plan, data
        self.writer: Any = None
        self.run_dir: Path | None = run_dir
        self.reused_dir = run_dir is not None
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.batch_found: int | None = None
        self.shards: dict[int, list[int]] = {}
        self.val_seconds, self.samples = 0.0, 0
        self.validated_at: int | None = None
        self.curve: list[tuple[float, int, float]] = []

    # -- set-up: batch size, accumulation, TensorBoard ------------------------------------------------
    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if not logging.getLogger().handlers:  # a process that ddp_spawn started: same logging as rank 0's
            from swarm.log import setup_logging

            setup_logging(quiet=not trainer.is_global_zero)
        if self.cfg.train.threads:
            torch.set_num_threads(self.cfg.train.threads)
        cheap_cuda_checks(trainer.strategy.root_device.type)  # in every rank: each imported lightning itself
        torch.manual_seed(self.data.seed + trainer.global_rank)  # augmentations differ per rank
        self.main = trainer.is_global_zero
        if self.cfg.cluster.auto_batch_size:
            self._search_batch(trainer, module)
        accumulate = self.plan.accumulation(self.data.batch_size, self.cfg.swarm.target_batch_size)
        per_pass = self.data.batches_per_pass(self.plan.world_size)
        if per_pass < 1:
            raise ConfigError(
                f"{len(self.data.train_set)} training images are fewer than one batch of "
                f"{self.data.per_process} per rank on {self.plan.world_size} ranks; lower --batch-size"
            )
        # a global epoch larger than one pass over a small data set (the digits at target 2048): one loader
        # epoch holds as many passes as one target batch needs, as a swarm peer's loader simply goes on
        self.data.passes = -(-accumulate // per_pass)
        batches = per_pass * self.data.passes
        # Lightning steps the optimizer at the end of every data epoch even mid-accumulation; whole windows
        # only keep one global epoch = one target batch and validation on the optimizer step
        trainer.limit_train_batches = batches // accumulate * accumulate
        trainer.accumulate_grad_batches = accumulate
        trainer.val_check_interval = self.cfg.train.eval_every * accumulate
        self.global_batch = self.data.batch_size * self.plan.devices_total * accumulate
        if self.run_dir is None:  # every rank needs it for snapshots; rank 0 picks a free name
            root = Path(self.cfg.train.log_dir) / self.cfg.swarm.run_id
            chosen = str(_free_run_dir(root, self.plan.strategy)) if self.main else None
            self.run_dir = Path(trainer.strategy.broadcast(chosen, src=0))
        self.ckpt_dir = self.cfg.checkpoint.checkpoint_uri or str(self.run_dir / "checkpoints")
        if not self.main:
            return
        save_config(self.cfg, self.run_dir / "config.yaml")
        log.info(
            "%s on %d %s device(s) x %d node(s), world size %d: %d per device x %d devices x %d accumulated "
            "= global batch %d (target %d); TensorBoard in %s",
            self.plan.strategy,
            self.plan.devices,
            self.plan.accelerator,
            self.plan.num_nodes,
            self.plan.world_size,
            self.data.batch_size,
            self.plan.devices_total,
            accumulate,
            self.global_batch,
            self.cfg.swarm.target_batch_size,
            self.run_dir,
        )

    def _search_batch(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        m = self.cfg.model
        fits = step_fits(
            module.net, m.num_classes, m.img_size, device, autocast_dtype(self.cfg.train.precision)
        )
        # never past one target batch per step: a bigger global batch would change the run being compared
        limit = min(
            self.cfg.cluster.max_batch_size,
            max(1, self.cfg.swarm.target_batch_size // self.plan.devices_total),
        )
        if device.type == "cpu":
            limit = min(limit, max(1, len(self.data.train_set) // self.plan.world_size))
        found, _ = largest_batch(fits, self.cfg.data.batch_size, limit)
        # the smallest over the ranks fits on every rank
        found = int(trainer.strategy.all_gather(torch.tensor(found, device=device)).min())
        if found < 1:
            raise ConfigError(
                f"not even a batch of 1 fits on {device}; use a smaller model or --strategy fsdp"
            )
        self.batch_found = self.data.batch_size = found
        note = ""
        if device.type == "cpu":
            note += " (memory is no hard limit on the CPU: capped by --max-batch-size and the shard)"
        if self.plan.strategy == "fsdp":
            note += " (measured on the unsharded model; FSDP may fit more)"
        if trainer.is_global_zero:
            log.info("Largest batch per device: %d%s", found, note)

    # -- training -------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.gpu = GpuSampler(trainer.strategy.root_device).start()
        self.cpu = CpuMeter().start()
        self.started = self.window_start = self.next_log = self.line_start = time.time()
        self.line_samples = 0  # since the last progress line: its samples/s covers every step in between
        self.step = trainer.global_step
        if self.main:
            from torch.utils.tensorboard import SummaryWriter

            # resumed, or restarted in the same folder: TensorBoard drops what the lost attempt wrote after
            # the snapshot (purge_step)
            purge = self.step + 1 if self.step or self.reused_dir else None
            self.writer = SummaryWriter(log_dir=str(self.run_dir), flush_secs=10, purge_step=purge)
            if not self.step:
                write_hparams(self.writer, self.cfg, [VAL_ACC, TRAIN_LOSS])
        self.window = torch.zeros(3, dtype=torch.float64)  # loss * n, n, samples
        if self.writer is not None and self.batch_found is not None:
            self.writer.add_text("batch_size_found", str(self.batch_found), 0)

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        sampler = trainer.train_dataloader.sampler
        if trainer.current_epoch < 2 and trainer.current_epoch not in self.shards:
            self.shards[int(getattr(sampler, "epoch", trainer.current_epoch))] = [int(i) for i in sampler]

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        n = len(batch[1])
        self.window += torch.tensor([(module.last_loss or 0.0) * n, n, n], dtype=torch.float64)
        if trainer.global_step == self.step:
            return
        self.step = trainer.global_step
        self._end_global_epoch(trainer, module)
        self._maybe_fail(trainer)
        if self._snapshot_due() and self.step % self.cfg.train.eval_every:
            self._snapshot(trainer)  # at a validation step: once it is recorded (on_validation_end)
        if self.cfg.train.max_epochs is not None and self.step >= self.cfg.train.max_epochs:
            trainer.should_stop = True  # Lightning then validates this last step before it stops
        limit = self.cfg.train.max_data_epochs
        if limit is not None and self.data_epoch() >= limit:
            trainer.should_stop = True  # every rank: self.samples is the all-gathered count

    def _snapshot_due(self) -> bool:
        every = self.cfg.cluster.snapshot_every
        return bool(every) and self.step % every == 0

    def _snapshot(self, trainer: L.Trainer) -> None:
        """Every rank: Lightning's whole training state (FSDP: the optimizer's shards too) into
        <run>/snapshots/snapshot.ckpt, written beside it and renamed over it by rank 0, so a kill while
        writing leaves the previous snapshot whole."""
        folder = self.run_dir / "snapshots"
        if self.main:
            folder.mkdir(parents=True, exist_ok=True)
        trainer.strategy.barrier("snapshot")
        started = time.perf_counter()
        fresh = folder / f"{SNAPSHOT}.new"
        trainer.save_checkpoint(fresh)  # a file, or a folder of shards under FSDP
        if self.main:
            final, old = folder / SNAPSHOT, folder / f"{SNAPSHOT}.old"
            if final.is_dir():  # a folder cannot be renamed over another: keep the old one until the swap
                final.rename(old)
            os.replace(fresh, final)
            if old.is_dir():
                shutil.rmtree(old)
            log.info(
                "Snapshot at global epoch %d in %s (%.1f s)", self.step, final, time.perf_counter() - started
            )
        trainer.strategy.barrier("snapshot done")

    def _maybe_fail(self, trainer: L.Trainer) -> None:
        """The test fault ``kill:rank@E`` (swarm/faults.py): the last rank dies at epoch E, first attempt."""
        if not self.cfg.train.inject_fault:  # the common case: nothing to parse on every global epoch
            return
        from swarm.faults import LOCAL_KILL, parse_faults

        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
        last_rank = trainer.global_rank == trainer.world_size - 1
        for fault in parse_faults(self.cfg.train.inject_fault):
            if fault.kind == LOCAL_KILL and fault.epoch == self.step and last_rank and first_attempt:
                print(f"FAULT INJECTED: SIGKILL to rank {trainer.global_rank} at global epoch {self.step}")
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    # Lightning saves and restores a callback's state with the training state (snapshots)
    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_epoch": self.best_epoch,
            "samples": self.samples,
            "val_seconds": self.val_seconds,
            "curve": self.curve,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_epoch = state.get("best"), state.get("best_epoch")
        self.samples, self.val_seconds = int(state.get("samples", 0)), float(state.get("val_seconds", 0.0))
        self.curve = [tuple(point) for point in state.get("curve", [])]

    def data_epoch(self) -> float:
        """Passes over the training set: samples that went into optimizer steps / training images."""
        return self.samples / max(len(self.data.train_set), 1)

    def _end_global_epoch(self, trainer: L.Trainer, module: Any) -> None:
        mem, util = self.gpu.latest()
        row = torch.tensor(
            [*self.window.tolist(), -1.0 if mem is None else mem, -1.0 if util is None else util],
            dtype=torch.float64,
        )
        rows = trainer.strategy.all_gather(row.to(trainer.strategy.root_device)).reshape(-1, 5).cpu()
        seconds = max(time.time() - self.window_start, 1e-6)
        self.window_start, self.window = time.time(), torch.zeros(3, dtype=torch.float64)
        self.samples += int(rows[:, 2].sum())
        self.line_samples += int(rows[:, 2].sum())
        if not self.main:
            return
        loss, sps = float(rows[:, 0].sum() / rows[:, 1].sum().clamp(min=1)), float(rows[:, 2].sum()) / seconds
        add = self.writer.add_scalar
        add(TRAIN_LOSS, loss, self.step)
        add(TRAIN_SPS, sps, self.step)
        add(TRAIN_DATA_EPOCH, self.data_epoch(), self.step)
        gpu = ""
        sampled = rows[rows[:, 4] >= 0]  # ranks with an NVML sample so far
        if len(sampled):
            mem_gb, busy = float(sampled[:, 3].max()), float(sampled[:, 4].mean())
            add(SYS_GPU_MEM, mem_gb, self.step)
            add(SYS_GPU_UTIL, busy, self.step)
            gpu = f" | gpu {mem_gb:.1f} GB, {busy:.0f}% busy"
        if time.time() >= self.next_log:
            # the rate since the last line, not the last step's: one step's rate, read when a line falls due,
            # is most often that of a slow step (an H100 at a 4096 batch: lines said 1,362-1,798 samples/s
            # while the run averaged 5,271: its steps were uneven)
            line_sps = self.line_samples / max(time.time() - self.line_start, 1e-6)
            self.line_start, self.line_samples = time.time(), 0
            self.next_log = time.time() + self.cfg.train.log_every
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            log.info(
                "global epoch %d | data epoch %.2f | loss %.4f | %.1f samples/s | lr %.2e%s",
                self.step,
                self.data_epoch(),
                loss,
                line_sps,
                lr,
                gpu,
            )

    # -- validation and checkpoints -------------------------------------------------------------------
    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.val_started = time.time()

    def on_validation_end(self, trainer: L.Trainer, module: Any) -> None:
        spent = time.time() - self.val_started
        self.val_seconds += spent
        self.window_start += spent  # samples/s counts training time only
        self.line_start += spent
        val, epoch = module.last_val, trainer.global_step
        if trainer.sanity_checking or val is None or epoch == self.validated_at:
            return
        self.validated_at = epoch
        better = self.best is None or val["acc"] > self.best
        if better:
            self.best, self.best_epoch = val["acc"], epoch
        state = trainer.strategy.lightning_module_state_dict()  # every rank: FSDP gathers the shards here
        error = None
        if self.main:
            # a full disk or a lost bucket: every rank must stop, not wait for rank 0 in the next collective
            try:
                self._record_validation(trainer, val, epoch, better, state)
            except Exception as exc:
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        error = trainer.strategy.broadcast(error, src=0)
        if error:
            raise CheckpointError(f"rank 0 could not record validation at global epoch {epoch}: {error}")
        if self._snapshot_due() and epoch == self.step:
            self._snapshot(trainer)

    def _record_validation(
        self, trainer: L.Trainer, val: dict, epoch: int, better: bool, state: dict
    ) -> None:
        """Rank 0: TensorBoard, the log line, last.ckpt and (when better) best.ckpt."""
        for tag, key in ((VAL_ACC, "acc"), (VAL_ACC_TOP5, "acc_top5"), (VAL_LOSS, "loss")):
            self.writer.add_scalar(tag, val[key], epoch)
        self.writer.flush()
        self.curve.append((time.time() - self.started, epoch, val["acc"]))
        log.info(
            "Validation at global epoch %d: loss %.4f, acc %.4f, top-5 %.4f on %d images",
            epoch,
            val["loss"],
            val["acc"],
            val["acc_top5"],
            val["samples"],
        )
        weights = {k[len("net.") :]: v for k, v in state.items() if k.startswith("net.")}
        optimizer = trainer.optimizers[0] if self.plan.strategy != "fsdp" else None  # FSDP's is sharded
        metrics = {VAL_ACC: val["acc"], VAL_ACC_TOP5: val["acc_top5"], VAL_LOSS: val["loss"]}
        run = f"{self.cfg.swarm.run_id}/{self.run_dir.name}"
        payload = make_checkpoint(None, self.cfg, epoch, metrics, optimizer, state_dict=weights, run=run)
        save_checkpoint(join_url(self.ckpt_dir, "last.ckpt"), payload, self.cfg.checkpoint.s3_endpoint_url)
        if better:
            url = join_url(self.ckpt_dir, "best.ckpt")
            save_checkpoint(url, payload, self.cfg.checkpoint.s3_endpoint_url)
            log.info("Saved %s (val acc %.4f at global epoch %d)", url, val["acc"], epoch)

    # -- the end --------------------------------------------------------------------------------------
    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.gpu.stop()
        mine = {
            "rank": trainer.global_rank,
            "shards": {str(k): v for k, v in self.shards.items()},
            "param_checksum": param_checksum(module),
            "local_parameters": sum(local_tensor(p).numel() for p in module.parameters()),
            "peak_allocated_gb": self.gpu.peak_allocated_gb(),
            "mean_gpu_util": self.gpu.mean_util(),
            "cpu_seconds": self.cpu.stop(),  # this rank's process ("self"; "helpers" may hold other ranks)
        }
        ranks = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.world_size > 1:
            ranks = [None] * trainer.world_size
            torch.distributed.all_gather_object(ranks, mine)
        if self.main:
            self._write_summary(trainer, ranks)

    def _write_summary(self, trainer: L.Trainer, ranks: list[dict[str, Any]]) -> None:
        wall = time.time() - self.started
        train_seconds = max(wall - self.val_seconds, 1e-6)
        peaks = [r["peak_allocated_gb"] for r in ranks if r["peak_allocated_gb"] is not None]
        utils = [r["mean_gpu_util"] for r in ranks if r["mean_gpu_util"] is not None]
        summary = {
            "kind": "local",
            **asdict(self.plan),
            "world_size": self.plan.world_size,
            "precision": self.cfg.train.precision,
            "model_name": self.cfg.model.model_name,
            "batch_size": self.data.batch_size,
            "batch_size_found": self.batch_found,
            "accumulate": trainer.accumulate_grad_batches,
            "global_batch": self.global_batch,
            "global_epochs": trainer.global_step,
            "data_epochs": round(self.samples / max(len(self.data.train_set), 1), 2),
            "best_val_acc": self.best,
            "best_epoch": self.best_epoch,
            "wall_seconds": wall,
            "train_seconds": train_seconds,
            "samples": self.samples,
            "samples_per_second": self.samples / train_seconds,
            "peak_allocated_gb": max(peaks) if peaks else None,
            "mean_gpu_util": sum(utils) / len(utils) if utils else None,
            # CPU seconds of all ranks' processes while they trained (a rank may be another's child, so only
            # each one's own time counts); None without /proc
            "cpu_seconds": _ranks_cpu(ranks),
            "val_curve": self.curve,
            "checkpoint_dir": self.ckpt_dir,
            "started_at": self.started,
            "ranks": ranks,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        self.writer.close()
        self.summary = summary
        log.info(
            "Done: global epoch %d, best val acc %s, %.1f samples/s over %.0f s; summary in %s",
            trainer.global_step,
            f"{self.best:.4f}" if self.best is not None else "n/a",
            summary["samples_per_second"],
            train_seconds,
            self.run_dir / "summary.json",
        )


def _ranks_cpu(ranks: list[dict[str, Any]]) -> dict[str, float] | None:
    """The summed CPU seconds of the ranks' own processes, and the longest rank's wall time."""
    each = [r.get("cpu_seconds") for r in ranks]
    if any(c is None for c in each):
        return None
    return {"self": round(sum(c["self"] for c in each), 3), "wall": max(c["wall"] for c in each)}


def join_process_group_of_attempt(plan: Plan, env: DistEnv) -> None:
    """Under torchrun after a restart: the default process group, with this attempt's own keys in the store.

    torchrun keeps one TCPStore across restarts, and the keys of the lost attempt stay in it: gloo's
    ``connectFullMesh`` of the next attempt could read a dead rank's address before the new rank wrote its
    own (seen here in about half of the restarts: "Connection refused" to the old rank's port, or a hang).
    Lightning skips its own init when a group exists (lightning/fabric/utilities/distributed.py,
    ``_init_dist_connection``), so this group is the one it uses."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    if not env.torchrun or attempt == "0" or env.world_size < 2 or dist.is_initialized():
        return
    store, rank, world_size = next(dist.rendezvous("env://", env.rank, env.world_size))
    backend = "nccl" if plan.accelerator == "cuda" else "gloo"
    prefixed = dist.PrefixStore(f"swarm-trainer/attempt_{attempt}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size)


def leave_process_group() -> None:
    """Every rank: wait for the others (bounded), then destroy the process group, so that no rank exits while
    another still talks to it (torchrun's agents then wait for no straggler)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=60))
        else:
            dist.barrier()
    except Exception as exc:  # a rank that died already: leave anyway
        log.warning("Leaving without the other ranks: %s", str(exc).splitlines()[0] if str(exc) else exc)
    dist.destroy_process_group()


def run_local(cfg: ExperimentConfig) -> dict[str, Any]:
    """Train with Lightning's ``cfg.cluster.strategy``; returns the summary on global rank 0, else {}."""
    env = dist_env()
    plan = make_plan(cfg, env)
    snapshot, run_dir = find_snapshot(cfg, plan)
    if env.rank == 0 and cfg.checkpoint.checkpoint_uri:  # a missing bucket: one line now, not mid-run
        check_location(cfg.checkpoint.checkpoint_uri, cfg.checkpoint.s3_endpoint_url)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    train_set, val_set = build_datasets(cfg.data, cfg.model.img_size)
    module = SwarmClassifier(cfg.model, cfg.train)
    quiet_libraries()  # importing lightning re-enabled its INFO banner
    if plan.strategy == "dp" and plan.accelerator == "cuda":
        module.use_data_parallel(list(range(plan.devices)), autocast_dtype(cfg.train.precision))
    data = ShardedData(train_set, val_set, cfg, plan, seed=cfg.data.seed if cfg.data.seed is not None else 0)
    reporter = LocalReporter(cfg, plan, data, run_dir)
    if snapshot is not None and env.rank == 0:
        log.info("Resuming from %s (restart %s)", snapshot, os.environ.get("TORCHELASTIC_RESTART_COUNT", "-"))
    if env.rank == 0:
        log.info(
            "%s (%.2f M parameters), %d training and %d validation images",
            cfg.model.model_name,
            sum(p.numel() for p in module.parameters()) / 1e6,
            len(train_set),
            len(val_set),
        )
    accumulate = plan.accumulation(cfg.data.batch_size, cfg.swarm.target_batch_size)
    trainer = L.Trainer(
        accelerator="gpu" if plan.accelerator == "cuda" else "cpu",
        devices=1 if plan.strategy in ("dp", "single") else plan.devices,
        num_nodes=plan.num_nodes,
        strategy=lightning_strategy(plan),
        precision=cfg.train.precision,
        max_epochs=-1,
        max_steps=cfg.train.max_epochs or -1,
        max_time=timedelta(seconds=cfg.train.max_time) if cfg.train.max_time else None,
        accumulate_grad_batches=accumulate,
        check_val_every_n_epoch=None,
        val_check_interval=cfg.train.eval_every * accumulate,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=os.isatty(1) and env.rank == 0,
        use_distributed_sampler=False,
        callbacks=[reporter],
    )
    join_process_group_of_attempt(plan, env)
    trainer.fit(module, datamodule=data, ckpt_path=str(snapshot) if snapshot is not None else None)
    leave_process_group()
    launcher = getattr(trainer.strategy, "launcher", None)
    for proc in getattr(launcher, "procs", []):  # processes Lightning started for the other ranks
        if hasattr(proc, "wait"):
            proc.wait(timeout=120)
    return getattr(reporter, "summary", {})
