"""Typed stubs for ``session_gate._native``, the Rust extension (PyO3, built by maturin).

* the engine half's native parts (``src/python/engine.rs``): ``ProbeEngine`` and the hashing
  helpers, used inside vLLM's engine core by ``session_gate.engine``;
* the knob table (``src/python/knobs.rs``): ``GateConfig``, ``knobs()`` and ``knob_from_env``;
* the gate core (``src/python/gate_core.rs``): ``GateCore`` and the actions its ``poll``
  returns, driven by ``session_gate.gate.SessionGate``; the engine gate's book
  (``src/python/engine_book.rs``): ``EngineGateBook``;
* the twin and the baselines (``SimReplica``, ``simulate_rl_steps``, ``AimdController``, ...).

Every function turns a Rust panic into ``RuntimeError``; invalid input raises ``ValueError``.
"""

from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, TypeAlias, TypedDict, final

__all__ = [
    "__version__",
    "Admit",
    "AimdController",
    "GateConfig",
    "GateCore",
    "PauseController",
    "Preempted",
    "ProbeEngine",
    "ProbePrefix",
    "ProbeUsage",
    "SimKvManager",
    "SCHEDULER_MAX_WAIT_SEC",
    "SchedulerLook",
    "SessionInference",
    "SimReplica",
    "Wait",
    "count_cached_free_blocks",
    "hash_block",
    "hash_blocks",
    "hash_chain_tip",
    "knob_from_env",
    "knobs",
    "sim_profile_names",
    "sim_profile_step_times",
    "sim_profile_text",
    "sim_step_features",
    "simulate_rl_steps",
    "validate_prompt",
    "prompt_length",
]

__version__: Final[str]

#: A prompt: a list/tuple of ints, or packed little-endian uint32 bytes.
_TokenIds: TypeAlias = Sequence[int] | bytes | bytearray

# --------------------------------------------------------------------------- engine half

@final
class ProbeEngine:
    """Residency probe bound to one engine's hashing configuration."""

    def __new__(
        cls,
        hash_algo: str,
        none_hash: bytes,
        block_size: int,
        vocab_size: int,
        max_model_len: int,
        chain_cache_bytes: int,
        group_id: int = 0,
        block_type: type | None = None,
    ) -> ProbeEngine:
        """``block_type``: vLLM's ``KVCacheBlock`` class. With it, session probes keep what each
        lookup found (the block and its hash object) and re-check it by identity next time."""
    def probe(
        self, cached_map: dict[bytes, object], session_id: str | None, token_ids: _TokenIds
    ) -> tuple[int, int, int, int, int, int]:
        """Longest resident prefix of ``token_ids`` in ``cached_map`` (vLLM's
        ``BlockHashToBlockMap._cache``): ``(hit_blocks, hit_tokens, prompt_tokens,
        blocks_hashed, blocks_reused, blocks_rechecked)``. ``session_id=None`` does not
        remember the chain."""
    def probe_tiered(
        self,
        cached_map: dict[bytes, object],
        tier_chunks: dict[bytes, object],
        blocks_per_chunk: int,
        session_id: str | None,
        token_ids: _TokenIds,
    ) -> tuple[int, int, int, int, int, int, int, int]:
        """:meth:`probe`, then the host KV tier: ``tier_chunks`` is the offloading manager's
        cache-policy dict of chunks (``LRUCachePolicy.chunks``, read only). Returns the probe's
        tuple followed by ``(offloaded_tokens, tier_blocks_hashed)``: the tokens after the GPU
        hit vLLM's offloading connector would load, and the blocks the tier walk hashed."""
    def forget(self, session_id: str) -> bool:
        """Drops a session's remembered hash chain; whether one was held."""
    @property
    def chain_cache_bytes(self) -> int: ...
    @property
    def chain_cache_sessions(self) -> int: ...
    @property
    def hash_algo(self) -> str: ...
    @property
    def witnesses(self) -> bool:
        """Whether session probes keep witnesses (a ``block_type`` with a plain slot layout)."""

def count_cached_free_blocks(
    blocks: list[object], cached_block_hashes_by_block: dict[int, object]
) -> int:
    """Cached blocks whose ref count is 0 (free but still holding a prefix)."""

def hash_block(
    hash_algo: str, none_hash: bytes, parent: bytes | None, token_ids: _TokenIds
) -> bytes:
    """vLLM's ``hash_block_tokens(hash_fn, parent, tokens, None)``, natively."""

