"""One log format for every role, and quieter third-party loggers."""

from __future__ import annotations

import logging
import os
import sys
import traceback
import warnings

FORMAT = "%(asctime)s %(levelname).1s %(name)s | %(message)s"

_FORK_WAIT_S = 2.0  # longest that a fork waits for one log handler that another thread is writing through
_held_for_fork: list = []
_registered = False


def fork_safe_logging() -> None:
    """Make a fork wait until no other thread is inside a log handler. Idempotent; ``swarm`` calls it when
    imported.

    hivemind starts every averager (and the DHT) as a forked ``multiprocessing.Process`` while the parent's
    threads go on logging. Python re-creates each handler's lock in the child, but not the lock of the
    stream's buffer: a fork while another thread was inside ``stream.write`` leaves the child's buffer locked
    by a thread that does not exist there, and the child's first log line (hivemind's averagers log at
    start-up) blocks for ever. Holding every handler's lock across the fork keeps other threads out of the
    handlers' streams at that moment. A handler held elsewhere for longer than ``_FORK_WAIT_S`` is passed
    over rather than stalling the fork."""
    global _registered
    if _registered or not hasattr(os, "register_at_fork"):
        return
    _registered = True
    os.register_at_fork(
        before=_hold_handlers, after_in_parent=_release_handlers, after_in_child=_forget_handlers
    )


def _hold_handlers() -> None:
    # logging's own before-fork hook takes the module lock after this one (hooks run in reverse order of
    # registration), which is the order FileHandler.close takes them: a handler's lock, then the module's
    with logging._lock:  # type: ignore[attr-defined]
        handlers = [ref() for ref in logging._handlerList]  # type: ignore[attr-defined]
    for handler in handlers:
        lock = getattr(handler, "lock", None) if handler is not None else None
        if lock is not None and lock.acquire(timeout=_FORK_WAIT_S):
            _held_for_fork.append(lock)


def _release_handlers() -> None:
    while _held_for_fork:
        _held_for_fork.pop().release()


def _forget_handlers() -> None:
    # logging re-creates every handler's lock in the child before this hook runs; one it did not know of is
    # still held by this thread, the only one the child has
    while _held_for_fork:
        try:
            _held_for_fork.pop().release()
        except RuntimeError:  # re-created, so not held
            pass


def setup_logging(verbose: bool = False, quiet: bool = False) -> None:
    """Configure the root logger once: INFO to stderr (DEBUG with ``verbose``, WARNING with ``quiet``, as on
    every rank but 0 in local mode), and quiet library chatter."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    root = logging.getLogger()
    if not any(getattr(h, "_swarm", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        handler._swarm = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
    quiet_libraries()
    quiet_hivemind(verbose)


def quiet_hivemind(verbose: bool = False) -> None:
    """hivemind at WARNING with one-line errors, and no asyncio noise at exit (pending tasks, closed loops).

    The CLI calls it through :func:`setup_logging`; ``HivemindStrategy`` calls it too, so that a script that
    uses the strategy directly gets the same console. ``verbose`` keeps hivemind's INFO lines and tracebacks.
    """
    if not verbose:
        sys.unraisablehook = _log_unraisable
        if not getattr(sys.excepthook, "_swarm", False):
            sys.excepthook = _quiet_resource_sharer(sys.excepthook)
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # hivemind leaves pending tasks at exit
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "INFO" if verbose else "WARNING")
    try:
        import hivemind.utils.logging as hivemind_logging

        hivemind_logging.get_logger("hivemind").setLevel(logging.INFO if verbose else logging.WARNING)
        handler = hivemind_logging._default_handler
        if (
            handler is not None
            and not verbose
            and not any(isinstance(f, OneLineErrors) for f in handler.filters)
        ):
            handler.addFilter(OneLineErrors())
    except ImportError:
        pass


def _log_unraisable(unraisable: sys.UnraisableHookArgs) -> None:
    """Errors Python ignores anyway (in __del__ of hivemind objects after shutdown) as one debug line."""
    logging.getLogger("swarm.cleanup").debug(
        "Ignored %s in %r: %s", type(unraisable.exc_value).__name__, unraisable.object, unraisable.exc_value
    )


def _quiet_resource_sharer(default):
    """An excepthook that logs, at DEBUG, the errors of multiprocessing's resource-sharer thread when the
    process at the other end exited mid-handshake (a DHT or averager process stopped at shutdown), and
    passes everything else to ``default``. That thread reports through sys.excepthook, so without this a
    clean Ctrl-C could end in a ConnectionResetError traceback."""

    def hook(exc_type, exc, tb):
        frames = traceback.extract_tb(tb)
        from_sharer = any(f.filename.endswith("resource_sharer.py") for f in frames)
        if issubclass(exc_type, (EOFError, OSError)) and from_sharer:
            logging.getLogger("swarm.cleanup").debug("A helper process left mid-handshake: %r", exc)
            return
        default(exc_type, exc, tb)

    hook._swarm = True  # type: ignore[attr-defined]
    return hook


class OneLineErrors(logging.Filter):
    """Fold a library's exception tracebacks into one line (run with --verbose to see them in full), and leave
    out the p2p daemon's error at its own exit.

    hivemind logs expected network events (a peer left mid-round) with full tracebacks; to a user that
    reads like a crash of their own peer."""

    EXPECTED = (
        "AllreduceException",
        "MatchmakingException",
        "CancelledError",
        "TimeoutError",
        "GeneratorExit",
    )

    # the p2p daemon's listener closed as the daemon exits (Ctrl-C reaches it with its peer): p2pd logs it as
    # an error ("error accepting connection: accept unix ...: use of closed network connection")
    CLOSED_LISTENER = "use of closed network connection"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and self.CLOSED_LISTENER in record.getMessage():
            return False
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            expected = any(cls.__name__ in self.EXPECTED for cls in type(exc).__mro__)  # subclasses too
            if record.levelno >= logging.ERROR and expected:
                # an averaging round that found no group or lost a peer: the swarm goes on (the strategy logs
                # what the step used instead), so this is a warning, not an error of this peer
                record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = f"{record.getMessage()} ({type(exc).__name__}: {exc})"
            record.args = ()
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_libraries() -> None:
    """Keep Lightning's start-up banner and known-harmless warnings out of the peer's log."""
    for name in ("aiobotocore", "botocore", "s3fs", "tensorboard"):  # "Found credentials ..." and the like
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        logger.propagate = True
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
    warnings.filterwarnings("ignore", message=".*torch.jit.script.*")
    warnings.filterwarnings("ignore", message=".*no `val_dataloader`.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*all_gather is deprecated.*")  # Lightning 2.6 on torch 2.15
    warnings.filterwarnings("ignore", category=FutureWarning, module="timm")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*is deprecated.*", module="hivemind")
