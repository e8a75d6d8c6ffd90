"""The pytest plugin that runs hivemind's own tests with swarm trainer's changes: ``-p tests.upstream.plugin``
(tests/upstream/run.py passes it).

At ``pytest_configure``, before hivemind's test modules are imported, it

- runs ``swarm.patches.install()`` (the robust reducer with hivemind's mean as its rule) and checks that every
  attribute it replaced is now swarm's (its module is in ``swarm.patches``), and lists them in the report's
  header. hivemind's tests each run in a process of
  their own (``@pytest.mark.forked``), which forks the averagers' processes: all of them inherit the
  patched classes;
- puts the classes that the swarm builds instead of hivemind's (:func:`_classes`: the gradient averager of
  swarm/patches/grad_averager.py, the state averager of swarm/patches/state_averager.py, ``SwarmDHT``)
  where hivemind's tests and ``hivemind.Optimizer`` look hivemind's up, so that those tests build ours.

Every test checks again, in its own process, that all of this is in place. And the session fails if a test
of :data:`MUST_AVERAGE` passed without a byte sent through the all-reduce runner of the ``traffic`` patch,
which only the averagers' processes run (its counters are shared memory made here, inherited through both
forks): a run in which the averagers silently ran without the patches cannot pass.

Tests named in ``EXCLUDED`` of tests/upstream/exclusions.py are deselected, and listed with their reasons;
those in its ``RUN_DESPITE_SKIP`` run although hivemind marks them skipped. With
``--swarm-patches=none`` nothing is installed: plain hivemind, to tell whether a failure is ours
(``python -m tests.upstream.run --plain``). ``--swarm-record PATH`` writes what was installed, the outcome
and the bytes of each test, and the exclusions, as JSON.
"""

from __future__ import annotations

import gc
import importlib
import json
import marshal
import os
import signal
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from tests.upstream.exclusions import EXCLUDED, RUN_DESPITE_SKIP

PIDS_ENV = "SWARM_UPSTREAM_PIDS"  # where the runner wants the PIDs of the run's processes (run.py)


def _classes() -> list[tuple[str, str, Any]]:
    """(module, attribute, swarm's class) for each class the swarm builds in place of hivemind's."""
    from hivemind.optim.grad_averager import GradientAverager
    from hivemind.optim.power_sgd_averager import PowerSGDGradientAverager
    from hivemind.optim.state_averager import TrainingStateAverager

    from swarm.patches.dht import SwarmDHT
    from swarm.patches.grad_averager import keeping_local_gradients
    from swarm.patches.state_averager import state_averager_class

    grad = keeping_local_gradients(GradientAverager)
    return [
        # swarm/averaging/strategy.py: hivemind.Optimizer's gradient averager (items 2, 3, 11, 16); the
        # Optimizer builds GradientAverager when given no factory (optim/optimizer.py:302)
        ("hivemind.optim.grad_averager", "GradientAverager", grad),
        ("hivemind.optim.optimizer", "GradientAverager", grad),
        # the same for compression "powersgd"
        (
            "hivemind.optim.power_sgd_averager",
            "PowerSGDGradientAverager",
            keeping_local_gradients(PowerSGDGradientAverager),
        ),
        # the state averager that install() makes hivemind.Optimizer build, for the tests that build one
        # themselves (tests/test_optimizer.py imports it from here)
        (
            "hivemind.optim.state_averager",
            "TrainingStateAverager",
            state_averager_class(TrainingStateAverager),
        ),
        # swarm/net/node.py: every DHT of the swarm
        ("hivemind", "DHT", SwarmDHT),
        ("hivemind.dht", "DHT", SwarmDHT),
    ]


_bindings: list[tuple[str, str, Any]] = []  # _classes(), built once (before they replace hivemind's)
_saved: list[tuple[Any, str, Any]] = []  # (module, attribute, hivemind's class) of each binding
_state: dict[str, Any] = {"mode": "none", "patches": [], "classes": [], "tests_that_average": 0}