def hash_blocks(
    hash_algo: str, none_hash: bytes, token_ids: _TokenIds, block_size: int
) -> list[bytes]:
    """The chained hashes of every full block of ``token_ids``."""

def hash_chain_tip(
    hash_algo: str, none_hash: bytes, token_ids: _TokenIds, block_size: int
) -> bytes | None:
    """The hash of the last full block of ``token_ids`` (``None`` if there is none): the
    hashing a full probe does, without a bytes object per block."""

def validate_prompt(token_ids: _TokenIds, vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list of ints, validated exactly as the native probe validates it."""

def prompt_length(token_ids: _TokenIds, vocab_size: int, max_model_len: int) -> int:
    """The prompt's length, validated as :func:`validate_prompt` validates it (no list built)."""

# --------------------------------------------------------------------------- gate

_PressureName = Literal["committed", "engine"]
_ReasonName = Literal[
    "open",
    "reserved_session",
    "prefix_probe_unavailable",
    "resident_prefix",
    "max_wait",
    "offloaded_prefix",
]
_ProbeKindName = Literal["usage", "prefix", "forget"]

class _Knob(TypedDict):
    name: str
    env: str
    default: float | int | str | None
    rule: str
    doc: str
    home: Literal["gate_config", "engine_core"]

def knobs() -> list[_Knob]:
    """Every row of the knob table (``src/gate/knobs.rs``): name, ``SESSION_GATE_*`` variable,
    default, rule in words, one-line doc, and ``home`` (``gate_config`` for a ``GateConfig``
    keyword, ``engine_core`` for a knob only the engine half reads)."""

#: ``max_wait_sec`` of the engine gate's scheduler mode when none is set (seconds).
SCHEDULER_MAX_WAIT_SEC: Final[float]

def knob_from_env(name: str) -> float | int | str | None:
    """The knob ``name`` from its ``SESSION_GATE_*`` variable (blank or unset: its default),
    checked by its rule. ``ValueError`` naming knob and value; ``KeyError`` for no such knob."""

@final
class GateConfig:
    """The gate's knobs, validated in Rust; immutable. Every keyword is a row of the knob table
    (``knobs()``), which also gives each one's rule and doc.

    Omitted knobs (or ``None``) keep their defaults: high_watermark 0.85, hit_threshold 0.8,
    wait_poll_sec 5, idle_grace_sec 60, pressure committed, max_wait_sec never (``None``),
    probe_timeout_sec 2, default_max_tokens 256 (the output tokens a turn's working set counts
    when ``admit``/``acquire`` get no ``max_tokens``), idle_engine_turns 4 (while the engine has
    nothing running or waiting, an idle room may yield after this many of its session's turn
    times; 0: never early). Invalid values raise ``ValueError`` naming
    the knob and the value; an unknown keyword raises ``TypeError``.
    """

    def __new__(
        cls,
        *,
        high_watermark: float | None = None,
        hit_threshold: float | None = None,
        wait_poll_sec: float | None = None,
        idle_grace_sec: float | None = None,
        pressure: _PressureName | str | None = None,
        max_wait_sec: float | None = None,
        probe_timeout_sec: float | None = None,
        default_max_tokens: int | None = None,
        idle_engine_turns: int | None = None,
    ) -> GateConfig: ...
    @staticmethod
    def from_env() -> GateConfig:
        """Defaults overridden by ``SESSION_GATE_HIGH_WATERMARK``, ``SESSION_GATE_HIT_THRESHOLD``,
        ``SESSION_GATE_WAIT_POLL_SEC``, ``SESSION_GATE_IDLE_GRACE_SEC``,
        ``SESSION_GATE_PRESSURE``, ``SESSION_GATE_MAX_WAIT_SEC`` (``none``/``off`` for no limit),
        ``SESSION_GATE_PROBE_TIMEOUT_SEC``, ``SESSION_GATE_DEFAULT_MAX_TOKENS`` and
        ``SESSION_GATE_IDLE_ENGINE_TURNS``."""
    @property
    def high_watermark(self) -> float: ...
    @property
    def hit_threshold(self) -> float: ...
    @property
    def wait_poll_sec(self) -> float: ...
    @property
    def idle_grace_sec(self) -> float: ...
    @property
    def pressure(self) -> _PressureName: ...
    @property
    def max_wait_sec(self) -> float | None: ...
    @property
    def probe_timeout_sec(self) -> float: ...
    @property
    def default_max_tokens(self) -> int: ...
    @property
    def idle_engine_turns(self) -> int: ...
    def to_dict(self) -> dict[str, float | str | None]: ...
    def __eq__(self, other: object, /) -> bool: ...

@final
class ProbeUsage:
    """_Action: call the probe's ``usage()``, then ``GateCore.on_usage``."""

@final
class ProbePrefix:
    """_Action: call the probe's ``prefix(session_id, prompt_ids)``, then ``GateCore.on_prefix``."""

@final
class Preempted:
    """_Action: a newer attempt of the same session took over; this attempt is over."""

@final
class Wait:
    """_Action: sleep until ``until`` (the core's clock) or until ``GateCore.epoch`` changes."""

    @property
    def until(self) -> float: ...

@final
class Admit:
    """_Action: admitted; lease ``lease`` exists until released."""

    @property
    def lease(self) -> int: ...
    @property
    def reason(self) -> _ReasonName: ...
    @property
    def wait_sec(self) -> float: ...
    @property
    def usage(self) -> float | None: ...
    @property
    def pressure(self) -> float | None: ...
    @property
    def hit_ratio(self) -> float | None: ...
    @property
    def retain_session(self) -> bool: ...
    @property
    def reserved(self) -> bool: ...
    @property
    def revoked(self) -> bool: ...
    @property
    def working_set_blocks(self) -> int | None: ...
    @property
    def num_preempted(self) -> int: ...

_Action: TypeAlias = ProbeUsage | ProbePrefix | Wait | Admit | Preempted

class _Histogram(TypedDict):
    count: int
    sum: float
    #: (upper bound, cumulative count); the last bound is ``inf``.
    buckets: list[tuple[float, int]]

class _ProbeHistogram(_Histogram):
    #: Calls that raised or timed out.
    failures: int

class _ProbeStatsByKind(TypedDict):
    usage: _ProbeHistogram
    prefix: _ProbeHistogram
    forget: _ProbeHistogram

class _AdmissionsByReason(TypedDict):
    open: int
    reserved_session: int
    prefix_probe_unavailable: int
    resident_prefix: int
    max_wait: int
    offloaded_prefix: int

class _GateStatsDict(TypedDict):
    """``GateCore.stats()``. Always: ``attempts == admissions_total + preemptions +
    cancellations + pending`` and ``admissions_total == leases_released +
    leases_dropped_unreleased + leases_active``."""

    admissions: _AdmissionsByReason
    admissions_total: int
    attempts: int
    revocations: int
    idle_engine_yields: int
    preemptions: int
    cancellations: int
    leases_released: int
    leases_dropped_unreleased: int
    grace_expired: int
    sessions_finished: int
    leases_active: int
    reservations_held: int
    reservations_idle: int
    committed_blocks: int
    pending: int
    waiting: int
    sessions: int
    wait_sec: _Histogram
    probes: _ProbeStatsByKind

@final
class EngineGateBook:
    """The engine gate's core and bookkeeping (attempts by ticket, leases by holder, clients by
    last call) for its driver in vLLM's engine core: one native call per utility call. Engine
    thread only. ``admit`` and ``release`` are what vLLM calls for the utility methods: they
    take the utility call's arguments and read the clock themselves (``time.monotonic``'s
    scale); the others take ``now`` (``time.monotonic()``). Bad input raises ``ValueError``
    starting with ``"invalid engine gate input"``."""

    def __new__(
        cls,
        config: GateConfig,
        lease_ttl_sec: float,
        block_pool: object,
        block_size: int,
        vocab_size: int,
        max_model_len: int,
        prefix: object,
        arm: object,
        future_cls: object,
        tier_usage: object | None = None,
        scheduler: object | None = None,
    ) -> EngineGateBook:
        """``tier_usage() -> (num_blocks, used_blocks) | None``: the host KV tier's capacity
        and use, read with every usage read when given; ``scheduler`` (vLLM's): its running
        and waiting requests are counted with every usage read when given."""
    def hold_in_queue(self, held: list[object]) -> None:
        """Containers of the requests scheduler mode holds in vLLM's waiting queue: their
        lengths are taken off the usage reads' waiting count."""
    @property
    def lease_ttl_sec(self) -> float: ...
    def admit(
        self,
        session_id: object,
        token_ids: object,
        max_tokens: object,
        retain_session: object = True,
        ticket: object = None,
        client_id: object = None,
    ) -> dict[str, object] | object:
        """The answer now (a dict with ``engine_us``), or a ``concurrent.futures.Future``."""
    def admit_trusted(
        self,
        session_id: object,
        token_ids: Sequence[int],
        max_tokens: object,
        ticket: object,
        client_id: object,
    ) -> dict[str, object] | object:
        """The scheduler mode's admit: ``token_ids`` is vLLM's own validated prompt list, of
        which only the length is read; the session is retained. Answers as :meth:`admit`."""
    def release(self, lease: object, client_id: object | None = None) -> bool: ...
    def cancel(self, ticket: object, client_id: object | None, now: float) -> bool: ...
    def finish(self, session_id: object, client_id: object | None, now: float) -> bool: ...
    def grow_lease(self, lease: int, ws_tokens: int) -> bool:
        """Grows the working set the held ``lease`` commits to ``ws_tokens`` (never shrinks);
        whether it grew."""
    def renew(self, client_id: object, now: float) -> tuple[int, int]:
        """``(leases, pending)`` the client holds."""
    def tick(self, now: float) -> list[tuple[str, float, int, int]]:
        """Clients declared dead: ``(client_id, silent_sec, leases, attempts)``."""
    def stats(self) -> dict[str, object]: ...
    def prometheus(self) -> str: ...
    def check_invariants(self) -> None: ...
    time_parts: bool
    """Whether ``admit`` and ``release`` time their parts (the lab's ``gate_splits``)."""
    def last_parts(self) -> list[tuple[str, int]]:
        """The last admit's or release's parts in ns (``args``, ``usage``, ``prefix``,
        ``answer``, ``book``, ``total``) while ``time_parts`` is on."""

@final
class GateCore:
    """The sans-IO admission state machine. It never reads a clock: every call takes ``now``
    (monotonic seconds). Use it from one thread (the driver's event loop)."""

    def __new__(cls, config: GateConfig | None = None) -> GateCore: ...
    @property
    def config(self) -> GateConfig: ...
    @property
    def epoch(self) -> int:
        """Increases whenever waiters should poll again."""
    def begin(
        self,
        session_id: str,
        prompt_tokens: int,
        max_tokens: int | None,
        retain_session: bool,
        now: float,
    ) -> int:
        """Starts an attempt; returns its id. Preempts the session's older pending attempt.
        ``max_tokens=None`` counts the config's ``default_max_tokens``."""
    def poll(self, attempt: int, now: float) -> _Action:
        """What to do next; ``LookupError`` once the attempt is over."""
    def on_usage(
        self,
        attempt: int,
        kv_cache_usage: float,
        num_blocks: int,
        num_free_blocks: int,
        num_cached_free_blocks: int | None,
        block_size: int,
        now: float,
        offload_num_blocks: int | None = None,
        offload_used_blocks: int | None = None,
        num_running_reqs: int | None = None,
        num_waiting_reqs: int | None = None,
    ) -> None:
        """The host tier's figures are ``None`` when the engine has no readable tier; the
        scheduler's request counts are ``None`` when the engine does not report them (then it
        never counts as idle)."""
    def on_usage_unavailable(self, attempt: int, reason: str, now: float) -> None: ...
    def on_prefix(
        self,
        attempt: int,
        hit_ratio: float,
        hit_blocks: int,
        hit_tokens: int,
        prompt_tokens: int,
        now: float,
        offloaded_tokens: int | None = None,
    ) -> None:
        """``offloaded_tokens`` is ``None`` when the engine has no readable host tier."""
    def on_prefix_unavailable(self, attempt: int, reason: str, now: float) -> None: ...
    def record_probe(self, kind: _ProbeKindName, secs: float, ok: bool) -> None: ...
    def cancel(self, attempt: int, now: float) -> bool:
        """Forgets a pending attempt (queue slot included); False if unknown."""
    def release(self, lease: int, now: float) -> bool:
        """Releases a lease; False (a no-op) if released already."""
    def release_dropped(self, lease: int, now: float) -> bool:
        """Releases a lease its holder dropped; counted in ``leases_dropped_unreleased``."""
    def finish_session(self, session_id: str, now: float) -> bool:
        """Ends the session's ownership window; whether there was one."""
    def expire(self, now: float) -> int:
        """Purges idle grace windows that ended by ``now``; how many."""
    def next_deadline(self) -> float | None: ...
    def num_preempted(self, session_id: str) -> int: ...
    def has_reservation(self, session_id: str) -> bool: ...
    def approx_bytes(self) -> int: ...
    def check_invariants(self) -> None:
        """Raises ``RuntimeError`` describing the first internal inconsistency."""
    def stats(self) -> _GateStatsDict: ...
    def prometheus(self) -> str: ...

# --------------------------------------------------------------------------- baselines

@final
class AimdController:
    """prime-rl's adaptive episode concurrency (``src/baselines/aimd.rs``). Knobs by keyword
    (published defaults otherwise); ``time_scale`` multiplies the time constants."""

    def __new__(cls, *, time_scale: float = 1.0, **knobs: float | int | None) -> AimdController: ...
    def submit(self, session_id: str) -> None:
        """Queues an episode to start; ``ValueError`` if already queued or in flight."""
    def admit(self, now: float) -> list[str]:
        """The queued episodes to start now (cap and admission meter permitting)."""
    def on_complete(self, now: float, session_id: str) -> None:
        """A natural completion (may grow the cap)."""
    def on_poll(
        self,
        now: float,
        *,
        kv_usage: float,
        running: int,
        waiting: int,
        preemptions_total: int,
        kv_capacity_tokens: int | None = None,
        max_model_len: int | None = None,
    ) -> list[str]:
        """One engine scrape; the episodes to cancel, youngest first."""
    @property
    def cap(self) -> float: ...
    @property
    def inflight(self) -> int: ...
    @property
    def queued(self) -> int: ...
    @property
    def poll_interval_sec(self) -> float: ...
    def stats(self) -> dict[str, float]: ...

@final
class PauseController:
    """ThunderAgent's tool-boundary pausing for one replica (``src/baselines/pause.rs``)."""

    def __new__(
        cls, capacity_tokens: int, *, time_scale: float = 1.0, **knobs: float | int
    ) -> PauseController: ...
    def before_request(self, now: float, session_id: str, prompt_tokens: int) -> str | None:
        """``None``: send the turn now; else why it is held (``paused``, ``queued``,
        ``admission_full``) until a tick resumes the session."""
    def after_request(self, now: float, session_id: str, total_tokens: int) -> bool:
        """The turn's response ended; whether the session was paused now."""
    def finish(self, session_id: str) -> bool: ...
    def tick(self, now: float) -> dict[str, list[str]]:
        """``resumed``, ``forced``, ``paused``, ``marked``, ``expired`` session ids."""
    def is_paused(self, session_id: str) -> bool: ...
    @property
    def used(self) -> int: ...
    @property
    def scheduler_interval_sec(self) -> float: ...
    @property
    def next_forced_resume(self) -> float | None: ...
    def stats(self) -> dict[str, int]: ...

# --------------------------------------------------------------------------- inference.rs

@final
class SessionInference:
    """Which session a request without a session id continues (``src/gate/infer.rs``): the idle
    session whose own blocks (past its last prompt) the request's prompt contains, else new."""

    def __new__(cls, max_idle: int = 65536) -> SessionInference: ...
    def arrive(
        self, prompt_hashes: Sequence[bytes | int]
    ) -> tuple[int, Literal["continued", "ambiguous", "new"]]: ...
    def finish(
        self, session: int, block_hashes: Sequence[bytes | int], prompt_blocks: int
    ) -> None: ...
    def stats(self) -> dict[str, int]:
        """``continued``, ``ambiguous``, ``new``, ``no_own_block``, ``forgotten``, ``idle``."""

# --------------------------------------------------------------------------- sched_look.rs

@final
class SchedulerLook:
    """The scheduler mode's look at a waiting request (``gate_scheduler``), native for the
    looks that decide nothing: vLLM's check (for its blocked statuses only), no id, decided, or
    held without an answer; every other look goes to ``ready``."""

    def __new__(
        cls,
        vllm_check: Callable[[Any], bool],
        plain: Sequence[Any],
        decided: dict[str, int | None],
        held: dict[str, Any],
        ready: Callable[[Any], bool],
        infer: bool,
    ) -> SchedulerLook: ...
    def look(self, request: Any) -> bool: ...

# --------------------------------------------------------------------------- twin (sim_pool.rs)

#: One scheduled request: (scheduled tokens, computed before, num_tokens, num_output_tokens).
_StepEntry: TypeAlias = tuple[int, int, int, int]

@final
class SimKvManager:
    """The twin's KV-cache manager (vLLM 0.32's ``KVCacheManager`` over one full-attention
    group), for the differential test against vLLM."""

    def __new__(cls, num_blocks: int, block_size: int, max_model_len: int) -> SimKvManager: ...
    def lookup(self, block_hashes: Sequence[int], num_tokens: int) -> list[int]:
        """Blocks of the longest prefix hit, capped at ``(num_tokens - 1) // block_size``."""
    def allocate(
        self,
        req_id: int,
        num_computed: int,
        num_new_tokens: int,
        hit: Sequence[int],
        num_tokens: int,
        block_hashes: Sequence[int],
        full_sequence_must_fit: bool,
    ) -> bool:
        """``allocate_slots``; False (nothing changed) when the blocks are not there."""
    def free(self, req_id: int) -> None:
        """Frees the request's blocks tail first; ``KeyError`` if unknown."""
    def req_blocks(self, req_id: int) -> list[int]: ...
    def free_queue(self) -> list[int]:
        """Free blocks, front (allocated next) to back."""
    def cached_map(self) -> list[tuple[int, int]]:
        """Sorted ``(hash, block)`` pairs."""
    def ref_counts(self) -> list[int]: ...
    def usage(self) -> tuple[int, int, float]:
        """``(num_free_blocks, num_cached_free_blocks, usage)``."""

@final
class SimReplica:
    """One modelled vLLM replica, stepped by hand (tests)."""

    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        profile: str = "cpu-tiny",
    ) -> SimReplica: ...
    def add_request(
        self, id: int, prompt_tokens: int, max_tokens: int, block_hashes: Sequence[int]
    ) -> None: ...
    def step(
        self,
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[int], float] | None:
        """``(scheduled [(id, n)], finished [(id, num_cached_tokens)], preempted, seconds)``."""
    def abort_request(self, id: int) -> bool: ...

