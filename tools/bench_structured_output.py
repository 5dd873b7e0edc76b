"""What structured output costs per token on the real model: the engine's decode rate of
a batch of free requests (the baseline, measured in the same run) against the same batch
constrained by a JSON schema, and a mixed batch (half and half: the free half's rate
shows whether constrained neighbours hold it up).

    python -m tools.bench_structured_output [--config configs/smollm2_135m.py]
        [--batch 8] [--max-tokens 96] [--repeats 3] [--jump-forward on,off]

Each request is a chat prompt asking for a JSON person record, sampled at temperature 0.8
with its own seed; a free request runs to max_tokens (ignore_eos), a constrained one
until its JSON closes. Per request: output tokens / seconds from the batch's start to its
last token, and the decode rate (output tokens after the first / seconds from the first
to the last: 1 / TPOT), which does not charge the shorter constrained outputs more of
the batch's prefill; printed as the mean per class, with ratios to the all-free batch.
Also the host time the grammar engine took per bitmask (the matcher's masks and
advances, timed in-process, over the masks computed), and the share of the constrained
tokens that jump-forward added without sampling them. With --jump-forward on,off each
value gets an engine of its own (SchedulerConfig.jump_forward), measured one after the
other with its own all-free baseline; the tokens a request's grammar forces at admission
(before its first sampled token) count in its tokens, not in its decode rate. A
benchmark, not a test: run it alone on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 30},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                    "maxItems": 4},
        "role": {"enum": ["engineer", "artist", "teacher", "doctor"]},
    },
    "required": ["name", "age", "city", "hobbies", "role"],
    "additionalProperties": False,
}


class TimedMatcher:
    """A GrammarMatcher wrapper that adds up the host seconds its mask and advance take."""

    total = 0.0
    calls = 0

    def __init__(self, inner):
        self.inner = inner

    def fill_bitmask(self, out):
        t0 = time.perf_counter()
        self.inner.fill_bitmask(out)
        TimedMatcher.total += time.perf_counter() - t0
        TimedMatcher.calls += 1

    def accept(self, token):
        t0 = time.perf_counter()
        ok = self.inner.accept(token)
        TimedMatcher.total += time.perf_counter() - t0
        return ok

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run(engine, prompts, params) -> list[tuple[int, float, float, bool]]:
    """(output tokens, of them forced at admission, seconds to the first sampled one,
    seconds to the last one, constrained) per request, batch at once."""
    ids, first, forced = {}, {}, {}
    t0 = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        rid = f"r{time.monotonic_ns()}-{i}"
        engine.add_request(rid, p, sp)
        seq = engine.scheduler.requests[rid]
        forced[rid] = len(seq.output_ids)  # what its grammar forced at admission
        if seq.matcher is not None:
            seq.matcher = TimedMatcher(seq.matcher)
        ids[rid] = sp.structured_outputs is not None
    out = {}
    while len(out) < len(ids):
        for o in engine.step():
            if o.request_id not in ids:
                continue
            if len(o.token_ids) > forced[o.request_id] and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            if o.finished:
                if ids[o.request_id]:
                    json.loads(o.text)  # the constrained ones must parse
                out[o.request_id] = (len(o.token_ids), forced[o.request_id],
                                     first[o.request_id], time.perf_counter() - t0,
                                     ids[o.request_id])
    return list(out.values())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2_135m.py"))
    ap.add_argument("--cache-dir")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--jump-forward", default="on",
                    help="SchedulerConfig.jump_forward values, comma-separated: on, off")
    args = ap.parse_args(argv)
    values = args.jump_forward.split(",")
    if not values or any(v not in ("on", "off") for v in values):
        ap.error(f"--jump-forward: expected on and / or off, got {args.jump_forward!r}")
    for v in values:
        print(f"jump_forward {v}:")
        bench(args, v == "on")


def bench(args, jump_forward: bool) -> None:
    """One engine with jump_forward as given: every variant, `args.repeats` times."""
    from jaxserve.api import LLM
    from jaxserve.sampling_params import SamplingParams
    from jaxserve.sample.grammar import StructuredOutput
    llm = LLM(args.config, cache_dir=args.cache_dir, jump_forward=jump_forward)
    engine, tok = llm.engine, llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": f"Invent person number {i} and describe them as JSON."}],
        add_generation_prompt=True), add_special_tokens=False) for i in range(args.batch)]
    spec = StructuredOutput("json", json.dumps(SCHEMA))

    def params(constrained: list[bool]):
        return [SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i,
                               ignore_eos=not c, structured_outputs=spec if c else None)
                for i, c in enumerate(constrained)]

    B = args.batch
    variants = {"free": [False] * B, "constrained": [True] * B,
                "mixed": [i % 2 == 1 for i in range(B)]}
    run(engine, prompts, params([True] * B))  # warm the grammar tokenizer and shapes
    rates: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, kind in variants.items():
            TimedMatcher.total, TimedMatcher.calls = 0.0, 0
            forced0, constrained_tokens = engine.num_forced_tokens, 0
            for n, n0, first, last, c in run(engine, prompts, params(kind)):
                constrained_tokens += n if c else 0
                key = f"{name}/{'constrained' if c else 'free'}"
                rates.setdefault(key, []).append(n / last)
                rates.setdefault(key + " decode", []).append((n - n0 - 1) / (last - first))
            if TimedMatcher.calls:
                rates.setdefault(f"{name}/grammar_us_per_token", []).append(
                    TimedMatcher.total / TimedMatcher.calls * 1e6)
                rates.setdefault(f"{name}/forced_share", []).append(
                    (engine.num_forced_tokens - forced0) / constrained_tokens)
    print(f"{B} requests, max_tokens {args.max_tokens}, {args.repeats} repeats; "
          f"tokens/s per request (mean):")
    for key, values in rates.items():
        if key.endswith("grammar_us_per_token"):
            print(f"  {key:36s} {statistics.mean(values):8.1f} us (per bitmask)")
            continue
        if key.endswith("forced_share"):
            print(f"  {key:36s} {statistics.mean(values):8.1%} of the constrained tokens "
                  "forced (jump-forward)")
            continue
        base = statistics.mean(rates["free/free decode" if key.endswith("decode")
                                     else "free/free"])
        print(f"  {key:36s} {statistics.mean(values):8.1f}   x{statistics.mean(values) / base:.3f}"
              " of all-free")


if __name__ == "__main__":
    main()