def _origin(value: Any) -> str:
    """The module a replacement comes from (a function, a classmethod or a class)."""
    return getattr(getattr(value, "__func__", value), "__module__", "") or ""


def _replaced() -> list[tuple[str, Any, str, Any]]:
    """(patch name, owner, attribute, hivemind's own value) of every process-wide replacement."""
    from swarm.patches import process_wide

    out = []
    for patch in process_wide():
        assert patch.installed, f"swarm patch {patch.name!r} is not installed"
        for owner, name, original in patch._saved or ():
            out.append((patch.name, owner, name, original))
    return out


def check_active() -> None:
    """Fail unless every process-wide patch and every class of :func:`_classes` is in place."""
    from hivemind.averaging import averager
    from hivemind.averaging.allreduce import AllReduceRunner

    replaced = _replaced()
    assert replaced, "swarm.patches.install() replaced nothing"
    for name, owner, attribute, original in replaced:
        now = owner.__dict__.get(attribute)
        assert now is not original and _origin(now).startswith("swarm.patches"), (
            f"patch {name!r}: {owner.__name__}.{attribute} is hivemind's own, not swarm's"
        )
    # the two that matter most here, spelled out
    assert _origin(AllReduceRunner.__dict__["_communicate_with_peer"]) == "swarm.patches.allreduce"
    assert _origin(averager.AllReduceRunner) == "swarm.patches.traffic"
    for module, attribute, cls in _bindings:
        now = getattr(importlib.import_module(module), attribute)
        assert now is cls, f"{module}.{attribute} is not swarm's class but {now}"


def _fix_pytest_forked() -> None:
    """pytest-forked sends each report from the forked test process with ``marshal``; pytest 9.2 added a
    ``NodeId`` object (``_id``) to the reports, which marshal refuses, so every forked test "EXITED with
    status 3". Send it as the ``nodeid`` string, as pytest's own report serialization does
    (_pytest/reports.py, ``_report_to_json``)."""
    import pytest_forked

    serialize = pytest_forked.serialize_report
    if getattr(serialize, "_swarm_fixed", False):
        return

    def serialize_report(rep: Any) -> dict:
        d = serialize(rep)
        if "_id" in d:
            d["nodeid"] = str(d.pop("_id"))
        for key, value in list(d.items()):  # anything else marshal refuses travels as text
            try:
                marshal.dumps(value)
            except ValueError:
                d[key] = str(value)
        return d

    serialize_report._swarm_fixed = True  # type: ignore[attr-defined]
    pytest_forked.serialize_report = serialize_report


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("swarm", "hivemind's tests with swarm trainer's changes")
    group.addoption(
        "--swarm-patches",
        choices=("all", "none"),
        default="all",
        help="all: swarm.patches.install() and swarm's classes (default); none: plain hivemind, to compare",
    )
    group.addoption("--swarm-record", default=None, help="write what was installed and excluded (JSON) here")


