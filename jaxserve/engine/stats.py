"""The engine's counters, typed: what /health reports and /metrics exports.

`EngineStats` groups the scheduler's (SchedulerStats), speculative decoding's
(SpecDecodeStats) and the step loop's own counters, and the process's JAX compile events
(CompileEvents). Readers use the attributes, so a renamed counter fails where it is read
instead of reporting 0; `as_dict` is the flat JSON of /health (vLLM's metric names where
they exist).
"""

from __future__ import annotations

import dataclasses

from jaxserve.engine.scheduler import SchedulerStats
from jaxserve.spec_decode.controller import SpecDecodeStats
from jaxserve.worker.compile_events import KINDS, CompileEvents

# /health's names of CompileEvents' kinds
_COMPILE_EVENT_KEYS = {"trace": "jax_traces", "lowering": "jax_lowerings",
                       "compilation": "jax_compilations", "cache_fetch": "jax_cache_fetches"}


@dataclasses.dataclass
class EngineStats:
    """Counters since start unless said otherwise.

    num_steps: steps launched; num_compilations: step compilations (warm-up included);
    kv_live_token_steps / kv_allocated_token_steps: per launched step, the tokens whose
    K/V the running sequences hold, and the token slots of all allocated pages (their
    ratio over an interval is the KV utilisation); step_seconds: wall time in
    `Engine.step()`; host_seconds: the part of it not spent waiting for the device
    (seconds); warmup_pending (gauge): step shapes a background warm-up has still to
    compile; num_failed_requests: requests finished with "error"; num_kv_resets: fresh
    KV pools after failed device steps; num_forced_tokens: structured-output tokens
    jump-forward added without sampling them (SchedulerConfig.jump_forward); healthy
    (gauge): False once the engine is dead.
    spec_decode: None while speculative decoding is off. compile_events: every JAX trace,
    lowering, XLA compilation and persistent-cache fetch in this process since the engine
    was built (jaxserve.worker.compile_events; warm-up included, and anything else the
    process compiled): after warm-up, serving should add none."""

    scheduler: SchedulerStats
    spec_decode: SpecDecodeStats | None
    num_steps: int
    num_compilations: int
    kv_live_token_steps: int
    kv_allocated_token_steps: int
    host_seconds: float
    step_seconds: float
    warmup_pending: int
    num_failed_requests: int
    num_kv_resets: int
    num_forced_tokens: int
    healthy: bool
    compile_events: CompileEvents

    def as_dict(self) -> dict[str, int | float | bool | list | None]:
        """One flat dict: the scheduler's fields by name, speculative decoding's prefixed
        `spec_decode_` (zeros while it is off), then the rest; seconds rounded to us."""
        spec = self.spec_decode or SpecDecodeStats()
        out: dict = dataclasses.asdict(self.scheduler)
        out |= {f"spec_decode_{k}": v for k, v in dataclasses.asdict(spec).items()}
        out["spec_decode_propose_seconds"] = round(spec.propose_seconds, 6)
        out["spec_decode_mean_acceptance_length"] = spec.mean_acceptance_length
        out |= {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("scheduler", "spec_decode", "compile_events")}
        out["host_seconds"] = round(self.host_seconds, 6)
        out["step_seconds"] = round(self.step_seconds, 6)
        events = self.compile_events
        out |= {_COMPILE_EVENT_KEYS[k]: events.counts[k] for k in KINDS}
        out["jax_compile_events"] = events.total
        out["jax_compile_seconds"] = round(sum(events.seconds.values()), 6)
        return out
