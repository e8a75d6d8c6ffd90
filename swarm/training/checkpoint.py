"""Checkpoints: save and load through fsspec URLs (a path, ``file://`` or ``s3://bucket/prefix``), atomically.

A checkpoint is a plain dict that ``torch.load(path)`` reads with its default ``weights_only=True``:

    {"format": "swarm-trainer/1", "model_name": "vit_base_patch32_224", "global_epoch": 40,
     "state_dict": {...timm keys...}, "optimizer": {...AdamW state_dict...} or None,
     "metrics": {"val/acc": 0.61, ...}, "config": {...resolved ExperimentConfig...},
     "run": "vit-b32-cifar10/monitor", "saved_at": 1.7e9}

``state_dict`` uses timm's own keys, so ``timm.create_model(name, num_classes=...).load_state_dict(
ckpt["state_dict"])`` works without this package. Writes never leave a truncated file behind: a local
file is written beside the target and renamed over it; an object store (S3) makes an upload visible
only once it is complete. S3 credentials come from the usual AWS variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ...); ``s3_endpoint_url`` points at MinIO or another
S3-speaking server.
"""

from __future__ import annotations

import io
import logging
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import fsspec
    import torch

    from swarm.config import ExperimentConfig, ModelConfig

log = logging.getLogger(__name__)
FORMAT = "swarm-trainer/1"
OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "memory")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the URL and what to do."""


def _filesystem(
    url: str, endpoint_url: str | None = None, attempts: int | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of ``url`` and the path in it; ``attempts``: how many times an S3 request is tried
    (botocore's own default where None: 5, 6 s in all against an endpoint that refuses connections)."""
    import fsspec

    options: dict[str, Any] = {}
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("s3", "s3a"):
        if endpoint_url:
            options["client_kwargs"] = {"endpoint_url": endpoint_url}
        if attempts:
            options["config_kwargs"] = {"retries": {"max_attempts": attempts}}
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise CheckpointError(f"cannot use {url!r}: {exc}") from None
    except ValueError as exc:
        raise CheckpointError(f"{url!r} is not a usable checkpoint location ({exc})") from None


def join_url(base: str, name: str) -> str:
    """``base`` (a folder path or URL) joined with a file name."""
    return base.rstrip("/") + "/" + name


def _protocols(fs: fsspec.AbstractFileSystem) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return bool(_protocols(fs) & {"file", "local"})


def _explain(url: str, exc: BaseException) -> str:
    """One line that says what went wrong with ``url`` and how to fix it."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    refused = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Access Key Id", "credentials")
    if url.startswith("s3"):
        # credentials first: S3 says "The AWS Access Key Id you provided does not exist in our records"
        if isinstance(exc, PermissionError) or any(word in text for word in refused):
            return (
                f"{url}: S3 refused access ({text}); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                "or AWS_PROFILE"
            )
        if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text or "does not exist" in text:
            return f"{url}: the S3 bucket does not exist ({text}); create it or fix --checkpoint-uri"
        return f"{url}: S3 request failed ({text}); check --s3-endpoint-url, the network and the credentials"
    return f"{url}: {text}"


def save_checkpoint(url: str, payload: dict[str, Any], endpoint_url: str | None = None) -> str:
    """Write ``payload`` to ``url`` atomically: readers see the old file or the new one, never a part."""
    import torch

    fs, path = _filesystem(url, endpoint_url)
    started = time.perf_counter()
    try:
        if _is_local(fs):
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
            try:
                with open(tmp, "wb") as fh:
                    torch.save(payload, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, target)
                _fsync_dir(target.parent)
            finally:
                tmp.unlink(missing_ok=True)
        else:
            buffer = io.BytesIO()
            torch.save(payload, buffer)
            data = buffer.getvalue()
            if _protocols(fs) & set(OBJECT_STORES):
                fs.pipe_file(path, data)  # one PUT (or a multipart upload): visible only when complete
            else:
                tmp_path = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
                fs.pipe_file(tmp_path, data)
                fs.mv(tmp_path, path)
    except Exception as exc:
        raise CheckpointError(_explain(url, exc)) from None
    log.debug("Saved %s in %.1f s", url, time.perf_counter() - started)
    return url


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_location(base: str, endpoint_url: str | None = None) -> None:
    """Fail early, with one line, if checkpoints cannot be written under ``base`` (no bucket, no access).
    An S3 request is tried twice here, not botocore's 5 times: a wrong endpoint is reported within a second
    at start; the saves themselves keep botocore's retries."""
    fs, path = _filesystem(base, endpoint_url, attempts=2)
    try:
        if _is_local(fs):
            Path(path).mkdir(parents=True, exist_ok=True)
            if not os.access(path, os.W_OK):
                raise PermissionError(f"no write permission on {path}")
        elif _protocols(fs) & {"s3", "s3a"}:
            bucket = path.split("/", 1)[0]
            try:
                fs.info(bucket)  # unlike exists(), tells a missing bucket from an unreachable endpoint
            except FileNotFoundError:
                raise FileNotFoundError(f"bucket {bucket!r} not found") from None
    except Exception as exc:
        raise CheckpointError(_explain(base, exc)) from None


