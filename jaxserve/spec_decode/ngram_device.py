"""N-gram prompt lookup on device: `NgramProposer`'s proposals computed from the token pool's
history inside a jitted step, so that a step can propose drafts for tokens the host has not
read yet (speculation with async scheduling). Pure jnp.

Same rule as the host proposer (jaxserve.spec_decode.ngram.NgramProposer, its reference):
the longest suffix n-gram of min_n..max_n tokens that occurs earlier in the sequence's
context wins, among its occurrences the latest, and the proposal is what followed it, at
most k tokens (fewer when the context ends first). Source: "Prompt lookup decoding"
(Saxena 2023); vLLM's NgramProposer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ngram_propose(tokens: jax.Array, lengths: jax.Array, *, min_n: int, max_n: int,
                  k: int) -> tuple[jax.Array, jax.Array]:
    """Drafts for each row of a batch of contexts.

    tokens: [S, L] int32, each row's context by position (prompt then output; positions
    from lengths[b] on are ignored); lengths: [S] int32, its tokens (0: a padding row).
    min_n / max_n: the shortest and longest suffix n-gram looked up; k: drafts wanted.

    Returns (drafts [S, k] int32, num_drafts [S] int32): row b's proposal in
    drafts[b, :num_drafts[b]] (0 where none: no n-gram of min_n..max_n tokens recurs, or
    the row has at most min_n tokens), the rest 0. Cost: S x L x max_n comparisons.
    Raises ValueError for 1 > min_n, min_n > max_n or k < 1."""
    if not 1 <= min_n <= max_n or k < 1:
        raise ValueError(f"need 1 <= min_n <= max_n and k >= 1, got min_n={min_n}, "
                         f"max_n={max_n}, k={k}")
    S, L = tokens.shape
    pos = jnp.arange(L)[None, :]                                       # candidate ends e
    last = lengths[:, None] - 1                                        # the suffix's end
    # candidate ends: earlier positions than the last token's
    match = (pos < last) & (lengths[:, None] > min_n)
    best_n = jnp.zeros((S,), jnp.int32)
    best_end = jnp.zeros((S,), jnp.int32)
    for n in range(1, max_n + 1):
        j = n - 1  # compare token e - j with the suffix's token last - j
        earlier = jnp.roll(tokens, j, axis=1)                          # [b, e] = tokens[b, e - j]
        suffix = jnp.take_along_axis(tokens, jnp.maximum(last - j, 0), axis=1)  # [S, 1]
        match = match & (pos >= j) & (earlier == suffix) & (last - j >= 1)
        found = jnp.any(match, axis=1)
        latest = (L - 1 - jnp.argmax(match[:, ::-1], axis=1)).astype(jnp.int32)
        best_n = jnp.where(found, n, best_n)
        best_end = jnp.where(found, latest, best_end)
    ok = best_n >= min_n
    offsets = best_end[:, None] + 1 + jnp.arange(k)[None, :]            # [S, k]
    num = jnp.where(ok, jnp.clip(lengths - 1 - best_end, 0, k), 0).astype(jnp.int32)
    drafts = jnp.take_along_axis(tokens, jnp.clip(offsets, 0, L - 1), axis=1)
    drafts = jnp.where(jnp.arange(k)[None, :] < num[:, None], drafts, 0).astype(jnp.int32)
    return drafts, num
