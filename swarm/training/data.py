"""Data: CIFAR-10 through torchvision, the embedded offline digits set, and per-peer shuffling.

The offline set is scikit-learn's handwritten digits (1,797 real 8x8 scans, shipped inside the
scikit-learn wheel): it needs no network, so the demo and the tests run anywhere. Images are kept as
uint8 tensors: small inputs are scaled to the model's input size once, up front; large ones (CIFAR's 32 px
for a 224 px model) leave the loader at their stored size and the model resizes each batch on its own
device (``swarm.training.model.ResizeInput``), so the loader's CPU workers never build 224 px images.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from swarm.config import DataConfig

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST_FILES = ["test_batch"]


class DatasetError(RuntimeError):
    """The data set is missing or unreadable; the message names the path and the fix."""


class TensorImageDataset(Dataset):
    """uint8 images (N, 3, H, W) with int labels, normalised to float at their stored size; random crop
    (padding of 1/8 of the side, reflected) and optional flip when ``augment``. ``size`` is the model's input
    size, which the model itself resizes to (``swarm.training.model.ResizeInput``)."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        mean: tuple,
        std: tuple,
        size: int,
        augment: bool = False,
        flip: bool = False,
    ) -> None:
        self.images, self.labels, self.augment, self.flip = images, labels, augment, flip
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)
        self.size = size
        self.pad = max(1, images.shape[-1] // 8)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index].float().div_(255)
        size = image.shape[-1]
        if self.augment:
            padded = F.pad(image.unsqueeze(0), [self.pad] * 4, mode="reflect").squeeze(0)
            top, left = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
            image = padded[:, top : top + size, left : left + size]
            if self.flip and torch.rand(()) < 0.5:
                image = image.flip(-1)
        return (image - self.mean) / self.std, int(self.labels[index])


def _resize_uint8(images: torch.Tensor, size: int) -> torch.Tensor:
    """Resize uint8 (N, C, H, W) images in chunks, bilinearly, keeping uint8."""
    if images.shape[-1] == size and images.shape[-2] == size:
        return images.contiguous()
    out = []
    for chunk in images.split(1024):
        scaled = F.interpolate(chunk.float(), size=(size, size), mode="bilinear", align_corners=False)
        out.append(scaled.round().clamp_(0, 255).to(torch.uint8))
    return torch.cat(out)


def load_digits_split(val_fraction: float = 0.2) -> tuple[torch.Tensor, ...]:
    """scikit-learn's digits as (train_x, train_y, val_x, val_y) uint8 RGB tensors at 8x8."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(bunch.images).float().mul_(255 / 16).round_().to(torch.uint8)
    images = images.unsqueeze(1).expand(-1, 3, -1, -1)
    labels = torch.from_numpy(bunch.target).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))  # fixed split
    n_val = int(len(labels) * val_fraction)
    val_idx, train_idx = order[:n_val], order[n_val:]
    return images[train_idx], labels[train_idx], images[val_idx], labels[val_idx]


def _read_cifar_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one pickle of the cifar-10-batches-py layout into uint8 (N, 3, 32, 32) and labels."""
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        data = torch.as_tensor(entry["data"], dtype=torch.uint8).reshape(-1, 3, 32, 32)
        labels = torch.as_tensor(entry["labels"] if "labels" in entry else entry["fine_labels"]).long()
    except FileNotFoundError:
        raise
    except (
        pickle.UnpicklingError,
        EOFError,
        KeyError,
        TypeError,
        ValueError,
        RuntimeError,
        AttributeError,
        IndexError,
    ) as exc:
        raise DatasetError(
            f"{path} is corrupt ({type(exc).__name__}); delete {path.parent} and download CIFAR-10 again"
        ) from None
    if len(data) != len(labels) or len(labels) == 0 or int(labels.min()) < 0 or int(labels.max()) > 9:
        raise DatasetError(
            f"{path} is corrupt (bad labels or sizes); delete {path.parent} and download again"
        )
    return data, labels


def _download_cifar(root: Path) -> None:
    """Fetch and verify CIFAR-10 with torchvision (needs internet)."""
    from torchvision.datasets import CIFAR10

    try:
        CIFAR10(root=str(root), train=True, download=True)
    except Exception as exc:  # network errors come in many types
        raise DatasetError(
            f"could not download CIFAR-10 into {root} ({type(exc).__name__}: {exc}); copy "
            f"{CIFAR_FOLDER} there by hand and pass --data-dir {root} --no-download"
        ) from None


def load_cifar10(data_dir: str, download: bool) -> tuple[torch.Tensor, ...]:
    """CIFAR-10 as (train_x, train_y, test_x, test_y) uint8 tensors at 32x32."""
    root = Path(data_dir).expanduser()
    folder = root / CIFAR_FOLDER
    missing = [n for n in CIFAR_TRAIN_FILES + CIFAR_TEST_FILES if not (folder / n).is_file()]
    if missing and download:
        _download_cifar(root)
        missing = [n for n in CIFAR_TRAIN_FILES + CIFAR_TEST_FILES if not (folder / n).is_file()]
    if missing:
        raise DatasetError(
            f"CIFAR-10 not found: {folder} lacks {', '.join(missing)}; pass --data-dir pointing at the "
            f"folder that holds {CIFAR_FOLDER}, or allow --download on a machine with internet"
        )
    parts = [_read_cifar_batch(folder / n) for n in CIFAR_TRAIN_FILES]
    test_x, test_y = _read_cifar_batch(folder / CIFAR_TEST_FILES[0])
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), test_x, test_y


