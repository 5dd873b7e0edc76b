"""Step shapes: the fixed set of padded shapes the jitted step is compiled for (buckets,
`StepShapes`), a compiled shape's key (`StepKey`), and its abstract inputs.

The bucket sizes come from EngineConfig (its seq / token / page buckets up to the
scheduler's limits); a batch's shape is the smallest bucket that holds it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.model.inputs import StepBatch
from jaxserve.sample.logits_processors import LogitsControls
from jaxserve.sample.plan import FUSED_PLANS, MODES, ON_DEVICE, SamplerPlan
from jaxserve.sample.sampler import SamplingBatch


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def _up_to(buckets: tuple[int, ...] | None, lo: int, limit: int) -> tuple[int, ...]:
    """`buckets` below `limit`, then `limit` (None: powers of two from `lo`)."""
    if buckets is None:
        return _pow2_buckets(lo, limit)
    return tuple(b for b in buckets if b < limit) + (limit,)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n. Raises ValueError if n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class StepShapes:
    """The (kind, T, S, P, n, rounds) shapes of an engine's steps: T token rows, S
    sequences, P block-table pages per sequence, n tokens sampled per sequence (multi-step
    decode), rounds verify rounds per step (a verify step; 1 otherwise).

    A decode step ("decode": one token per sequence, each sampling; T = S) runs with n = 1
    or decode_steps. A mixed step ("mixed": prompt chunks, and decode tokens beside them)
    buckets T on token_buckets (up to max_num_batched_tokens). Both bucket S on
    seq_buckets. P is bucketed on page_buckets only when `bucket_pages`, i.e. when the
    attention implementation's cost grows with the block-table width
    (Attention.pads_pages: XLA's page gathers); otherwise every step takes
    the widest table (max_model_len / page_size pages), which costs S x P int32 of input
    and nothing else, and saves a compilation per page bucket.

    With speculative decoding, a verify step ("verify": decoding sequences, each bringing
    its last token and up to k drafts; n = verify_rows = k + 1 positions sampled per
    sequence) has T = S x (k + 1) rows, S on the sequence buckets up to
    disable_by_batch_size (`verify_seq_buckets`; () without speculative decoding), each
    with rounds 1 and SpeculativeConfig.verify_steps (`verify_steps`).

    The buckets are CompilationConfig's below each limit, then the limit itself
    (max_num_seqs, max_num_batched_tokens from min(16, it), max_model_len's pages); a
    group left None is the powers of two up to its limit.
    """

    def __init__(self, cfg: EngineConfig, bucket_pages: bool = True):
        comp, limits = cfg.compilation, cfg.scheduler
        if limits.decode_steps is None:
            raise ValueError("SchedulerConfig.decode_steps None (auto) is chosen for the "
                             "platform by the engine builder (SchedulerConfig.resolve)")
        self.decode_steps = limits.decode_steps
        self.page_size = cfg.cache.page_size
        self.lora = cfg.lora.enable_lora  # steps carry each row's LoRA slot
        self.seq_buckets = _up_to(comp.seq_buckets, 1, limits.max_num_seqs)
        budget = limits.max_num_batched_tokens
        self.token_buckets = _up_to(comp.token_buckets, min(16, budget), budget)
        self.page_buckets = (_up_to(comp.page_buckets, 1, cfg.max_pages_per_seq)
                             if bucket_pages else (cfg.max_pages_per_seq,))
        spec = cfg.speculative
        self.verify_seq_buckets = (_up_to(comp.seq_buckets, 1, spec.disable_by_batch_size)
                                   if spec else ())
        self.verify_rows = spec.num_speculative_tokens + 1 if spec else 0
        self.verify_steps = spec.verify_steps if spec else 1

    def shape_of(self, num_new: list[int], max_pages: int, decode: bool
                 ) -> tuple[int, int, int]:
        """(T, S, P) of a step computing num_new[i] tokens of each sequence, whose longest
        block table has `max_pages` pages. Raises ValueError past the largest buckets."""
        S = bucket_for(len(num_new), self.seq_buckets)
        T = S if decode else bucket_for(sum(num_new), self.token_buckets)
        return T, S, bucket_for(max_pages, self.page_buckets)

    def verify_shape(self, num_seqs: int, max_pages: int) -> tuple[int, int, int]:
        """(T, S, P) of a verify step over `num_seqs` sequences. Raises ValueError past
        the largest buckets (or when speculative decoding is off)."""
        if not self.verify_rows:
            raise ValueError("speculative decoding is off: no verify step")
        S = bucket_for(num_seqs, self.verify_seq_buckets)
        return S * self.verify_rows, S, bucket_for(max_pages, self.page_buckets)

    def warmup(self) -> list[tuple[str, int, int, int, int, int]]:
        """Every (kind, T, S, P, n, rounds) the engine can run: what warm-up compiles (a
        one-token mixed or decode shape is its forward program; the sampler programs
        that follow them are ("sample", 0, S, 0, 1, 1), one per sequence bucket). A mixed
        shape whose T cannot hold the fewest sequences that round up to S (one token
        each: the sequence bucket below S, plus one) is never run and not compiled (the
        preset's T 16 x S 32: one shape fewer, ~28 MB of code)."""
        below = dict(zip(self.seq_buckets, (0,) + self.seq_buckets))
        shapes = [("mixed", T, S, P, 1, 1) for T in self.token_buckets
                  for S in self.seq_buckets if T > below[S] for P in self.page_buckets]
        steps = sorted({1, self.decode_steps})
        shapes += [("decode", S, S, P, n, 1) for S in self.seq_buckets
                   for P in self.page_buckets for n in steps]
        shapes += [("verify", S * self.verify_rows, S, P, self.verify_rows, r)
                   for S in self.verify_seq_buckets for P in self.page_buckets
                   for r in sorted({1, self.verify_steps})]
        shapes += [("sample", 0, S, 0, 1, 1) for S in self.seq_buckets]
        return shapes


class StepKey(NamedTuple):
    """A compiled step shape: kind "mixed", "decode" or "verify", T token rows, S
    sequences, P block-table pages per sequence, n tokens sampled per sequence (multi-step
    decode; a verify step: the positions each sequence samples at, 1 + its drafts), rounds
    verify rounds run by a verify step (jaxserve.worker.step.verify_step; 1 otherwise),
    plan the sampler branches it takes (jaxserve.sample.plan; a forward program samples
    nothing: ON_DEVICE).

    A mixed or decode key with n = 1 (`split`) is the forward half of a one-token step
    (jaxserve.worker.step.forward_step); its sampler half is the key ("sample", 0, S, 0, 1)
    (`sample_key`, jaxserve.worker.step.sample_step). With host branches a mixed step's
    prompt logprobs are ("prompt_logprobs", T, 0, 0, 1)
    (jaxserve.worker.step.prompt_logprobs_step). Other keys are whole steps, among them
    a one-token decode step with `whole` set (CompilationConfig.fused_decode: the
    forward and the sampler in one program, jaxserve.worker.step.model_step)."""

    kind: str
    T: int
    S: int
    P: int
    n: int = 1
    rounds: int = 1
    plan: SamplerPlan = ON_DEVICE
    whole: bool = False

    @classmethod
    def of(cls, batch: StepBatch, num_steps: int = 1) -> "StepKey":
        """The key of `batch`; num_steps: tokens per sequence of a decode step, or the
        rounds of a verify step."""
        if batch.logits_indices.ndim == 2:
            return cls("verify", batch.tokens.shape[0], *batch.block_tables.shape,
                       batch.logits_indices.shape[1], num_steps)
        return cls("decode" if batch.decode else "mixed", batch.tokens.shape[0],
                   *batch.block_tables.shape, num_steps)

    @property
    def samples(self) -> bool:
        """Whether this program samples (a sampler, multi-step decode or verify program;
        not the forward half of a split step, nor prompt logprobs)."""
        return not self.split and self.kind != "prompt_logprobs"

    @property
    def split(self) -> bool:
        """Whether this step runs as a forward program, then a sampler program."""
        return self.kind in ("mixed", "decode") and self.n == 1 and not self.whole

    @property
    def sample_key(self) -> "StepKey":
        """The sampler program's key of a split step's S sequences."""
        return StepKey("sample", 0, self.S, 0, 1)


def _plan_rank(plan: SamplerPlan) -> tuple:
    """Warm-up order of plans: static ones, greedy first, the plainest first; then
    ON_DEVICE."""
    return (plan.mode is None, MODES.index(plan.mode) if plan.mode else 0,
            bool(plan.controls), bool(plan.top_logprobs))


def warmup_order(keys: set[StepKey]) -> list[StepKey]:
    """`keys` most likely first: one-sequence shapes by page count (the first: the shortest
    decode and prefill, what a first short request needs; multi-step decode after the
    single steps of the same page count), then the rest by size; each sequence bucket's
    sampler program right after the first forward program that needs it: the greedy
    batch's plan (or ON_DEVICE) there, the other plain ones (FUSED_PLANS: no controls, no
    top logprobs) at the end, then the rest; a mixed step's prompt-logprobs program
    right before the first forward of its T, whose warm-up run runs it."""
    prompts = {k for k in keys if k.kind == "prompt_logprobs"}
    samplers = {k for k in keys if k.kind == "sample"}
    order = sorted(keys - prompts - samplers,
                   key=lambda k: (False, k.P, k.n, k.T, k.kind, k.whole, _plan_rank(k.plan))
                   if k.S == 1 else (True, k.T * k.P, k.S, k.n, k.kind, k.whole,
                                     _plan_rank(k.plan)))
    out = []
    for key in order:
        prompt_key = StepKey("prompt_logprobs", key.T, 0, 0, 1)
        if key.kind == "mixed" and prompt_key in prompts:
            prompts.discard(prompt_key)
            out.append(prompt_key)
        out.append(key)
        if key.split:
            for plan in (FUSED_PLANS[0], ON_DEVICE):  # greedy; the device's
                sample_key = key.sample_key._replace(plan=plan)
                if sample_key in samplers:
                    samplers.discard(sample_key)
                    out.append(sample_key)
    return out + sorted(samplers, key=lambda k: (k.plan not in FUSED_PLANS, k.S,
                                                 _plan_rank(k.plan)))


def abstract_inputs(key: StepKey, sharding, max_logit_bias: int, vocab_size: int,
                    lora: bool = False) -> tuple[StepBatch, SamplingBatch, jax.ShapeDtypeStruct]:
    """The step's inputs for `key` as ShapeDtypeStructs placed with `sharding` (what a
    step is compiled ahead of time for): the batch (with its rows' LoRA slots when
    `lora`), the sampling arrays, and prev_index [T] int32 (Runner.dispatch)."""
    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    i32, f32 = jnp.int32, jnp.float32
    T, S, P = key.T, key.S, key.P
    batch = StepBatch(tokens=s((T,), i32), positions=s((T,), i32),
                      slot_mapping=s((T,), i32), block_tables=s((S, P), i32),
                      seq_lens=s((S,), i32), query_start=s((S + 1,), i32),
                      logits_indices=s((S, key.n) if key.kind == "verify" else (S,), i32),
                      decode=key.kind == "decode", lora_slot=s((T,), i32) if lora else None)
    controls = jax.tree.map(lambda a: s(a.shape, a.dtype),
                            LogitsControls.neutral(S, max_logit_bias, vocab_size))
    sampling = SamplingBatch(temperature=s((S,), f32), top_k=s((S,), i32), top_p=s((S,), f32),
                             min_p=s((S,), f32), seed=s((S, 2), jnp.uint32), step=s((S,), i32),
                             num_logprobs=s((S,), i32), controls=controls,
                             prompt_targets=s((T,), i32) if key.kind == "mixed" else None)
    return batch, sampling, s((T,), i32)


def abstract_sample_inputs(S: int, max_pages: int, sharding, logits_sharding,
                           max_logit_bias: int, vocab_size: int) -> tuple:
    """The sampler program's inputs for S sequences as ShapeDtypeStructs (what it is
    compiled ahead of time for; jaxserve.worker.step.sample_step): logits [S, vocab] f32
    placed with `logits_sharding` (the forward's), the sampling arrays (no prompt
    targets), block_tables [S, max_pages] int32 and num_context [S] int32."""
    _, sampling, _ = abstract_inputs(StepKey("decode", S, S, 1, 1), sharding, max_logit_bias,
                                     vocab_size)
    logits = jax.ShapeDtypeStruct((S, vocab_size), jnp.float32, sharding=logits_sharding)
    return (logits, sampling,
            jax.ShapeDtypeStruct((S, max_pages), jnp.int32, sharding=sharding),
            jax.ShapeDtypeStruct((S,), jnp.int32, sharding=sharding))
