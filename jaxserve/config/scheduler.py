"""The scheduler's group (SchedulerConfig): what one step may hold."""

from __future__ import annotations

import dataclasses

from jaxserve.config.kernel import GPU_PLATFORMS
from jaxserve.config.validation import ConfigError, _positive

# decode_steps "auto" on a GPU (SchedulerConfig.resolve)
AUTO_DECODE_STEPS = 8


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold (vLLM's SchedulerConfig)."""

    max_num_seqs: int = 32
    """Most sequences running (each decodes one token per step)."""
    max_num_batched_tokens: int = 2048
    """Token rows one step computes (its budget: decode tokens first, then prompt chunks;
    jaxserve.engine.scheduler). At least max_num_seqs, so that every running sequence
    decodes in every step."""
    enable_chunked_prefill: bool = True
    """Split a prompt longer than what is left of a step's budget across steps (its last
    chunk samples). Off: a prompt is prefilled whole, so the budget must hold
    max_model_len tokens (as in vLLM)."""
    dynamic_chunking_keys: int | None = None
    """Dynamic chunking (with chunked prefill): size a prompt chunk by its attention's cost
    as well as its rows. A row attends to every key before it, so a chunk late in a long
    prompt costs more than its first, and the streams decoding beside it wait longer. With
    K set (keys a row attends to that cost as much as the row's own matmuls), a chunk of n
    rows after L computed tokens of its sequence costs n + (n * L + n * (n + 1) / 2) / K
    token rows, and it is cut to the longest whose cost stays within that of the rows left
    at L = 0 (at least one token). Chunks from L <= max_num_batched_tokens (a prompt's
    first two, a short cached prefix) are never cut, so a prompt's later chunks take about
    its first one's time. Only in steps that decode (a prompt alone is chunked as without
    it: no stream waits on its steps); decode rows are never cut.
    None: every chunk takes the rows left (vLLM). Source: SGLang's
    --enable-dynamic-chunking, which fits the same quadratic cost to timed prefills at
    start-up and solves it for each next chunk (here K comes from the config); Sarathi-Serve
    (Agrawal et al., 2024) sizes its per-step budget by the step's time."""
    decode_steps: int | None = 1
    """Tokens each sequence decodes per dispatched step when no request is waiting and
    every sequence of the batch has that many tokens left (multi-step decode: the host
    loop, the dispatch and the output processing run once per decode_steps tokens; tokens
    then stream in bursts of that many, and a sequence that stops early wastes the rest of
    its burst). 1 = one token per step. Each decode bucket is then compiled for both.
    None ("auto"): chosen for the platform when the engine is built (`resolve`):
    AUTO_DECODE_STEPS on a GPU, 1 elsewhere. Source: vLLM's num_scheduler_steps."""
    async_scheduling: bool = True
    """Plan and dispatch step N+1 before step N's tokens reach the host, so that the host's
    work (scheduling, batch building, detokenising) overlaps the device's: step N+1 reads
    the tokens it needs from step N's outputs on device; with speculative decoding, the
    next verify step is dispatched before the current one's accepted counts are read, its
    positions shifted on device (jaxserve.engine.engine). Off: every step's tokens are read
    before the next is planned (the output is the same; for debugging and A/B
    measurement). Source: vLLM's --async-scheduling."""

    jump_forward: bool = True
    """Structured output: the tokens a request's grammar forces next (llguidance's
    fast-forward tokens: a JSON schema's keys and punctuation, a choice's rest) join its
    output as soon as the token before them is read, and its next step computes them as
    one chunk, sampling after the last, instead of sampling them a step each. The text is
    the grammar's; its tokens are the tokenizer's canonical ones, which the model might
    have split otherwise. Not for a request that asks for logprobs (a forced token has
    none). Off: every output token is sampled. Source: SGLang's jump-forward decoding
    (Zheng et al., 2024, "SGLang: Efficient Execution of Structured Language Model
    Programs")."""

    def __post_init__(self):
        _positive("SchedulerConfig", self, ("max_num_seqs", "max_num_batched_tokens")
                  + (("decode_steps",) if self.decode_steps is not None else ())
                  + (("dynamic_chunking_keys",) if self.dynamic_chunking_keys is not None
                     else ()))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) "
                              f"must be at least max_num_seqs ({self.max_num_seqs}): every "
                              "running sequence decodes a token in every step")

    def resolve(self, platform: str) -> "SchedulerConfig":
        """This config with decode_steps None ("auto") chosen for `platform` (a
        jax.Device.platform): AUTO_DECODE_STEPS on a GPU, 1 elsewhere. Why: on an H100
        serving Llama-3-8B (PERFORMANCE.md, "The GPU run of session 24") 8 tokens a
        dispatch gave 160 tok/s at one stream and 4,965 at 64 where 1 gave 141 and 4,253:
        the host's ~5 ms a step (most of it XLA's update and launch of the forward's
        CUDA graph of ~780 kernels) is near the device's ~7 ms, and a faster GPU's step
        is shorter still. On CPU the shipped configs set it by measurement
        (configs/smollm2_135m.py: 8); "auto" keeps 1 there, where a decode step of a
        large batch takes long enough that a burst would hold a waiting prompt back by
        hundreds of milliseconds."""
        if self.decode_steps is not None:
            return self
        steps = AUTO_DECODE_STEPS if platform in GPU_PLATFORMS else 1
        return dataclasses.replace(self, decode_steps=steps)