def _note_pid(path: str) -> None:
    """Append this process's PID to ``path`` (one write of one line: appends of many processes do not mix)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)


def pytest_configure(config: pytest.Config) -> None:
    _fix_pytest_forked()
    _state["main_pid"] = os.getpid()
    pids = os.environ.get(PIDS_ENV)
    if pids:  # every process of the run, forked ones too, for the runner's clean-up of /dev/shm
        _note_pid(pids)
        os.register_at_fork(after_in_child=lambda: _note_pid(pids))
    if config.getoption("--swarm-patches") == "none":
        _state["mode"] = "none"
        return
    import swarm.patches
    from swarm.patches import robust

    swarm.patches.install()
    # the robust reducer stays installed (its buffering, sender failures and bans run under hivemind's tests),
    # reducing with hivemind's weighted mean: hivemind's tests assert that mean for unrelated random tensors
    # and unequal weights, which the robust rule by design does not give (tests/patches/test_robust.py)
    robust.use("mean")
    _bindings[:] = _classes()
    for module, attribute, cls in _bindings:
        owner = importlib.import_module(module)
        _saved.append((owner, attribute, owner.__dict__[attribute]))
        setattr(owner, attribute, cls)
    check_active()
    _state["mode"] = "all"
    _state["patches"] = [
        f"{name}: {owner.__module__}.{owner.__name__}.{attribute}"
        if isinstance(owner, type)
        else f"{name}: {owner.__name__}.{attribute}"
        for name, owner, attribute, _ in _replaced()
    ]
    _state["classes"] = [f"{mod}.{name} = {_origin(cls)}.{cls.__name__}" for mod, name, cls in _bindings]


def pytest_unconfigure(config: pytest.Config) -> None:
    if _state["mode"] != "all":
        return
    import swarm.patches

    while _saved:
        owner, attribute, value = _saved.pop()
        setattr(owner, attribute, value)
    swarm.patches.uninstall()


def pytest_report_header(config: pytest.Config) -> list[str]:
    if _state["mode"] != "all":
        return ["swarm patches: NONE (--swarm-patches=none): plain hivemind"]
    return (
        [f"swarm patches installed ({len(_state['patches'])} attributes):"]
        + [f"  {line}" for line in _state["patches"]]
        + ["swarm classes in hivemind's place:"]
        + [f"  {line}" for line in _state["classes"]]
    )


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect anything: the checks need the whole collection
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    whole = set()  # the files collected whole (not single tests of them): there, every name must be found
    for arg in config.args:
        with suppress(ValueError):
            whole.add(Path(arg).resolve().relative_to(config.rootpath).as_posix())
    excluded = [item for item in items if item.nodeid in EXCLUDED]
    stale = {nodeid for nodeid in EXCLUDED if nodeid.split("::")[0] in whole} - {i.nodeid for i in excluded}
    unskipped = []
    for prefix in RUN_DESPITE_SKIP:
        matched = [item for item in items if item.nodeid.split("[")[0] == prefix]
        if prefix.split("::")[0] in whole and not matched:
            stale.add(prefix)
        if not all(item.get_closest_marker("skip") for item in matched):
            stale.add(prefix)
        for item in matched:
            item.own_markers = [mark for mark in item.own_markers if mark.name != "skip"]
            unskipped.append(item.nodeid)
    if stale:
        raise pytest.UsageError(
            f"tests/upstream/exclusions.py names tests that are gone (or no longer skipped): {sorted(stale)}"
        )
    if excluded:
        config.hook.pytest_deselected(items=excluded)
        items[:] = [item for item in items if item.nodeid not in EXCLUDED]
    _state["excluded"] = {item.nodeid: EXCLUDED[item.nodeid] for item in excluded}
    _state["run_despite_skip"] = unskipped


@pytest.fixture(autouse=True)
def _swarm_patches_active() -> None:
    """Runs in each test's own process (forked): the patches are there, as the averagers it forks get them."""
    if _state["mode"] == "all":
        check_active()


