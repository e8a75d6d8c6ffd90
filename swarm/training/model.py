"""The model: the only module that calls timm, and the LightningModule shared by every way of training.

``SwarmClassifier`` is the same object under ``swarm-peer join`` (with HivemindStrategy) and under
``swarm-peer local`` (with Lightning's DDP or FSDP), so both write the same metric tags.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from pathlib import Path
from typing import Any

import lightning as L
import timm
import torch
import torch.nn.functional as F
from torch import nn

from swarm.config import ModelConfig, TrainConfig

log = logging.getLogger(__name__)


class ModelError(ValueError):
    """The model cannot be built with these settings; the message says why."""


def create_model(cfg: ModelConfig, weights: bool = True) -> nn.Module:
    """Build the timm model from ``cfg``: random weights seeded by ``cfg.init_seed``, or, with
    ``cfg.pretrained`` (or ``cfg.pretrained_file``), timm's pretrained weights with a classifier head for
    ``cfg.num_classes`` that is seeded by ``init_seed``, so every peer that starts together starts equal.

    ``weights=False`` skips the pretrained weights: for whoever loads a state right after (the monitor,
    ``swarm-peer evaluate``), which needs the architecture only and may have no internet.
    """
    kwargs: dict[str, Any] = {"num_classes": cfg.num_classes, "img_size": cfg.img_size}
    for name in ("patch_size", "embed_dim", "depth", "num_heads"):
        if getattr(cfg, name) is not None:
            kwargs[name] = getattr(cfg, name)
    if not timm.is_model(cfg.model_name):
        raise ModelError(
            f"timm has no model named {cfg.model_name!r}; list them with "
            f"python -c \"import timm; print(timm.list_models('vit*'))\""
        )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(cfg.init_seed)
        if weights and uses_pretrained(cfg):
            net = _pretrained(cfg, kwargs)
        else:
            net = timm.create_model(cfg.model_name, pretrained=False, **kwargs)
    except TypeError as exc:
        raise ModelError(f"{cfg.model_name} does not accept these options ({exc})") from None
    finally:
        torch.random.set_rng_state(state)
    net.register_forward_pre_hook(ResizeInput(cfg.img_size))
    return net


class ResizeInput:
    """A forward pre-hook that resizes a batch of images to the model's input size, bilinearly, on the
    batch's own device. Large inputs (CIFAR's 32 px to the flagship's 224) travel from the data loader at
    their stored size: resized per image in the loader's CPU workers, ViT-B/32 on an H100 trained at 1,118
    samples/s with the GPU 23 % busy, against 7,402 samples/s for the same step on batches already there.
    Images at the model's size pass unchanged; the model's parameters and state dict are untouched."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, module: nn.Module, args: tuple) -> tuple | None:
        images = args[0] if args else None
        if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[-2:] == (self.size,) * 2:
            return None
        size = (self.size, self.size)
        return (F.interpolate(images, size=size, mode="bilinear", align_corners=False), *args[1:])


def uses_pretrained(cfg: ModelConfig) -> bool:
    return cfg.pretrained or bool(cfg.pretrained_file)


_WEIGHTS_IDS: dict[ModelConfig, str] = {}  # the hash of each pretrained model built in this process


def _pretrained(cfg: ModelConfig, kwargs: dict[str, Any]) -> nn.Module:
    """The model with pretrained weights: timm's own (hub and cache), or those of ``cfg.pretrained_file``.
    A classifier of another class count is left out, so the head keeps its seeded initialisation (timm
    does the same: timm/models/_builder.py, ``load_pretrained``)."""
    if cfg.pretrained_file:
        net = timm.create_model(cfg.model_name, pretrained=False, **kwargs)
        _load_file(net, cfg)
        source = cfg.pretrained_file
    else:
        source = f"timm's {cfg.model_name} weights"
        try:
            net = timm.create_model(cfg.model_name, pretrained=True, **kwargs)
        except Exception as exc:  # the hub unreachable and nothing in its cache, or a model without weights
            raise ModelError(
                f"could not get {source} ({_one_line(exc)}). Connect this machine to the internet "
                "once (timm keeps them in the Hugging Face cache, ~/.cache/huggingface), or pass "
                "--pretrained-file PATH with the weights saved on a machine that has them (safetensors or a "
                "torch state dict), or start from random weights with --no-pretrained"
            ) from None
    _WEIGHTS_IDS[cfg] = "pretrained sha256:" + weights_hash(net)
    log.info("Loaded %s (head for %d classes, init_seed %d)", source, cfg.num_classes, cfg.init_seed)
    return net


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _load_file(net: nn.Module, cfg: ModelConfig) -> None:
    """Load ``cfg.pretrained_file`` into ``net``: every tensor of the model but the classifier must be in
    the file, with its shape (after timm's own adaptation of the model family, such as resampling ViT
    position embeddings for another image size). timm's loader would accept a file of another model with a
    warning, and train from random weights."""
    import sys

    from timm.models import load_state_dict as read_weights

    path = Path(cfg.pretrained_file).expanduser()
    fix = (
        "give a weights file of this model (safetensors or a torch state dict with timm's keys), "
        "or --no-pretrained"
    )
    if not path.is_file():
        raise ModelError(f"pretrained_file {cfg.pretrained_file!r} does not exist; {fix}")
    try:
        state = read_weights(str(path))
        adapt = getattr(sys.modules[type(net).__module__], "checkpoint_filter_fn", None)
        if adapt is not None:
            state = adapt(state, net)
    except Exception as exc:  # damaged, truncated, not a weights file at all
        raise ModelError(f"could not read {cfg.pretrained_file} ({_one_line(exc)}); {fix}") from None
    own = net.state_dict()
    classifier = str(getattr(net, "pretrained_cfg", {}).get("classifier") or "head")
    head = {k for k in own if k == classifier or k.startswith(classifier + ".")}
    for key in head & set(state):
        if state[key].shape != own[key].shape:  # trained for other classes: keep the seeded head
            del state[key]
    missing = [k for k in own if k not in state and k not in head]
    wrong = [k for k in state if k in own and state[k].shape != own[k].shape]
    unknown = [k for k in state if k not in own]
    if missing or wrong or unknown:
        parts = [
            f"{len(found)} {what} (first: {found[0]})"
            for found, what in (
                (missing, "tensors missing"),
                (wrong, "of other shapes"),
                (unknown, "unknown"),
            )
            if found
        ]
        raise ModelError(
            f"{cfg.pretrained_file} does not hold {cfg.model_name} weights for this config: "
            + ", ".join(parts)
            + f"; {fix}"
        )
    net.load_state_dict(state, strict=False)


