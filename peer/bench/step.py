"""``step`` (CUDA only): samples/s and model FLOPs utilisation of the ViT-B/32 training step at 224x224,
bf16."""

from __future__ import annotations

import time
from typing import Any

from peer.bench.harness import Bench, Options, fmt, table

# dense bf16 tensor-core peaks (FLOP/s), by a word in torch.cuda.get_device_name(); --peak-tflops overrides
PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12), ("L4", 121e12))


def peak_flops(device_name: str) -> float | None:
    return next((peak for word, peak in PEAK_BF16 if word in device_name), None)


def measure_step(
    model_name: str,
    batch: int,
    steps: int,
    warmup: int,
    device: str,
    img_size: int = 224,
    **model_kwargs: Any,
) -> dict[str, Any]:
    """Train ``model_name`` on CIFAR-sized uint8 images kept on ``device`` and resized there (bilinear) to
    ``img_size``, in bf16 autocast with AdamW: samples/s over ``steps`` after ``warmup``, and the FLOPs of one
    step as torch's FLOP counter counts them (forward and backward; the optimizer's are not counted)."""
    import timm
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = timm.create_model(model_name, num_classes=10, img_size=img_size, **model_kwargs).to(device)
    cuda = device.startswith("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    images = torch.randint(0, 256, (max(batch * 4, 1024), 3, 32, 32), dtype=torch.uint8, device=device)
    labels = torch.randint(0, 10, (images.shape[0],), device=device)
    mean = torch.tensor([0.4914, 0.4822, 0.4465], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616], device=device).view(1, 3, 1, 1)

    def forward_backward(i: int) -> None:
        idx = torch.randint(0, images.shape[0], (batch,), device=device)
        x = (images[idx].float() / 255 - mean) / std
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False)
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), labels[idx])
        loss.backward()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with FlopCounterMode(display=False) as counter:
        forward_backward(0)
    flops_per_step = counter.get_total_flops()
    optimizer.zero_grad(set_to_none=True)
    for i in range(warmup):
        forward_backward(i)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    for i in range(steps):
        forward_backward(i)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    sync()
    seconds = time.perf_counter() - began
    return {
        "model": model_name,
        "img_size": img_size,
        "batch": batch,
        "steps": steps,
        "seconds": round(seconds, 3),
        "samples_per_second": round(batch * steps / seconds, 1),
        "flops_per_sample": flops_per_step / batch,
        "achieved_tflops": round(flops_per_step * steps / seconds / 1e12, 2),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }


def run(bench: Bench, opts: Options, steps: int = 50, warmup: int = 10) -> None:
    batch, peak_tflops = opts.step_batch, opts.peak_tflops
    import torch

    if not torch.cuda.is_available():
        print("step: skipped, no CUDA GPU here (it measures the bf16 ViT-B/32 step on a GPU)", flush=True)
        return
    name = torch.cuda.get_device_name(0)
    peak = peak_tflops * 1e12 if peak_tflops else peak_flops(name)
    r = measure_step("vit_base_patch32_224", batch, steps, warmup, "cuda")
    mfu = r["achieved_tflops"] * 1e12 / peak if peak else None
    bench.record(
        {
            "scenario": "step",
            "gpu": name,
            "precision": "bf16-mixed",
            **r,
            "peak_tflops": peak / 1e12 if peak else None,
            "mfu": round(mfu, 3) if mfu else None,
        }
    )
    print(
        f"step {r['model']} bf16 at {r['img_size']}px, batch {batch} on {name}: "
        f"{r['samples_per_second']:.0f} samples/s, {r['achieved_tflops']:.0f} TFLOP/s, MFU {fmt(mfu)}"
        + ("" if peak else " (unknown peak: give --peak-tflops)"),
        flush=True,
    )


def summary_table(rows: list[dict[str, Any]]) -> str:
    header = ["GPU", "model", "batch", "samples/s", "TFLOP/s", "MFU", "peak memory"]
    return table(
        rows,
        "step",
        header,
        lambda r: [
            r["gpu"],
            f"{r['model']} {r['img_size']}px bf16",
            r["batch"],
            r["samples_per_second"],
            r["achieved_tflops"],
            fmt(r["mfu"]),
            f"{r['peak_memory_gb']} GB",
        ],  # fmt: skip
    )
