"""The one log format's guards: against shutdown noise from multiprocessing's resource-sharer thread, and
against forked helpers that hang on their first log line."""

from __future__ import annotations

import multiprocessing.resource_sharer as resource_sharer
import subprocess
import sys
import textwrap

from swarm.log import _quiet_resource_sharer


def _raise_in(filename: str, exc: BaseException):
    """Raise ``exc`` from a frame whose file name is ``filename`` (as the sharer's thread would)."""
    code = compile("def fail(exc):\n    raise exc\n", filename, "exec")
    namespace: dict = {}
    exec(code, namespace)
    try:
        namespace["fail"](exc)
    except BaseException:
        return sys.exc_info()


def test_resource_sharer_resets_are_quiet_and_everything_else_is_not():
    seen = []
    hook = _quiet_resource_sharer(lambda *info: seen.append(info[0]))
    hook(*_raise_in(resource_sharer.__file__, ConnectionResetError(104, "Connection reset by peer")))
    hook(*_raise_in(resource_sharer.__file__, EOFError()))
    assert seen == [], "a helper that left mid-handshake is not an error the user must see"
    hook(*_raise_in(__file__, ConnectionResetError(104, "reset elsewhere")))
    hook(*_raise_in(resource_sharer.__file__, ValueError("a real bug")))
    assert seen == [ConnectionResetError, ValueError]


# A parent whose thread keeps logging through a slow stream while the main thread forks children (as hivemind
# forks its averagers); each child logs one line and exits. It prints how many children hung on that line;
# with "first" as its third argument it stops at the first child that hung.
_FORKS = textwrap.dedent(
    """
    import io, logging, multiprocessing, sys, threading, time
    if sys.argv[1] == "swarm":
        import swarm  # noqa: F401  (importing swarm makes forks wait for the log handlers)

    class SlowRaw(io.RawIOBase):
        def writable(self):
            return True

        def write(self, data):
            time.sleep(0.002)  # a terminal or pipe that takes its time: the buffer's lock is held meanwhile
            return len(data)

    stream = io.TextIOWrapper(io.BufferedWriter(SlowRaw(), buffer_size=64), write_through=True)
    log = logging.getLogger("forks")
    log.addHandler(logging.StreamHandler(stream))
    log.propagate, log.level = False, logging.INFO
    done = threading.Event()

    def chatter():
        while not done.is_set():
            log.info("x" * 200)

    def child():
        log.info("a forked helper starts")
        log.handlers[0].flush()

    threading.Thread(target=chatter, daemon=True).start()
    hung = 0
    for _ in range(int(sys.argv[2])):
        time.sleep(0.01)
        proc = multiprocessing.get_context("fork").Process(target=child)
        proc.start()
        proc.join(3)
        if proc.is_alive():
            hung += 1
            proc.kill()
            proc.join()
            if sys.argv[3:] == ["first"]:
                break
    done.set()
    print(hung)
    """
)


def _hung_forks(mode: str, forks: int, *until: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _FORKS, mode, str(forks), *until], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_a_helper_forked_while_another_thread_logs_does_not_hang_on_its_first_line():
    # without swarm's at-fork hook Python re-creates the handler's lock in the child but not the stream
    # buffer's, which the chatting thread held at the fork
    assert _hung_forks("plain", 3, "first") >= 1, "the plain run should show the hang that swarm prevents"
    assert _hung_forks("swarm", 20) == 0


# A thread holds the lock that concurrent.futures' before-fork hook takes (ThreadPoolExecutor.submit holds
# it) and logs while the main thread forks: the hooks run in reverse order of registration, so swarm's
# first, then this script's (it tells the thread to log), then concurrent.futures'. The child logs a line.
_LOCKED_FORK = textwrap.dedent(
    """
    import concurrent.futures.thread as futures_thread
    import logging, os, sys, threading, time

    began = threading.Event()
    os.register_at_fork(before=began.set)
    import swarm  # noqa: F401
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    log = logging.getLogger("locked")

    def submitting():
        with futures_thread._global_shutdown_lock:
            began.wait(60)
            log.info("logged while holding the executors' lock")

    thread = threading.Thread(target=submitting)
    thread.start()
    while not futures_thread._global_shutdown_lock.locked():
        time.sleep(0.001)
    pid = os.fork()
    if pid == 0:
        log.info("the child logs")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    thread.join()
    print("child exit", os.waitstatus_to_exitcode(status), flush=True)
    """
)


def test_a_fork_while_a_thread_that_holds_another_fork_hooks_lock_logs_does_not_deadlock():
    """Before, a fork held every log handler's lock across the other before-fork hooks: a thread that held
    concurrent.futures' shutdown lock (inside ``ThreadPoolExecutor.submit``, as hivemind's progress tracker
    does) and logged there waited for the fork's handler lock, while the fork waited for its lock (seen: a
    test worker hung for 8 minutes building a hivemind.Optimizer). Now the thread waits at most 2 s at the
    gate, writes its line, and the fork goes on."""
    out = subprocess.run([sys.executable, "-c", _LOCKED_FORK], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines == ["logged while holding the executors' lock", "the child logs", "child exit 0"], lines


def test_the_p2p_daemons_error_at_its_own_exit_is_left_out_and_other_errors_are_not():
    """p2pd logs its listener's closing as an ERROR when Ctrl-C reaches it with its peer (hivemind forwards
    it, p2p/p2p_daemon.py ``_log_p2pd_message``): to a user that reads like a crash, so the peer's console
    leaves it out. Any other error stays."""
    import logging

    from swarm.log import OneLineErrors

    def record(message: str, level: int = logging.ERROR) -> logging.LogRecord:
        return logging.LogRecord("hivemind.p2p.p2p_daemon", level, "daemon.go", 198, message, (), None)

    closed = "error accepting connection: accept unix /tmp/p2pd.sock: use of closed network connection"
    assert OneLineErrors().filter(record(closed)) is False
    assert OneLineErrors().filter(record("failed to dial: connection refused")) is True
    assert OneLineErrors().filter(record(closed, logging.DEBUG)) is True  # only the error level is left out