def weights_hash(net: nn.Module) -> str:
    """A short hash of every tensor of ``net``'s state dict (names, shapes and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in net.state_dict().items():
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def weights_id(cfg: ModelConfig) -> str:
    """What the swarm's peers start from, for the config fingerprint: 'random', or the hash of the
    pretrained model as built, head included (so peers with other starting weights refuse each other,
    whichever way the weights came: hub or file). Builds the model if this process has not yet."""
    if not uses_pretrained(cfg):
        return "random"
    if cfg not in _WEIGHTS_IDS:
        create_model(cfg)
    return _WEIGHTS_IDS[cfg]


def lr_lambda(warmup_epochs: int, schedule_epochs: int, floor: float = 0.05):
    """Linear warm-up then cosine decay to ``floor`` of the peak, as a function of the optimizer step."""

    def factor(step: int) -> float:
        if step < warmup_epochs:
            return (step + 1) / (warmup_epochs + 1)
        progress = min(1.0, (step - warmup_epochs) / max(1, schedule_epochs))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def optimizer_kernel(params: Any) -> dict[str, bool]:
    """AdamW's fused kernel where every parameter allows it (floating point, on the CPU or a CUDA device).

    For the demo model on one CPU thread an AdamW step takes 0.39 ms fused against 1.09 ms with the default
    foreach kernels, next to 5.4 ms of forward and backward for 32 samples: DiLoCo's inner loop steps after
    every batch, so this is 13 % of its compute. Elsewhere the choice of torch's defaults is kept."""
    params = list(params)
    ok = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return {"fused": True} if ok else {}


