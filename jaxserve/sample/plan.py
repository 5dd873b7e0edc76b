"""Which branches of the sampler a step program runs (`SamplerPlan`): decided on the host
from the batch's sampling parameters, or left to the device (`lax.cond` / `lax.switch`).

Each branch skips work most batches do not need: the noise of an all-greedy batch, the
vocabulary sort of a batch without top-k / top-p / min-p, the logits controls of a batch
without logit bias, penalties or grammar, the top logprobs nobody asked for. Deciding
on device costs nothing on XLA:CPU. XLA:GPU runs a conditional as a host-side step that
copies its predicate to the host and waits for the stream (its ConditionalThunk), so the
host thread launching the program waits for everything queued before it (the forward
pass before the sampler), and the next step cannot be prepared while the device
computes: a decode step of the Llama-3-8B shape on an H100 idled ~9 of ~17 ms so
(PERFORMANCE.md, "The GPU run of session 22"). The host knows every predicate before it
launches the step, so with KernelConfig.branches "host" (GPUs' default) it decides them
itself (`plan_of`) and runs the program compiled for that plan, every plan the engine
runs compiled at warm-up (`sampler_plans`, `FUSED_PLANS`).
Source: tpu-inference's TPUSupportedSamplingMetadata (do_sampling and logprobs are
static fields there: one compiled sampler per value); vLLM's Sampler decides the same
flags on the host (all_greedy, no_top_k, no_penalties, max_num_logprobs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sample.logits_processors import controls_active

# The sampling paths, cheapest first: every row greedy (argmax); some row samples and none
# filters (Gumbel-max over the whole vocabulary); some sampling row filters (top-k, top-p,
# min-p: a sort of the vocabulary).
MODES = ("greedy", "random", "filtered")


@dataclasses.dataclass(frozen=True)
class SamplerPlan:
    """The sampler branches a program takes; a field left None is decided on device.

    mode: one of MODES, the path `jaxserve.sample.sampler.sample` takes (and the
        rejection sampler's: "greedy" accepts by argmax only; "filtered" filters the
        distributions it compares);
    controls: whether the rows' logits controls are applied (logit bias, min_tokens,
        penalties, a grammar's bitmask; jaxserve.sample.logits_processors);
    top_logprobs: whether the top logprobs are computed (else zeros).
    A plan that decides a branch the batch needs the other way samples wrongly: the
    plan of a batch is `plan_of` its sampling arrays. Hashable: a static argument of
    the step programs."""

    mode: str | None = None
    controls: bool | None = None
    top_logprobs: bool | None = None

    def __post_init__(self):
        if self.mode not in MODES + (None,):
            raise ValueError(f"SamplerPlan.mode must be one of {MODES} or None, "
                             f"got {self.mode!r}")

    @property
    def static(self) -> bool:
        """Whether every branch is decided on the host (the program has no conditional)."""
        return None not in (self.mode, self.controls, self.top_logprobs)


ON_DEVICE = SamplerPlan()  # every branch decided on device: one program for every batch

# The plans a whole-step program (multi-step decode, verify) is compiled for with host
# branches: each sampling mode without controls or top logprobs, what nearly every decode
# batch is. Such a program holds the forward pass, so compiling it for all twelve plans
# would cost twelve forward compilations per shape. A batch with controls or top logprobs
# decodes a token a step (jaxserve.engine.scheduler.Scheduler.plain_bursts), its sampler
# program static too; as a verify step it takes the ON_DEVICE program (correct, and the
# host waits at its conditionals).
FUSED_PLANS = tuple(SamplerPlan(mode, False, False) for mode in MODES)


@functools.cache
def sampler_plans(num_top: int) -> tuple[SamplerPlan, ...]:
    """Every static plan a sampler program can be asked for: 3 modes x controls or not x
    top logprobs or not (top logprobs only with num_top > 0, the engine's max_logprobs)."""
    tops = (False, True) if num_top else (False,)
    return tuple(SamplerPlan(mode, controls, top) for mode in MODES
                 for controls in (False, True) for top in tops)


def mode_flags(rows, xp=jnp):
    """(all_greedy, filters) of the rows' temperature, top_k, top_p, min_p [B]: whether
    every row is greedy, whether some sampling row filters (a greedy row's filter is never
    read). xp: jax.numpy (the device's branch) or numpy (`plan_of`)."""
    a = xp.asarray
    greedy = a(rows.temperature) <= 0
    filters = (a(rows.top_k) > 0) | (a(rows.top_p) < 1) | (a(rows.min_p) > 0)
    return xp.all(greedy), xp.any(~greedy & filters)


def branch(decided: bool | None, predicate, if_true, if_false):
    """if_true() or if_false(): as the host `decided`, or with None by `lax.cond` on
    predicate() (a scalar bool computed on device)."""
    if decided is None:
        return jax.lax.cond(predicate(), if_true, if_false)
    return (if_true if decided else if_false)()


def plan_of(sampling, num_top: int) -> SamplerPlan:
    """The static plan of a batch's sampling arrays (a SamplingBatch of host numpy arrays:
    temperature, top_k, top_p, min_p [B]; controls or None; num_logprobs [B] or None):
    each predicate the device would evaluate (`mode_flags`, `controls_active`), evaluated
    here. num_top: the top logprobs the program reports (0: none, top_logprobs False)."""
    all_greedy, filters = mode_flags(sampling, np)
    mode = "greedy" if all_greedy else "filtered" if filters else "random"
    c = sampling.controls
    controls = c is not None and bool(controls_active(c, np))
    top = (bool(num_top) and sampling.num_logprobs is not None
           and bool((np.asarray(sampling.num_logprobs) > 0).any()))
    return SamplerPlan(mode, controls, top)
