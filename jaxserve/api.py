"""Programmatic API: `LLM` holds a loaded engine for repeated calls; `generate` is one-shot.

    llm = jaxserve.LLM("configs/smollm2_135m.py")
    outs = llm.generate(["Hello"], jaxserve.SamplingParams(max_tokens=32, temperature=0))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

Source: vLLM's `LLM.generate` (offline batched inference).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path
from typing import Sequence

from jaxserve.checkpoint.sources import source_from_path
from jaxserve.config import Config, ConfigError, load_config
from jaxserve.engine.builder import build_engine
from jaxserve.engine.engine import Engine
from jaxserve.lora.request import LoRARequest
from jaxserve.sampling_params import InvalidRequest, SamplingParams

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "smollm2_135m.py"


@dataclasses.dataclass
class Completion:
    """One prompt's result: generated text and token ids, why it stopped, prompt length;
    with SamplingParams.logprobs / prompt_logprobs, a TokenLogprobs per output / prompt
    token (jaxserve.engine.sequence; the first prompt token's is None), else None."""

    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class LLM:
    """A loaded engine for repeated `generate` calls (like vLLM's `LLM`).

    `config`: a Config, a path to a config file, or None for the default (SmolLM2-135M).
    `model`: a local path (HF directory, .gguf file or jaxserve checkpoint) whose weights
    replace the config's source (vLLM's `model`; jaxserve.checkpoint.sources.source_from_path).
    `engine`: an already built Engine (then config/cache_dir are ignored).
    `**fields`: overrides by name (Config.override): `tensor_parallel_size=2`,
    `load_format="dummy"`, `num_layers=2`, `tokenizer=DIR`, and EngineConfig fields
    (`max_num_seqs=8`, `max_num_batched_tokens=256`, `enable_chunked_prefill=False`: see
    EngineConfig.override). Raises ConfigError for an unknown name or bad value.
    """

    def __init__(self, config: Config | str | Path | None = None, *, model: str | Path | None = None,
                 cache_dir: str | Path | None = None, warmup: bool = True,
                 engine: Engine | None = None, **fields):
        if engine is None:
            if not isinstance(config, Config):
                config = load_config(config or DEFAULT_CONFIG)
            if model is not None:
                fields["source"] = source_from_path(model)
            if fields:
                config = config.override(**fields)
            engine = build_engine(config, cache_dir, warmup=warmup)
        elif fields or model is not None:
            raise ConfigError(f"LLM: overrides {sorted(fields) + (['model'] if model else [])} "
                              "need a config, not a built engine")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[Completion]:
        """Generate for each prompt (text, or token ids) with continuous batching.

        `sampling_params`: one for all prompts, or one per prompt (default: SamplingParams()).
        `lora_request`: the LoRA adapter to run with (vLLM's argument; the engine built with
        enable_lora), one for all prompts or one (or None: the base) per prompt; an adapter
        not served yet is loaded from its lora_path first.
        Returns one Completion per prompt, in order. Raises InvalidRequest for a bad prompt
        or adapter (nothing is left queued in the engine).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise InvalidRequest("sampling_params", f"got {len(sampling_params)} for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise InvalidRequest("lora_request", f"got {len(lora_request)} for {len(prompts)} prompts")
        for req in {r for r in lora_request if r is not None}:
            self._ensure_lora(req)
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        rids = [f"gen-{next(self._ids)}" for _ in prompts]
        done: dict[str, object] = {}
        wanted = set(rids)
        try:
            for rid, tok, sp, lr in zip(rids, ids, sampling_params, lora_request):
                self.engine.add_request(rid, tok, sp, None if lr is None else lr.lora_name)
            while len(done) < len(rids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
        finally:
            for rid in rids:
                if rid not in done:
                    self.engine.abort_request(rid)
        return [Completion(prompt=p, text=done[r].text, token_ids=done[r].token_ids,
                           finish_reason=done[r].finish_reason, num_prompt_tokens=len(t),
                           logprobs=done[r].logprobs, prompt_logprobs=done[r].prompt_logprobs)
                for p, r, t in zip(prompts, rids, ids)]

    def embed(self, prompts: str | Sequence[str] | Sequence[Sequence[int]]
              ) -> list[list[float]]:
        """The embedding of each prompt (text, or token ids): its final hidden states pooled
        as the engine's EngineConfig.pooling says ("last" / "mean"), L2-normalised,
        [hidden_size] floats each, in order; prefilled with continuous batching, nothing
        generated, no KV kept. Raises InvalidRequest for a bad prompt, or field "pooling"
        when the engine was built without pooling. Source: vLLM's `LLM.embed`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        rids = [f"embd-{next(self._ids)}" for _ in ids]
        done: dict[str, list] = {}
        try:
            for rid, tok in zip(rids, ids):
                self.engine.add_request(rid, tok, SamplingParams(), embed=True)
            while len(done) < len(rids):
                for out in self.engine.step():
                    if out.finished and out.request_id in rids:
                        if out.embedding is None:
                            raise InvalidRequest("prompt", f"embedding failed: {out.error}")
                        done[out.request_id] = out.embedding
        finally:
            for rid in rids:
                if rid not in done:
                    self.engine.abort_request(rid)
        return [done[r] for r in rids]

    def _ensure_lora(self, req: LoRARequest) -> None:
        """Serve `req`'s adapter if it is not served yet. Raises InvalidRequest for an
        adapter that cannot be served (or LoRA off)."""
        if req.lora_name in self.engine.lora_names():
            return
        try:
            self.engine.add_lora(req.lora_name, req.lora_path)
        except ValueError as e:  # AdapterError, or LoRA off
            raise InvalidRequest("lora_request", str(e)) from None


def generate(prompts, sampling_params=None, config: Config | str | Path | None = None,
             cache_dir: str | Path | None = None) -> list[Completion]:
    """Generate with the engine of `config` (default SmolLM2-135M): `LLM.generate`'s
    arguments and result. The engine is built on the first call and kept for the next
    calls with the same config and cache_dir (one engine: a call with another config
    replaces it); `LLM` holds one explicitly, and jaxserve.functional.generate is the pure
    function for research code. Raises what LLM and LLM.generate raise."""
    if not isinstance(config, Config):
        config = load_config(config or DEFAULT_CONFIG)
    return _kept_llm(config, None if cache_dir is None else Path(cache_dir)).generate(
        prompts, sampling_params)


@functools.lru_cache(maxsize=1)
def _kept_llm(config: Config, cache_dir: Path | None) -> LLM:
    """The LLM `generate` reuses (Config is frozen and hashable: equal configs, one engine)."""
    return LLM(config, cache_dir=cache_dir)