def accuracy_counts(logits: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    """Return (top-1 correct, top-5 correct) for a batch."""
    k = min(5, logits.shape[-1])
    topk = logits.topk(k, dim=-1).indices
    hits = topk.eq(target.unsqueeze(-1))
    return int(hits[:, 0].sum()), int(hits.any(dim=-1).sum())


class _AutocastForward(nn.Module):
    """``net`` under autocast with a fixed dtype (None: full precision), for DataParallel's threads."""

    def __init__(self, net: nn.Module, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.net, self.dtype = net, dtype

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=self.dtype, enabled=self.dtype is not None):
            return self.net(images)


class SwarmClassifier(L.LightningModule):
    """Image classifier with cross-entropy loss, AdamW and a warm-up + cosine schedule.

    The schedule advances once per optimizer step. Under HivemindStrategy one optimizer step is one
    global epoch of the swarm, so the learning rate follows the swarm's progress, not the local step.
    """

    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, weights: bool = True) -> None:
        super().__init__()
        self.model_cfg, self.train_cfg = model_cfg, train_cfg
        self.net = create_model(model_cfg, weights)
        self.last_loss: float | None = None
        self.last_val: dict[str, float] | None = None  # the latest validation, equal on every rank
        self.sharded = False
        self._val_sums = torch.zeros(4, dtype=torch.float64)  # loss*n, correct, correct_top5, n
        self._replicas: nn.Module | None = None  # DataParallel view of net (strategy 'dp'); not a submodule

    def use_data_parallel(self, device_ids: list[int], dtype: torch.dtype | None = None) -> None:
        """Split every batch over these GPUs of this process (torch.nn.DataParallel; strategy 'dp').

        DataParallel's worker threads re-enter autocast without a dtype (thread-local, so fp16), so each
        replica sets the run's autocast dtype itself."""
        replicas = nn.DataParallel(_AutocastForward(self.net, dtype), device_ids=device_ids)
        object.__setattr__(self, "_replicas", replicas)

    def configure_model(self) -> None:
        """Under Lightning's ModelParallelStrategy (our 'fsdp'): shard with FSDP2, one unit per transformer
        block plus the root (patch embedding, head). Parameters, gradients and AdamW state are then split
        over the data-parallel ranks. Other strategies leave the model whole."""
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None or self.sharded:
            return
        from torch.distributed.fsdp import fully_shard

        for block in getattr(self.net, "blocks", []):
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])
        self.sharded = True

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return (self._replicas or self.net)(images)

    def batch_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The loss of one training batch, as a training step computes it. HivemindStrategy's screen also
        asks it of a state round's averaged parameters (swarm/averaging/screen.py ``PROBE_RISE``)."""
        images, target = batch
        return F.cross_entropy(self(images), target)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.batch_loss(batch)
        self.last_loss = float(loss.detach())  # the roles' reporters average and log it
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_sums = torch.zeros(4, dtype=torch.float64, device=self.device)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, target = batch
        logits = self(images)
        real = target >= 0  # padding (label -1) keeps ranks' shards equal in length; it never counts
        logits, target = logits[real], target[real]
        loss = F.cross_entropy(logits.float(), target, reduction="sum") if len(target) else logits.sum() * 0
        top1, top5 = accuracy_counts(logits, target)
        self._val_sums += torch.tensor(
            [float(loss), top1, top5, len(target)], dtype=torch.float64, device=self.device
        )

    def on_validation_epoch_end(self) -> None:
        sums = self.trainer.strategy.reduce(self._val_sums.clone(), reduce_op="sum")
        n = max(float(sums[3]), 1.0)
        self.last_val = {
            "loss": float(sums[0]) / n,
            "acc": float(sums[1]) / n,
            "acc_top5": float(sums[2]) / n,
            "samples": int(sums[3]),
        }

    def configure_optimizers(self) -> dict[str, Any]:
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.train_cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.train_cfg.lr,
            **optimizer_kernel(self.parameters()),
        )
        schedule = lr_lambda(self.train_cfg.warmup_epochs, self.train_cfg.schedule_epochs)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@torch.no_grad()
def evaluate(
    module: nn.Module,
    loader: torch.utils.data.DataLoader,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Evaluate ``module`` on every batch of ``loader``; returns loss, acc, acc_top5 and samples."""
    was_training = module.training
    module.eval()
    total_loss, correct, correct5, n = 0.0, 0, 0, 0
    try:
        for images, target in loader:
            images, target = images.to(device), target.to(device)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                logits = module(images)
            total_loss += float(F.cross_entropy(logits.float(), target, reduction="sum"))
            top1, top5 = accuracy_counts(logits, target)
            correct, correct5, n = correct + top1, correct5 + top5, n + len(target)
    finally:
        module.train(was_training)
    n_safe = max(n, 1)
    return {"loss": total_loss / n_safe, "acc": correct / n_safe, "acc_top5": correct5 / n_safe, "samples": n}


def resolve_device(requested: str) -> str:
    """'auto' means CUDA when present; asking for CUDA on a machine without it is an error."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible; use --device cpu or auto")
    return requested


def cheap_cuda_checks(device: str) -> None:
    """On a CPU run on a machine without any GPU, make ``torch.cuda.is_available()`` cost 1 us, not 36.

    Lightning sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` when imported (lightning/fabric/__init__.py:28), so
    every call first tries to load NVML, fails, and only then asks CUDA, uncached (torch/cuda/__init__.py,
    ``device_count``). AdamW asks at every step (torch/optim/optimizer.py,
    ``_accelerator_graph_capture_health_check``): 3 % of a DiLoCo peer's main thread, whose inner AdamW steps
    at every local step (py-spy, 2 peers on 2 cores). Where a GPU is present the variable stays:
    it keeps the process from initialising CUDA before hivemind forks its helpers."""
    if device == "cpu" and torch.cuda.device_count() == 0:  # NVML's count: initialises nothing
        os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a Lightning precision ('bf16-mixed', '16-mixed'); None for full precision."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: the local shard of an FSDP2 DTensor, else the tensor itself."""
    return p.to_local() if hasattr(p, "to_local") else p


def param_checksum(module: nn.Module | list[torch.Tensor]) -> list[float]:
    """Two float64 sums over all parameters (plain and squared) of a module or a list of tensors: equal
    parameters give equal sums. Under FSDP each rank sums only its own shards."""
    total, squares = 0.0, 0.0
    params = module.parameters() if isinstance(module, nn.Module) else module
    with torch.no_grad():
        for p in params:
            d = local_tensor(p).detach().double()
            total += float(d.sum())
            squares += float((d * d).sum())
    return [total, squares]