# tests that pass only after all-reduce rounds among their averagers, whose rounds run the AllReduceRunner
# that swarm.patches.traffic puts into averaging/averager.py: each must show bytes counted by it
MUST_AVERAGE = (
    "tests/test_averaging.py::test_allreduce_once",
    "tests/test_averaging.py::test_allreduce_weighted",
    "tests/test_averaging.py::test_allreduce_grid",
    "tests/test_optimizer.py::test_grad_averager[",
    "tests/test_optimizer.py::test_state_averager",
    "tests/test_allreduce_fault_tolerance.py::test_fault_tolerance",
    "tests/test_compression.py::test_allreduce_compression",
    "tests/test_compression.py::test_adaptive_compression",
)


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    from swarm.patches import traffic

    _state.setdefault("bytes_at_start", {})[nodeid] = traffic.bytes_sent()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In pytest's own process, once the (forked) test's process and its averagers have ended."""
    from swarm.patches import traffic

    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "xfailed" if report.skipped and hasattr(report, "wasxfail") else report.outcome
        outcome = "xpassed" if report.passed and hasattr(report, "wasxfail") else outcome
        _state.setdefault("outcomes", {})[report.nodeid] = outcome
    if report.when != "call":
        return
    sent = traffic.bytes_sent() - _state.get("bytes_at_start", {}).get(report.nodeid, 0.0)
    _state.setdefault("bytes_by_test", {})[report.nodeid] = sent
    if report.passed and report.nodeid.startswith(MUST_AVERAGE):
        _state["tests_that_average"] += 1
        if _state["mode"] == "all" and not sent:
            _state.setdefault("unpatched", []).append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from swarm.patches import traffic

    _state["bytes_sent"] = traffic.bytes_sent()
    if _state.get("unpatched"):
        _state["error"] = (
            "these tests averaged, yet no byte went through swarm.patches.traffic's all-reduce runner (their "
            f"averagers ran without swarm's patches): {_state['unpatched']}"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    record = session.config.getoption("--swarm-record")
    if record:
        Path(record).write_text(json.dumps(_state, indent=1, default=str))
    _cleanup_children()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    write = terminalreporter.write_line
    excluded = _state.get("excluded", {})
    if excluded:
        terminalreporter.section("excluded (tests/upstream/exclusions.py)")
        for reason in dict.fromkeys(excluded.values()):
            nodeids = [nodeid for nodeid, why in excluded.items() if why == reason]
            write(f"{len(nodeids)} tests, {reason}:")
            for nodeid in nodeids:
                write(f"  {nodeid}")
    if _state.get("run_despite_skip"):
        write(f"run although hivemind skips them (exclusions.py): {len(_state['run_despite_skip'])} tests")
    terminalreporter.section("swarm patches")
    if _state["mode"] == "all":
        patches, classes = len(_state["patches"]), len(_state["classes"])
        write(
            f"{patches} patched attributes and {classes} class bindings active in every test; "
            f"{_state.get('bytes_sent', 0):.0f} bytes sent through swarm's all-reduce runner in the "
            f"averagers' processes; {_state['tests_that_average']} passed tests that must average did"
            + (f", except {len(_state['unpatched'])}" if _state.get("unpatched") else "")
        )
    else:
        write("NONE: plain hivemind (--swarm-patches=none)")
    if "error" in _state:
        write(f"ERROR: {_state['error']}", red=True, bold=True)


def _stat(pid: int) -> str | None:
    """A live process's start time (clock ticks since boot, /proc/<pid>/stat field 22); None once it ended
    (a zombie included)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return None if fields[0] in "ZX" else fields[19]


def _end_descendants(grace: float) -> int:
    """SIGTERM every process below this one (all at once: a child whose parent died first would be orphaned
    out of reach), SIGKILL those left after ``grace`` seconds; returns how many there were."""
    from swarm.procs import descendants  # live ones: zombies (ended, not yet reaped) are not listed

    started = {pid: _stat(pid) for pid in descendants(os.getpid())}
    for pid in started:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

    def alive() -> list[int]:  # the same processes (not reused PIDs), and not zombies
        return [pid for pid, t in started.items() if t is not None and _stat(pid) == t]

    deadline = time.monotonic() + grace
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in alive():
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(started)


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: Any) -> Any:
    """A forked test's process ends with ``os._exit`` (pytest-forked), which skips multiprocessing's exit
    handler that would have terminated its daemon processes: the DHTs, averagers and p2p daemons it started
    would keep running (about 4 per test, 200 in a run), taking CPU from the tests after it. hivemind's own
    tests/conftest.py (not in its sdist) ends them only when the session ends. Ended here, once the test and
    its teardown are done."""
    yield
    if _state.get("main_pid") not in (None, os.getpid()):
        _end_descendants(grace=3.0)


def _cleanup_children() -> None:
    """What is still running below pytest when the session ends (tests/upstream/run.py also stops pytest's
    whole process group, which holds any orphans)."""
    gc.collect()
    _end_descendants(grace=2.0)
