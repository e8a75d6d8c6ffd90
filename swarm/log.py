"""One log format for every role, and quieter third-party loggers."""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
import warnings

FORMAT = "%(asctime)s %(levelname).1s %(name)s | %(message)s"

_FORK_WAIT_S = 2.0  # longest that a fork waits for a thread inside a log handler, and a thread for a fork
_gate = threading.Condition()
_inside = 0  # threads inside a log handler
_forking: int | None = None  # the thread that is forking, while it forks
_registered = False


def fork_safe_logging() -> None:
    """Make a fork wait until no other thread is inside a log handler, and keep the other threads out of the
    handlers until the fork is done. Idempotent; ``swarm`` calls it when imported.

    hivemind starts every averager (and the DHT) as a forked ``multiprocessing.Process`` while the parent's
    threads go on logging. Python re-creates each handler's lock in the child, but not the lock of the
    stream's buffer: a fork while another thread was inside ``stream.write`` leaves the child's buffer locked
    by a thread that does not exist there, and the child's first log line (hivemind's averagers log at
    start-up) blocks for ever.

    No lock is held across the fork: a thread that logs while a fork is under way waits for it at a gate,
    for at most ``_FORK_WAIT_S``, then goes on. Holding every handler's lock across the fork, as this did
    before, could deadlock: a thread inside ``ThreadPoolExecutor.submit`` holds the lock that
    concurrent.futures' own before-fork hook takes, and it logged there (from a finalizer that garbage
    collection ran) while the fork held its handler's lock. Such a thread now writes after its wait, and
    the fork, which needs its lock, comes only after. A thread that stays inside a handler longer than
    ``_FORK_WAIT_S`` is not waited for further."""
    global _registered
    if _registered or not hasattr(os, "register_at_fork"):
        return
    _registered = True
    original = logging.Handler.handle

    def handle(self: logging.Handler, record: logging.LogRecord):  # type: ignore[no-untyped-def]
        global _inside
        with _gate:
            if _forking is not None and _forking != threading.get_ident():
                _gate.wait_for(lambda: _forking is None, timeout=_FORK_WAIT_S)
            _inside += 1
        try:
            return original(self, record)
        finally:
            with _gate:
                _inside -= 1
                if _forking is not None and not _inside:  # only a fork waits for the handlers to empty
                    _gate.notify_all()

    logging.Handler.handle = handle  # type: ignore[method-assign]
    os.register_at_fork(before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child)


def _before_fork() -> None:
    global _forking
    with _gate:
        _forking = threading.get_ident()
        _gate.wait_for(lambda: not _inside, timeout=_FORK_WAIT_S)


def _after_in_parent() -> None:
    global _forking
    with _gate:
        _forking = None
        _gate.notify_all()


def _after_in_child() -> None:
    # the only thread left is the one that forked
    global _gate, _inside, _forking
    _gate, _inside, _forking = threading.Condition(), 0, None


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
