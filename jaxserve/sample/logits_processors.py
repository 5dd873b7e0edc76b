"""Per-request logits controls, on device, batched: logit_bias, min_tokens, the
repetition, frequency and presence penalties, and structured output's token bitmask.

Applied to each sampled row's raw logits before temperature and the top-k / top-p / min-p
filters, in vLLM v1's order (`vllm/v1/sample/sampler.py`): first the logit bias and the
min_tokens mask (its built-in logits processors), then the penalties
(`vllm/model_executor/layers/utils.py: apply_penalties`):

    repetition (vLLM / HF `RepetitionPenaltyLogitsProcessor`): a token seen in the prompt
        or the output so far has its logit divided by the penalty if positive, multiplied
        by it if not;
    frequency (OpenAI): logit -= frequency_penalty * (times the token is in the output);
    presence (OpenAI): logit -= presence_penalty * (1 if the token is in the output);
then the grammar's bitmask (tokens it does not allow: -inf).

The token history the penalties count is read on device from the token pool
(`write_token_pool`): every step writes its input tokens at their KV slots, so a sequence's
tokens are at the slots of its block table, prompt and output alike, including tokens the
host has not read back yet (async scheduling, multi-step decode, accepted drafts). Nothing
per request is kept on device between steps.

A batch none of whose rows uses a control takes the branch that skips all of this
(`lax.cond`, or decided on the host: jaxserve.sample.plan); the engine then passes a cached
device-resident `LogitsControls.neutral` table, so such steps transfer nothing extra
either.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pytree import pytree_dataclass

NO_LIMIT = np.iinfo(np.int32).max  # `bias_until` of an entry that always applies


@pytree_dataclass
class LogitsControls:
    """The controls of S rows, with a bias table of K entries per row.

    presence_penalty, frequency_penalty: [S] f32 (0 = off); repetition_penalty: [S] f32
    (1 = off); prompt_len: [S] int32, the row's sequence's prompt tokens (positions from
    there on are output). bias_ids: [K] entries per row [S, K] int32 (-1 = unused);
    bias_values: [S, K] f32 added to the logit (-inf masks the token); bias_until: [S, K]
    int32, the entry applies while the output index being sampled is below it (NO_LIMIT:
    always; min_tokens' masks of EOS and stop token ids: min_tokens). allowed: [S, W]
    int32, W = ceil(vocab / 32): the tokens a structured-output grammar allows, bit t % 32
    of word t // 32 (-1: all; jaxserve.sample.grammar).
    """

    presence_penalty: Any
    frequency_penalty: Any
    repetition_penalty: Any
    prompt_len: Any
    bias_ids: Any
    bias_values: Any
    bias_until: Any
    allowed: Any

    @staticmethod
    def neutral(S: int, K: int, vocab_size: int) -> "LogitsControls":
        """Numpy arrays for S rows that control nothing."""
        return LogitsControls(
            presence_penalty=np.zeros(S, np.float32), frequency_penalty=np.zeros(S, np.float32),
            repetition_penalty=np.ones(S, np.float32), prompt_len=np.zeros(S, np.int32),
            bias_ids=np.full((S, K), -1, np.int32), bias_values=np.zeros((S, K), np.float32),
            bias_until=np.zeros((S, K), np.int32),
            allowed=np.full((S, bitmask_words(vocab_size)), -1, np.int32))

    def repeat(self, J: int) -> "LogitsControls":
        """Each row repeated J times ([S * J] rows), for a verify step's positions."""
        return jax.tree.map(lambda x: jnp.repeat(x, J, axis=0), self)


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a packed token bitmask over the vocabulary."""
    return -(-vocab_size // 32)


def apply_bitmask(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """logits [R, V] f32 with the tokens whose bit is clear in allowed [R, W] int32 set to
    -inf (bit t % 32 of word t // 32; xgrammar's and llguidance's packed layout)."""
    V = logits.shape[1]
    t = jnp.arange(V, dtype=jnp.int32)
    bits = (allowed[:, t // 32] >> (t % 32)[None, :]) & 1
    return jnp.where(bits == 1, logits, -jnp.inf)


def bias_entries(logit_bias: dict[int, float], min_tokens: int, stop_ids) -> list[tuple]:
    """A request's bias-table entries (token id, value, until): its logit_bias, then -inf
    for each id of `stop_ids` (EOS unless ignore_eos, and stop_token_ids) while fewer
    than min_tokens tokens are out. Plain Python (the engine packs them at admission)."""
    out = [(int(t), float(v), NO_LIMIT) for t, v in sorted(logit_bias.items())]
    if min_tokens > 0:
        out += [(int(t), -np.inf, int(min_tokens)) for t in sorted(set(stop_ids))]
    return out


def controls_active(c: LogitsControls, xp=jnp):
    """Scalar bool: whether any row of `c` changes its logits; xp: jax.numpy (on device)
    or numpy (the host's reading of the same arrays, jaxserve.sample.plan.plan_of)."""
    a = xp.asarray
    return (xp.any(a(c.bias_ids) >= 0) | xp.any(a(c.presence_penalty) != 0)
            | xp.any(a(c.frequency_penalty) != 0) | xp.any(a(c.repetition_penalty) != 1)
            | xp.any(a(c.allowed) != -1))


def write_token_pool(token_pool: jax.Array, slot_mapping: jax.Array,
                     tokens: jax.Array) -> jax.Array:
    """token_pool [num_slots] int32 with tokens [T] int32 written at their KV slots
    slot_mapping [T] int32 (padding rows write to the null page, as their K/V do)."""
    return token_pool.at[slot_mapping].set(tokens, mode="drop")


def history(token_pool: jax.Array, block_tables: jax.Array, page_size: int) -> jax.Array:
    """Each sequence's tokens by position: [S, P * page_size] int32 from the token pool
    through its block table [S, P] int32 (positions past its length hold stale ids:
    `apply_controls` masks them by position)."""
    slots = block_tables[:, :, None] * page_size + jnp.arange(page_size)[None, None, :]
    return token_pool[slots.reshape(block_tables.shape[0], -1)]


def apply_controls(logits: jax.Array, c: LogitsControls, step: jax.Array,
                   tokens: jax.Array, num_context: jax.Array) -> jax.Array:
    """The logits R rows sample from after their controls.

    logits: [R, V] f32 raw. c: R rows. step: [R] int32, the output index each row samples
    (its tokens out so far). tokens: [R, L] int32, each row's sequence by position
    (`history`); num_context: [R] int32, how many of them precede the sampled token
    (positions 0 .. num_context - 1: prompt, then output from c.prompt_len on).
    Returns [R, V] f32 (a structured-output mask last: its -inf stays -inf).

    min_tokens yields to a grammar that allows nothing else: where its masks (the bias
    entries that end at min_tokens) would leave a row no token the grammar allows (a value
    the grammar has completed, whose only continuation is EOS), the row samples from its
    logits without them, so the request ends there, short of min_tokens, instead of
    sampling a token outside the grammar. Every other row is as if the masks came first
    (they are -inf: the penalties keep them -inf). Source: vLLM #54218 ("Let terminal
    grammars stop under min_tokens")."""
    R, V = logits.shape
    rows = jnp.arange(R)[:, None]
    live = (c.bias_ids >= 0) & (step[:, None] < c.bias_until)
    until_min = c.bias_until != NO_LIMIT  # min_tokens' masks of EOS and stop token ids
    on = live & ~until_min
    logits = logits.at[rows, jnp.where(on, c.bias_ids, V)].add(c.bias_values, mode="drop")

    pos = jnp.arange(tokens.shape[1])[None, :]
    seen = pos < num_context[:, None]
    output = seen & (pos >= c.prompt_len[:, None])
    ids = jnp.clip(tokens, 0, V - 1)
    counts = jnp.zeros((R, V), jnp.int32).at[rows, ids].add(output.astype(jnp.int32))
    in_context = jnp.zeros((R, V), jnp.bool_).at[rows, ids].max(seen)
    rep = c.repetition_penalty[:, None]
    logits = jnp.where(in_context, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - c.frequency_penalty[:, None] * counts
    logits = logits - c.presence_penalty[:, None] * (counts > 0)
    logits = apply_bitmask(logits, c.allowed)
    masked = logits.at[rows, jnp.where(live & until_min, c.bias_ids, V)].set(-jnp.inf,
                                                                            mode="drop")
    empty = jnp.all(masked == -jnp.inf, axis=1, keepdims=True)
    return jnp.where(empty, logits, masked)
