"""Verify draft tokens against the target model's logits, on device, batched.

Each sequence of a verify step brought its last token and `num_drafts` draft tokens d_1..d_k
(k <= K); the target computed logits at all k + 1 positions: position j predicts the token
after d_j (position 0: after the last token). With p_j the target's distribution at position
j and q_j the draft's for d_{j+1} (both after the request's temperature, top-k, top-p and
min-p), draft j is accepted with probability min(1, p_j(d) / q_j(d)); at the first rejection
the token is drawn from the residual max(0, p_j - q_j) (normalised) and the rest is
discarded; when all k are accepted a bonus token is drawn from p_k. The output is then
distributed exactly as tokens sampled from the target one by one (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding", Theorem 1; Chen et al. 2023).
A proposer without probabilities (n-gram lookup) proposes d deterministically: q_j is the
point mass on d, accepted with probability p_j(d), the residual is p_j without d.
Greedy rows (temperature 0) accept the longest prefix equal to the target's argmax and
add the argmax after it: token for token what greedy decoding gives.

Randomness: position j's draws use the request's key for output index step + j (the
residual / bonus token: the same Gumbel noise `jaxserve.sample.sampler.sample` would use for that
index; the acceptance test: an independent uniform from the same key), so seeded
speculative sampling is reproducible and independent of the rest of the batch.
Source: vLLM v1's RejectionSampler (vllm/v1/sample/rejection_sampler.py), whose layout
and greedy / random split this follows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels.sampling_ops import SamplerOps, argmax_last, sampler_ops
from jaxserve.sample.plan import ON_DEVICE, SamplerPlan, branch, mode_flags
from jaxserve.sample.sampler import SamplingBatch, filtered_logits, gumbel_noise, uniform_noise


def _rows(sb: SamplingBatch, J: int) -> SamplingBatch:
    """`sb`'s S rows repeated for the J positions of each ([S * J] rows), step + j."""
    rep = lambda x: jnp.repeat(x, J, axis=0)  # noqa: E731
    steps = (sb.step[:, None] + jnp.arange(J, dtype=jnp.int32)[None, :]).reshape(-1)
    return SamplingBatch(temperature=rep(sb.temperature), top_k=rep(sb.top_k),
                         top_p=rep(sb.top_p), min_p=rep(sb.min_p), seed=rep(sb.seed),
                         step=steps)


def _log_probs(logits: jax.Array, rows: SamplingBatch, mode: str | None) -> jax.Array:
    """Log-probabilities [R, V] f32 of the distribution each row samples from: logits
    [R, V] over the row's temperature (greedy rows: 1), filtered (top-k, top-p, min-p)
    only when some sampling row filters (as `sample` decides: a greedy row's distribution
    is not read): mode "filtered", or with mode None decided on device."""
    scaled = logits / jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    scaled = branch(None if mode is None else mode == "filtered", lambda: mode_flags(rows)[1],
                    lambda: filtered_logits(scaled, rows), lambda: scaled)
    return jax.nn.log_softmax(scaled, axis=-1)


def rejection_sample(logits: jax.Array, draft_ids: jax.Array, num_drafts: jax.Array,
                     sb: SamplingBatch, draft_logits: jax.Array | None = None,
                     impl: "str | SamplerOps" = "xla", plan: SamplerPlan = ON_DEVICE
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Accept or reject each sequence's drafts and add the token after them.

    logits: [S, K + 1, V] f32, the target's logits at each sequence's positions 0..K
        (positions past num_drafts are padding, ignored).
    draft_ids: [S, K] int32, the draft tokens (past num_drafts: ignored).
    num_drafts: [S] int32 in 0..K (0: a plain decode, the token sampled from p_0).
    sb: the S sequences' sampling parameters; sb.step = output index of position 0's token.
    draft_logits: [S, K, V] f32, the draft's logits for each draft token (its distribution
        is processed with the request's parameters, as the target's); None = drafts
        proposed deterministically (n-gram lookup).
    impl: the SamplerOps (or its name) computing the greedy argmax and log-sum-exp.
    plan: plan.mode "greedy" takes the greedy rows' path only (every row greedy), another
        mode the random rows' too (jaxserve.sample.plan.plan_of the sequences' sampling);
        None: decided on device.
    Returns (tokens [S, K + 1] int32: the accepted drafts, then the recovered or bonus
    token, then 0s; logprobs [S, K + 1] f32: the raw (unscaled, unfiltered) log-softmax at
    each token, as `sample` reports; num_tokens [S] int32 in 1..num_drafts + 1: the output
    tokens of each sequence, i.e. accepted drafts + 1).
    """
    S, J, V = logits.shape
    K = J - 1
    flat = logits.reshape(S * J, V)
    top, lse = sampler_ops(impl).argmax_logsumexp(flat)
    top, lse = top.reshape(S, J), lse.reshape(S, J)
    greedy = sb.temperature <= 0
    greedy_accept = draft_ids == top[:, :K]

    def greedy_branch():
        return greedy_accept, top

    def random_branch():
        rows = _rows(sb, J)
        logp = _log_probs(flat, rows, plan.mode).reshape(S, J, V)
        if draft_logits is None:
            q = jax.nn.one_hot(draft_ids, V, dtype=jnp.float32)           # [S, K, V]
        else:
            q_rows = _rows(sb, K)
            q = jnp.exp(_log_probs(draft_logits.reshape(S * K, V), q_rows, plan.mode)
                        ).reshape(S, K, V)
        p = jnp.exp(logp)
        p_d = jnp.take_along_axis(p[:, :K], draft_ids[..., None], axis=-1)[..., 0]
        q_d = jnp.take_along_axis(q, draft_ids[..., None], axis=-1)[..., 0]
        u = uniform_noise(rows.seed, rows.step).reshape(S, J)[:, :K]
        accept = u * q_d < p_d   # probability min(1, p/q): u < p/q, u in [0, 1)
        residual = jnp.maximum(p[:, :K] - q, 0.0)
        # p == q leaves no residual, but then no draft is rejected: draw from p instead
        empty = jnp.sum(residual, axis=-1, keepdims=True) <= 0
        residual = jnp.where(empty, p[:, :K], residual)
        dist = jnp.concatenate([residual, p[:, K:]], axis=1)              # [S, J, V]
        noise = gumbel_noise(rows.seed, rows.step, V).reshape(S, J, V)
        token = argmax_last(jnp.log(dist) + noise)
        return (jnp.where(greedy[:, None], greedy_accept, accept),
                jnp.where(greedy[:, None], top, token))

    accept, token_at = branch(None if plan.mode is None else plan.mode == "greedy",
                              lambda: jnp.all(greedy), greedy_branch, random_branch)
    pos = jnp.arange(J, dtype=jnp.int32)[None, :]
    valid = pos[:, :K] < num_drafts[:, None]
    num_accepted = jnp.sum(jnp.cumprod((accept & valid).astype(jnp.int32), axis=1), axis=1)
    drafts = jnp.pad(draft_ids, ((0, 0), (0, 1)))
    at = num_accepted[:, None]
    tokens = jnp.where(pos < at, drafts, jnp.where(pos == at, token_at, 0)).astype(jnp.int32)
    logprobs = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0] - lse
    return tokens, logprobs, num_accepted + 1