def build_datasets(cfg: DataConfig, img_size: int) -> tuple[TensorImageDataset, TensorImageDataset]:
    """Return (train, val) datasets for ``cfg.dataset`` at ``img_size``, honouring the sample limits."""
    if cfg.dataset == "digits":
        train_x, train_y, val_x, val_y = load_digits_split()
        mean, std, flip = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), False  # flipped digits are other digits
    else:
        train_x, train_y, val_x, val_y = load_cifar10(cfg.data_dir, cfg.download)
        mean, std, flip = CIFAR_MEAN, CIFAR_STD, True
    if cfg.limit_train_samples:
        train_x, train_y = train_x[: cfg.limit_train_samples], train_y[: cfg.limit_train_samples]
    if cfg.limit_val_samples:
        val_x, val_y = val_x[: cfg.limit_val_samples], val_y[: cfg.limit_val_samples]
    if img_size <= 64:  # small inputs: resize once, up front
        train_x, val_x = _resize_uint8(train_x, img_size), _resize_uint8(val_x, img_size)
    train = TensorImageDataset(train_x, train_y, mean, std, img_size, augment=cfg.augment, flip=flip)
    val = TensorImageDataset(val_x, val_y, mean, std, img_size, augment=False)
    return train, val


def peer_seed(cfg: DataConfig) -> int:
    """This peer's shuffling seed: the configured one, or a fresh random one per process."""
    return cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(4), "little")


def train_loader(dataset: Dataset, cfg: DataConfig, seed: int) -> DataLoader:
    """Shuffled, infinite-epoch training loader whose order depends only on ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        shuffle=True,
        drop_last=True,
        generator=generator,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,
    )


def val_loader(dataset: Dataset, cfg: DataConfig) -> DataLoader:
    """Sequential validation loader."""
    return DataLoader(
        dataset, batch_size=max(cfg.batch_size, 128), shuffle=False, num_workers=cfg.num_workers
    )


class PaddedDataset(Dataset):
    """``dataset`` padded with blank items labelled -1 to a multiple of ``multiple``. Every rank then gets
    the same number of validation batches (a sharded model needs every rank in every forward pass), and no
    real image is counted twice: the model's validation step drops label -1."""

    def __init__(self, dataset: Dataset, multiple: int) -> None:
        self.dataset, self.n = dataset, len(dataset)
        self.total = -(-self.n // multiple) * multiple

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index < self.n:
            return self.dataset[index]
        image, _ = self.dataset[0]
        return torch.zeros_like(image), -1


class RepeatedDataset(Dataset):
    """``dataset`` ``passes`` times over (item ``i`` is item ``i % len(dataset)``): a loader epoch that holds
    several passes over a small data set, so that one global epoch (one target batch) fits in it."""

    def __init__(self, dataset: Dataset, passes: int) -> None:
        self.dataset, self.n, self.passes = dataset, len(dataset), passes

    def __len__(self) -> int:
        return self.n * self.passes

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.dataset[index % self.n]


def shard_loaders(
    train: Dataset,
    val: Dataset,
    cfg: DataConfig,
    batch_size: int,
    rank: int,
    world: int,
    seed: int,
    passes: int = 1,
) -> tuple[DataLoader, DataLoader]:
    """Loaders for one rank of ``world``: disjoint shards through DistributedSampler (the same ``seed`` on
    every rank; Lightning calls ``set_epoch`` on the sampler every data epoch, which reshuffles). With
    ``passes`` > 1 one loader epoch goes over the training set that many times, shuffled as a whole."""
    if passes > 1:
        train = RepeatedDataset(train, passes)
    train_sampler = DistributedSampler(
        train, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    padded = PaddedDataset(val, world)
    val_sampler = DistributedSampler(padded, num_replicas=world, rank=rank, shuffle=False)
    common = dict(num_workers=cfg.num_workers, persistent_workers=cfg.num_workers > 0)
    return (
        DataLoader(train, batch_size=batch_size, sampler=train_sampler, drop_last=True, **common),
        DataLoader(padded, batch_size=max(batch_size, 128), sampler=val_sampler, **common),
    )