def sim_step_features(entries: Sequence[_StepEntry]) -> list[float]:
    """The cost model's regressors for one step: 1, sequences, tokens, sum c*(p + c/2),
    sum of decode contexts."""

def sim_profile_step_times(
    path: str, text: str, steps: Sequence[Sequence[_StepEntry]]
) -> list[float]:
    """Step times the profile (TOML ``text``; ``path`` names it in errors) predicts."""

# --------------------------------------------------------------------------- twin (sim.rs)

#: A session for ``simulate_rl_steps``: (session_id, system_tokens, task_tokens, arrival,
#: [(append, output, tool_latency), ...]).
_SimSession: TypeAlias = tuple[str, int, int, float, Sequence[tuple[int, int, float]]]

def simulate_rl_steps(
    steps: Sequence[Sequence[_SimSession]],
    mode: str,
    *,
    cap: int = 0,
    config: GateConfig | None = None,
    profile: str | None = None,
    profile_path: str | None = None,
    profile_text: str | None = None,
    num_blocks: int | None = None,
    block_size: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    seed: int = 0,
) -> list[dict[str, object]]:
    """Runs one mode (``none``, ``limit``, ``cap``, ``seed``, ``gate``, ``aimd``, ``pause``,
    ``sched``, ``sched-infer``) of a workload on the twin over consecutive RL steps (one
    session list per step), each step on a fresh replica, through ONE mode object: the gate
    core lives across steps, the other modes start afresh. The built-in ``profile`` or the TOML
    ``profile_text``; the profile's replica shape unless a shape field is given. One dict per
    step: ``records`` (columns), ``makespan_sec``, ``gate_stats`` (or None; cumulative),
    ``infer_stats`` (``sched-infer``'s inferred sessions against the true ones, or None;
    cumulative), ``replica_stats``, ``lost``, ``profile`` and ``wall_sec``. The GIL is released
    while it runs."""

def sim_profile_names() -> list[str]:
    """The built-in twin profiles."""

def sim_profile_shape(
    *, profile: str | None = None, profile_path: str | None = None, profile_text: str | None = None
) -> dict[str, int]:
    """The replica shape a profile implies (its ``[replica]``): ``num_blocks`` (vLLM's null block
    included), ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``. Raises
    ``ValueError`` for an unknown or malformed profile."""

def sim_profile_text(name: str) -> str:
    """A built-in twin profile's TOML text, as embedded (its ``[machine]`` says where it was
    fitted). Raises ``ValueError`` for an unknown name."""
