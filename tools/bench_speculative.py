"""Speculative decoding against plain decoding, in one run on the same machine: decode
tokens per second of each, their ratio, and the acceptance that explains it.

    python -m tools.bench_speculative [--config configs/smollm2_135m.py]
        [--speculative-config JSON (default: configs/smollm2_135m_ngram.py's n-gram)]
        [--workload copy|chat|chat-hand|copy-hand] [--num-prompts 12] [--streams 1] [--also-sync]
        [--also-verify-steps N] [--json out.json]

Two engines of the config are built in this process, one plain and one with
`--speculative-config`; both are warmed up (every step shape compiled) before timing.
--streams 1: the prompts one at a time, greedy, `--max-tokens` each (default: the
workload's output_len); the engines alternate per prompt (which goes first alternates
too), so drift hits both alike. Decode tok/s of a request = (output tokens - 1) / (time
of its last token - time of its first): the prefill is not decoding. Also checked: each
prompt's greedy tokens under both engines (the same unless the kernels round a verify
step's rows differently from a decode step's; the count is printed).
--streams N > 1: both engines with max_num_seqs = N, all prompts submitted at once,
aggregate output tokens per second of the whole run, plain vs speculative (with
disable_by_batch_size as the JSON says, cut to N: where speculation switches itself off).
--also-sync: a third engine, speculative with async_scheduling off (every verify step read
before the next is planned), timed in the same rotation: what planning verify steps ahead
of the previous one's read gains.
--also-verify-steps N: another engine, speculative with `verify_steps` N (N verify rounds
per dispatched step), timed in the same rotation: what running the rounds on device gains.
Workloads: copy = jaxserve/bench/data/copy_prompts.jsonl (edit / quote tasks,
tools/make_copy_prompts.py), chat = jaxserve/bench/data/bench_prompts.jsonl (the serving
benchmark's prompts); chat-hand / copy-hand = jaxserve/bench/data/chat_handwritten.jsonl /
copy_handwritten.jsonl (written by hand in the style of real chat use: questions, advice,
code, emails, other languages; fixing, converting and reformatting text and code the
prompt gives; no generator and no text of the other sets' sources). All rendered with the
model's chat template.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
from jaxserve.bench.serve import DATA_DIR, DEFAULT_CONFIG, DEFAULT_DATASET, read_dataset

WORKLOADS = {"copy": DATA_DIR / "copy_prompts.jsonl", "chat": DEFAULT_DATASET,
             "chat-hand": DATA_DIR / "chat_handwritten.jsonl",
             "copy-hand": DATA_DIR / "copy_handwritten.jsonl"}
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, ' \
               '"prompt_lookup_min": 1}'  # configs/smollm2_135m_ngram.py's


def run_one(engine, rid: str, prompt_ids: list[int], params) -> dict:
    """Serve one request alone; its tokens and first / last token times (seconds)."""
    engine.add_request(rid, prompt_ids, params)
    first = last = None
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != rid:
                continue
            now = time.perf_counter()
            if o.new_token_ids:
                first = first or now
                last = now
            out = o
    return {"token_ids": out.token_ids, "first": first, "last": last}


def run_all(engine, prompts: list[list[int]], params, tag: str) -> dict:
    """All prompts at once; output tokens and wall seconds."""
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params[i])
    tokens = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += len(o.new_token_ids)
    return {"tokens": tokens, "seconds": time.perf_counter() - t0}


def spec_counters(engine, before: dict) -> dict:
    st = engine.stats().as_dict()
    keys = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens", "spec_decode_propose_seconds",
            "num_steps", "step_seconds", "host_seconds")
    d = {k: st[k] - before.get(k, 0) for k in keys}
    d["accepted_per_pos"] = [a - b for a, b in zip(
        st["spec_decode_num_accepted_tokens_per_pos"],
        before.get("spec_decode_num_accepted_tokens_per_pos") or [0] * 16)]
    d["mean_acceptance_length"] = (1 + d["spec_decode_num_accepted_tokens"] /
                                   d["spec_decode_num_drafts"]) if d["spec_decode_num_drafts"] else None
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--cache-dir")
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="copy")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="output tokens per request (default: the workload's output_len)")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--also-sync", action="store_true",
                    help="also time speculation with async_scheduling off")
    ap.add_argument("--also-verify-steps", type=int, default=None, metavar="N",
                    help="also time speculation with verify_steps N")
    ap.add_argument("--also-speculative-config", default=None, metavar="JSON",
                    help="also time another speculative config in the same rotation (an "
                         "A/B of two heads or proposers on the same machine and prompts)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)

    import jaxserve
    from jaxserve.config import load_config
    from jaxserve.sampling_params import SamplingParams

    config = load_config(args.config)
    entries = read_dataset(WORKLOADS[args.workload])[:args.num_prompts]
    fields = {"max_num_seqs": args.streams} if args.streams > 1 else {}
    spec_config = json.loads(args.speculative_config)
    if args.streams > 1:
        spec_config["disable_by_batch_size"] = min(
            args.streams, spec_config.get("disable_by_batch_size", args.streams))
    base = jaxserve.LLM(config, cache_dir=args.cache_dir, **fields)
    spec = jaxserve.LLM(config, cache_dir=args.cache_dir, speculative_config=spec_config,
                        **fields)
    llms = {"base": base, "spec": spec}
    if args.also_sync:
        llms["sync"] = jaxserve.LLM(config, cache_dir=args.cache_dir,
                                    speculative_config=spec_config, async_scheduling=False,
                                    **fields)
    if args.also_verify_steps:
        llms["rounds"] = jaxserve.LLM(
            config, cache_dir=args.cache_dir, speculative_config={
                **spec_config, "verify_steps": args.also_verify_steps}, **fields)
    if args.also_speculative_config:
        alt_config = json.loads(args.also_speculative_config)
        llms["alt"] = jaxserve.LLM(config, cache_dir=args.cache_dir,
                                   speculative_config=alt_config, **fields)
    tok = base.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": e.prompt}]),
                          add_special_tokens=False) for e in entries]
    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens or e.output_len)
              for e in entries]
    before = spec.engine.stats().as_dict()
    extra_before = {k: llms[k].engine.stats().as_dict() for k in ("rounds", "alt") if k in llms}
    result = {"config": args.config, "workload": args.workload, "streams": args.streams,
              "speculative_config": spec_config,
              "num_prompts": len(prompts)}
    if args.streams == 1:
        rows, same = [], 0
        order = [(name, llm.engine) for name, llm in llms.items()]
        for i, (ids, sp) in enumerate(zip(prompts, params)):
            got = {}
            turn = order[i % len(order):] + order[:i % len(order)]  # who goes first rotates
            for name, engine in (turn if i % 2 == 0 else turn[::-1]):
                got[name] = run_one(engine, f"{name}-{i}", ids, sp)
            same += all(v["token_ids"] == got["base"]["token_ids"] for v in got.values())
            rows.append({k: (len(v["token_ids"]) - 1, v["last"] - v["first"])
                         for k, v in got.items()})
        tps = {k: sum(r[k][0] for r in rows) / sum(r[k][1] for r in rows) for k in llms}
        result |= {"decode_tok_s": tps, "ratio": tps["spec"] / tps["base"],
                   "greedy_identical": f"{same}/{len(prompts)}",
                   "mean_output_tokens": sum(r["base"][0] + 1 for r in rows) / len(rows)}
    else:
        got = {name: run_all(llm.engine, prompts, params, name) for name, llm in llms.items()}
        tps = {k: v["tokens"] / v["seconds"] for k, v in got.items()}
        result |= {"throughput_tok_s": tps, "ratio": tps["spec"] / tps["base"]}
    result["spec"] = spec_counters(spec.engine, before)
    c = result["spec"]
    print(f"workload {args.workload}, {len(prompts)} prompts, streams {args.streams}, "
          f"spec {json.dumps(spec_config)}")
    for k, v in (result.get("decode_tok_s") or result["throughput_tok_s"]).items():
        print(f"  {k:5s} {v:8.1f} tok/s")
    print(f"  ratio spec / base: {result['ratio']:.2f}x")
    if "sync" in tps:
        result["ratio_sync"] = tps["sync"] / tps["base"]
        print(f"  ratio sync / base: {result['ratio_sync']:.2f}x; spec / sync "
              f"{tps['spec'] / tps['sync']:.2f}x (async_scheduling on / off)")
    if "rounds" in tps:
        result["ratio_rounds"] = tps["rounds"] / tps["base"]
        print(f"  ratio rounds / base: {result['ratio_rounds']:.2f}x; rounds / spec "
              f"{tps['rounds'] / tps['spec']:.2f}x (verify_steps {args.also_verify_steps} "
              f"against {spec_config.get('verify_steps', 1)})")
    if "alt" in tps:
        result["ratio_alt"] = tps["alt"] / tps["base"]
        result["alt_speculative_config"] = alt_config
        print(f"  ratio alt / base: {result['ratio_alt']:.2f}x; alt / spec "
              f"{tps['alt'] / tps['spec']:.2f}x (alt: {json.dumps(alt_config)})")
    for name in extra_before:
        result[name] = r = spec_counters(llms[name].engine, extra_before[name])
        print(f"  {name} engine: {r['num_steps']} steps, {r['step_seconds']:.2f} s in step(), "
              f"of which host {r['host_seconds']:.2f} s; mean acceptance length "
              f"{r['mean_acceptance_length'] and round(r['mean_acceptance_length'], 2)} "
              f"(per position {r['accepted_per_pos']})")
    if "greedy_identical" in result:
        print(f"  greedy tokens identical: {result['greedy_identical']}; mean output "
              f"{result['mean_output_tokens']:.0f} tokens")
    mal = c["mean_acceptance_length"]
    print(f"  proposals {c['spec_decode_num_drafts']}, draft tokens "
          f"{c['spec_decode_num_draft_tokens']}, accepted {c['spec_decode_num_accepted_tokens']}"
          f" (per position {c['accepted_per_pos']}), mean acceptance length "
          f"{mal if mal is None else round(mal, 2)}")
    print(f"  spec engine: {c['num_steps']} steps, {c['step_seconds']:.2f} s in step(), of "
          f"which host {c['host_seconds']:.2f} s (proposer {c['spec_decode_propose_seconds']:.3f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
