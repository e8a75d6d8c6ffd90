"""The largest per-device batch that fits: a doubling then binary search of real training steps.

Each trial runs forward, backward and an AdamW step of a copy of the model on the target device with
random images of the model's input size, so weights, gradients, optimizer state and activations are all
counted. A CUDA out-of-memory error marks a batch as too large; memory is freed before the next trial.
"""

from __future__ import annotations

import copy
import gc
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def largest_batch(fits: Callable[[int], bool], start: int, limit: int) -> tuple[int, list[tuple[int, bool]]]:
    """The largest b <= ``limit`` with ``fits(b)``, assuming fits is monotone; also every trial made.

    Doubles from ``start`` until a batch fails or ``limit`` is reached, then bisects between the largest
    success and the smallest failure. Returns 0 if even batch 1 does not fit.
    """
    trials: list[tuple[int, bool]] = []

    def trial(b: int) -> bool:
        ok = fits(b)
        trials.append((b, ok))
        log.info("Batch-size search: %d per device %s", b, "fits" if ok else "does not fit")
        return ok

    low, high = 0, limit + 1  # low fits (0 trivially), high does not
    b = max(1, min(start, limit))
    while b < high:
        if trial(b):
            low = b
            if b == limit:
                break
            b = min(b * 2, limit)
        else:
            high = b
            break
    while high - low > 1:
        mid = (low + high) // 2
        if trial(mid):
            low = mid
        else:
            high = mid
    return low, trials


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def step_fits(
    net: nn.Module, num_classes: int, img_size: int, device: torch.device, autocast: torch.dtype | None
) -> Callable[[int], bool]:
    """A ``fits(b)`` that trains a copy of ``net`` for one step at batch ``b`` on ``device``."""
    trial_net = copy.deepcopy(net).to(device).train()
    optimizer = torch.optim.AdamW(trial_net.parameters(), lr=1e-6)

    def fits(batch: int) -> bool:
        try:
            images = torch.randn(batch, 3, img_size, img_size, device=device)
            target = torch.randint(0, num_classes, (batch,), device=device)
            with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                loss = F.cross_entropy(trial_net(images).float(), target)
            loss.backward()
            optimizer.step()
            return True
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            if not _is_oom(exc):
                raise
            return False
        finally:
            optimizer.zero_grad(set_to_none=True)
            images = target = loss = None  # noqa: F841 (drop references before freeing the cache)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    return fits
