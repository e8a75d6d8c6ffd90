"""One log format for every role, and quieter third-party loggers."""

from __future__ import annotations

import logging
import os
import sys
import warnings

FORMAT = "%(asctime)s %(levelname).1s %(name)s | %(message)s"


def setup_logging(verbose: bool = False) -> None:
    """Configure the root logger once: INFO to stderr (DEBUG with ``verbose``), quiet library chatter."""
    level = logging.DEBUG if verbose else logging.INFO
    root = logging.getLogger()
    if not any(getattr(h, "_swarm", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        handler._swarm = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
    quiet_libraries()
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # hivemind leaves pending tasks at exit
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "INFO" if verbose else "WARNING")
    try:
        from hivemind.utils.logging import get_logger

        get_logger("hivemind").setLevel(logging.INFO if verbose else logging.WARNING)
    except ImportError:
        pass


def quiet_libraries() -> None:
    """Keep Lightning's start-up banner and known-harmless warnings out of the peer's log."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        logger.propagate = True
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*")
    warnings.filterwarnings("ignore", message=".*no `val_dataloader`.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="timm")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*is deprecated.*", module="hivemind")
