# The two commands of the README: `make demo` (the main job) and `make test` (the suite).
# Both install everything they need into .venv first; nothing is assumed on the machine.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_A := sample_traces/demo/reference
DEMO_B := sample_traces/demo/suspect
PORT ?= 8000

.PHONY: demo test install chromium bench

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned: pip takes the CPU wheel; an unpinned torch pulls a multi-GB CUDA build.
	# The installed files are byte-compiled on every core (pip compiles them one by one: 78 s against 27 + 27 s
	# here); a file that does not compile (a test fixture inside a package) is skipped, as pip skips it
	$(PY) -m pip install -q --no-compile 'torch==2.13.0' -e '.[dev]'
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $(STAMP)

install: $(STAMP)

# Debian's Chromium for the browser tests (Playwright drives it; no browser download).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || { echo "could not install chromium (needs root and Debian's apt); browser tests will be skipped"; }; }

demo: $(STAMP)
	@test -f $(DEMO_A)/manifest.json -a -f $(DEMO_B)/manifest.json || $(PY) -m bitguard.sample_traces.scenarios demo --out sample_traces/demo
	@# exit 1 means "diverged", which is what the demo pair shows; 2 (bad input) stops here
	$(PY) -m bitguard compare $(DEMO_A) $(DEMO_B) || test $$? -eq 1
	$(PY) -m bitguard serve --port $(PORT) --demo $(DEMO_A) $(DEMO_B)

# three pytest workers on two cores: most tests run one single-threaded process at a time and many
# wait (servers, subprocesses); with two the cores were 30% idle (TEST_WORKERS=0 runs them in the one pytest process, as before); files go out longest
# first (tests/conftest.py), which xdist keeps only without its own reorder by number of tests
TEST_WORKERS ?= 3

test: $(STAMP) chromium
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

bench: $(STAMP)
	$(PY) benchmarks/bench_digest.py
	$(PY) benchmarks/bench_recording.py
	$(PY) benchmarks/bench_alignment.py
