"""On-device sampling with per-request parameters batched as arrays (one jitted step).

Order of operations matches vLLM: temperature scaling, then top-k, top-p and min-p
filters on the scaled distribution, then a categorical draw (Gumbel-max). Temperature 0
rows take the argmax of the raw logits. Each row's randomness comes only from its own
(seed, output index) pair, so a request's samples do not depend on what else is in the
batch or on preemption/recompute.

All-greedy batches skip the noise, unfiltered batches skip the vocabulary sort: which path
runs is a `SamplerPlan`'s, decided on the host, or on device with `lax.switch`
(jaxserve.sample.plan).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.sampling_ops import SamplerOps, argmax_last, argmax_logsumexp
from jaxserve.sample.logits_processors import apply_controls, controls_active
from jaxserve.sample.plan import MODES, ON_DEVICE, SamplerPlan, branch, mode_flags
from jaxserve.pytree import pytree_dataclass
from jaxserve.sampling_params import SamplingParams


@pytree_dataclass
class SamplingBatch:
    """Per-row sampling parameters for a batch of B rows.

    temperature: [B] f32 (0 = greedy); top_k: [B] int32 (<= 0 = off); top_p: [B] f32;
    min_p: [B] f32; seed: [B, 2] uint32, the request seed's two's-complement 64 bits as
    (high, low) words: the threefry key data of `jax.random.key(seed)` (the same key for
    0 <= seed < 2**32, and distinct keys for distinct 64-bit seeds); step: [B] int32 index
    of the token being sampled within the request's output (folded into the key).

    Optional (None: not computed; the engine always gives them, `jaxserve.functional`
    does not): num_logprobs: [B] int32, the top logprobs each row's request asked for (0:
    none); controls: the rows' LogitsControls (jaxserve.sample.logits_processors);
    prompt_targets: [T] int32, one per token row of a mixed step, the prompt token after
    that row's whose logprob the request asked for (-1: none; `echo` / prompt_logprobs).
    """

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    seed: Any
    step: Any
    num_logprobs: Any = None
    controls: Any = None
    prompt_targets: Any = None

    @staticmethod
    def from_params(params: list[SamplingParams | None], seeds: list[int], steps: list[int],
                    batch_size: int) -> "SamplingBatch":
        """Host-side packing into numpy arrays, padded to `batch_size` rows (greedy), with
        num_logprobs (controls and prompt_targets are left None: the batch builder adds
        them when a row uses them).

        seeds: Python ints, any 64-bit value (signed or not; taken mod 2**64). Raises
        OverflowError / ValueError for a value that does not fit its array (a top_k beyond
        int32): the engine packs each request alone once when it admits it, so that such
        a request fails by itself, never a batch."""
        n = len(params)
        t = np.zeros(batch_size, np.float32)
        k = np.zeros(batch_size, np.int32)
        p = np.ones(batch_size, np.float32)
        m = np.zeros(batch_size, np.float32)
        s = np.zeros((batch_size, 2), np.uint32)
        st = np.zeros(batch_size, np.int32)
        nl = np.zeros(batch_size, np.int32)
        for i, sp in enumerate(params):
            if sp is None:
                continue
            t[i], k[i], p[i], m[i] = sp.temperature, sp.top_k, sp.top_p, sp.min_p
            nl[i] = sp.logprobs or 0
        for i, seed in enumerate(seeds):
            word = int(seed) % 2**64
            s[i] = word >> 32, word & 0xFFFFFFFF
        st[:n] = steps
        return SamplingBatch(temperature=t, top_k=k, top_p=p, min_p=m, seed=s, step=st,
                             num_logprobs=nl)


# Rows of one block of the prompt-logprobs LM head (jaxserve.worker.step._prompt_logprobs): bounds
# its [rows, vocab] f32 logits, which every mixed step's memory holds room for (the branch
# of a lax.cond is allocated whether it runs or not; memory_plan counts it).
PROMPT_LOGPROBS_BLOCK = 64


def _request_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    """The key of one row's draw: threefry key data seed [2] uint32 with the output index
    `step` folded in."""
    return jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), step)


def gumbel_noise(seed: jax.Array, step: jax.Array, vocab: int) -> jax.Array:
    """[B, vocab] f32 Gumbel noise, row b drawn from key (seed[b], step[b]) only.
    seed: [B, 2] uint32 threefry key data (see SamplingBatch); step: [B] int32."""
    def one(sd, st):
        return jax.random.gumbel(_request_key(sd, st), (vocab,), jnp.float32)
    return jax.vmap(one)(seed, step)


# Folded into a row's key for the speculative acceptance test's uniform, so that it is
# independent of the Gumbel noise that samples the same output index.
_ACCEPT_STREAM = 0x5BEC


def uniform_noise(seed: jax.Array, step: jax.Array) -> jax.Array:
    """[B] f32 uniform in [0, 1), row b drawn from key (seed[b], step[b]) only, independent
    of `gumbel_noise` for the same key (the rejection sampler's acceptance test)."""
    def one(sd, st):
        key = jax.random.fold_in(_request_key(sd, st), _ACCEPT_STREAM)
        return jax.random.uniform(key, (), jnp.float32)
    return jax.vmap(one)(seed, step)


def _sorted_filter(scaled: jax.Array, sb: SamplingBatch
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k, top-p and min-p of each row of scaled logits [B, V] f32, in the order vLLM
    applies them: (order [B, V] int32, the vocabulary by descending logit; sorted_logits
    [B, V] f32; keep [B, V] bool, in sorted order, a prefix of each row, never empty)."""
    B, V = scaled.shape
    order = jnp.argsort(-scaled, axis=-1)                         # [B, V] descending
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V, dtype=jnp.int32)[None, :]
    k = jnp.where(sb.top_k > 0, jnp.minimum(sb.top_k, V), V)[:, None]
    sorted_logits = jnp.where(rank < k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs               # mass strictly above
    keep = (cum_before < sb.top_p[:, None]) & (probs >= sb.min_p[:, None] * probs[:, :1])
    keep = keep.at[:, 0].set(True)                               # never drop the top token
    return order, sorted_logits, keep


def filtered_logits(scaled: jax.Array, sb: SamplingBatch) -> jax.Array:
    """Scaled logits [B, V] f32 with the tokens top-k / top-p / min-p drop set to -inf, in
    vocabulary order: the log-weights of the distribution `sample` draws from (its
    softmax). sb: B rows (temperature is not read: `scaled` is already divided by it)."""
    order, _, keep = _sorted_filter(scaled, sb)
    rows = jnp.arange(scaled.shape[0])[:, None]
    keep = jnp.zeros(scaled.shape, jnp.bool_).at[rows, order].set(keep)
    return jnp.where(keep, scaled, -jnp.inf)


def _filtered_sample(scaled: jax.Array, sb: SamplingBatch) -> jax.Array:
    order, sorted_logits, keep = _sorted_filter(scaled, sb)
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    # each token's noise by its id, as in the unfiltered branch: a row that filters nothing
    # draws the same token whichever branch its batch takes
    noise = jnp.take_along_axis(gumbel_noise(sb.seed, sb.step, scaled.shape[1]), order, axis=-1)
    choice = argmax_last(sorted_logits + noise)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def sample(logits: jax.Array, sb: SamplingBatch, impl: "str | SamplerOps" = "xla",
           plan: SamplerPlan = ON_DEVICE) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row.

    logits: [B, V] f32. Returns (tokens [B] int32, logprobs [B] f32), where logprobs are
    the log-softmax of the raw (unscaled, unfiltered) logits at the chosen token, as
    vLLM reports by default. impl: the SamplerOps (or its name) that computes the argmax
    and log-sum-exp every row needs; the temperature scaling, noise and sort run only in
    the path that needs them: plan.mode's (jaxserve.sample.plan.plan_of the batch), or
    with mode None the one the device picks (`lax.switch`).
    """
    B, V = logits.shape
    greedy = sb.temperature <= 0
    top, lse = argmax_logsumexp(logits, impl)  # the greedy rows' tokens, in every branch

    def scaled():
        return logits / jnp.where(greedy, 1.0, sb.temperature)[:, None]

    paths = [lambda: top,
             lambda: argmax_last(scaled() + gumbel_noise(sb.seed, sb.step, V)),
             lambda: _filtered_sample(scaled(), sb).astype(jnp.int32)]
    if plan.mode is None:
        all_greedy, filters = mode_flags(sb)
        sampled = jax.lax.switch(jnp.where(all_greedy, 0, jnp.where(filters, 2, 1)), paths)
    else:
        sampled = paths[MODES.index(plan.mode)]()
    tokens = jnp.where(greedy, top, sampled)
    logprobs = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
    return tokens, logprobs


def sample_controlled(logits: jax.Array, sb: SamplingBatch, impl: "str | SamplerOps",
                      context, plan: SamplerPlan = ON_DEVICE
                      ) -> tuple[jax.Array, jax.Array]:
    """`sample` after each row's logits controls (sb.controls: logit_bias, min_tokens,
    penalties; jaxserve.sample.logits_processors). The logprobs stay those of the raw logits
    (vLLM's default "raw_logprobs"). A batch without controls (sb.controls None, or no
    row using one: plan.controls False, or with plan.controls None decided on device)
    samples exactly as `sample`.

    context: a function returning (tokens [B, L] int32, num_context [B] int32), each row's
    sequence by position and how many of those precede the sampled token (see
    `apply_controls`); called only in the branch that needs it."""
    if sb.controls is None:
        return sample(logits, sb, impl, plan)

    def controlled():
        tokens, num_context = context()
        processed = apply_controls(logits, sb.controls, sb.step, tokens, num_context)
        chosen, _ = sample(processed, sb, impl, plan)
        return chosen, token_logprobs(logits, chosen, impl)

    return branch(plan.controls, lambda: controls_active(sb.controls), controlled,
                  lambda: sample(logits, sb, impl, plan))


def token_logprobs(logits: jax.Array, tokens: jax.Array, impl: "str | SamplerOps" = "xla"
                   ) -> jax.Array:
    """Log-softmax of logits [R, V] f32 at tokens [R] int32 -> [R] f32."""
    _, lse = argmax_logsumexp(logits, impl)
    return jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse


def top_logprobs(logits: jax.Array, k: int, impl: "str | SamplerOps" = "xla"
                 ) -> tuple[jax.Array, jax.Array]:
    """The k most likely tokens of each row of logits [R, V] f32 and their log-softmax:
    (ids [R, k] int32, logprobs [R, k] f32), most likely first (ties: the lower id
    first, as `jax.lax.top_k`). Source: vLLM's Sampler.gather_logprobs (top-k of the
    log-softmax of the raw logits)."""
    _, lse = argmax_logsumexp(logits, impl)
    values, ids = jax.lax.top_k(logits, k)
    return ids.astype(jnp.int32), values - lse[:, None]