def checkpoint_exists(url: str, endpoint_url: str | None = None) -> bool:
    """True if a file exists at ``url``; raises CheckpointError if the location cannot be reached."""
    fs, path = _filesystem(url, endpoint_url)
    try:
        return bool(fs.exists(path))
    except Exception as exc:
        raise CheckpointError(_explain(url, exc)) from None


def load_checkpoint(url: str, endpoint_url: str | None = None) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`; CheckpointError if it is missing or damaged."""
    import torch

    fs, path = _filesystem(url, endpoint_url)
    try:
        with fs.open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {url} does not exist; check the path or URL") from None
    except Exception as exc:
        raise CheckpointError(_explain(url, exc)) from None
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint {url} is corrupt or truncated ({len(data)} bytes; {first[:120]}); "
            "use another checkpoint, e.g. last.ckpt instead of best.ckpt"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "state_dict" not in payload:
        raise CheckpointError(f"{url} is not a swarm-trainer checkpoint (expected format {FORMAT!r})")
    return payload


def make_checkpoint(
    net: torch.nn.Module | None,
    cfg: ExperimentConfig,
    global_epoch: int,
    metrics: dict[str, float],
    optimizer: torch.optim.Optimizer | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
    run: str | None = None,
) -> dict[str, Any]:
    """The checkpoint dict for the timm model ``net`` (weights copied to the CPU). ``state_dict`` replaces
    ``net.state_dict()`` when the weights were gathered elsewhere (a sharded FSDP model; net=None then).
    ``run`` is the run's folder under the log directory (``<run_id>/monitor``, ``<run_id>/ddp``), where
    ``swarm-peer evaluate`` files its results."""
    weights = state_dict if state_dict is not None else net.state_dict()
    return {
        "format": FORMAT,
        "model_name": cfg.model.model_name,
        "global_epoch": int(global_epoch),
        "state_dict": {k: v.detach().to("cpu", copy=True) for k, v in weights.items()},
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "metrics": {k: float(v) for k, v in metrics.items()},
        "config": cfg.to_dict(),
        "run": run,
        "saved_at": time.time(),
    }


MODEL_FIELDS = ("model_name", "num_classes", "img_size", "patch_size", "embed_dim", "depth", "num_heads")


def check_compatible(payload: dict[str, Any], model_cfg: ModelConfig, url: str) -> None:
    """Raise CheckpointError if the checkpoint's model differs from ``model_cfg`` (name, classes, shape)."""
    saved = (payload.get("config") or {}).get("model") or {"model_name": payload.get("model_name")}
    diffs = [
        f"{name} {saved.get(name)!r} != {getattr(model_cfg, name)!r}"
        for name in MODEL_FIELDS
        if name in saved and saved.get(name) != getattr(model_cfg, name)
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {url} holds another model than this run ({'; '.join(diffs)}); "
            "use the checkpoint's --config or a matching checkpoint"
        )


def load_weights(net: torch.nn.Module, payload: dict[str, Any], url: str) -> None:
    """Copy the checkpoint's weights into ``net``; CheckpointError on missing or mis-shaped tensors."""
    try:
        net.load_state_dict(payload["state_dict"], strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(f"checkpoint {url} does not fit this model ({first[:160]})") from None
