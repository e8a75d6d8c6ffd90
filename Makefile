# Two set-up commands, each works on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PEERS ?= 3

.PHONY: demo test test-slow test-upstream install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# the main job: a monitor and $(PEERS) training peers on 127.0.0.1, embedded data, nothing to download
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/swarm-peer demo --peers $(PEERS)

# pytest writes its JUnit report only when the session ends normally: a test that ended the whole session
# early (os._exit in a command run in-process) would otherwise look like a pass
REPORT := .pytest-report.xml

# two workers: one runs the tests that start peers as processes, one after another; the other the in-process
# tests, which mostly wait (tests/conftest.py, pytest_xdist_make_scheduler). A third worker on two cores made a
# test of matchmaking's read pacing miss its 0.125 s bound (0.152 s)
test: $(STAMP)
	rm -f $(REPORT)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow and not plain" --durations=15 --junitxml=$(REPORT)
	@test -s $(REPORT) || { echo "pytest stopped before its summary: a test ended the session early"; exit 1; }

# the longer fault and benchmark runs (peers killed at three moments, the entry peer's death, churn, an
# attacker, a groupmate that never learnt of its group, a killed FSDP rank, the wan bench) and the scenarios
# of tests/patches on hivemind without the patches (marked `plain`: each shows the failure that its patch
# mends, on the pinned hivemind release): about 17 minutes; then hivemind's own tests with our patches
# (test-upstream)
test-slow: $(STAMP)
	rm -f $(REPORT)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -s -m "slow or plain" --junitxml=$(REPORT)
	@test -s $(REPORT) || { echo "pytest stopped before its summary: a test ended the session early"; exit 1; }
	$(MAKE) test-upstream

# hivemind's own tests of the averager, the all-reduce and the optimizer, with swarm.patches installed
# (tests/upstream/: downloads hivemind's sdist from PyPI into .cache/ once): 6 to 10 minutes
test-upstream: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m tests.upstream.run

clean:
	rm -rf $(VENV) runs *.egg-info
