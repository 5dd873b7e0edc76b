"""Per-token mask cost of the grammar engines jaxserve could use for structured output
(llguidance, xgrammar, outlines-core), on SmolLM2's vocabulary (49152 tokens), on this
machine.

For each grammar (a JSON schema, any JSON object, a regex) it compiles the grammar, then
replays a valid output token by token: compute the next-token bitmask ([vocab / 32]
int32, the layout all three write), check that the document's next token is allowed,
advance. It prints compile time and per-token mask time (mean, p50, p99, max, in us),
and each engine's mean as a ratio of the fastest one measured in the same run.

    python -m tools.measure_grammar_engines [--repeat 5]

The engines are optional here (`pip install llguidance xgrammar outlines-core`); one
that is not installed is reported as missing. xgrammar's wheel requires torch,
transformers and triton; install it with `--no-deps` plus `apache-tvm-ffi` to measure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from jaxserve.tokenization.tokenizer import byte_chars

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "role", "address"],
    "additionalProperties": False,
}
SCHEMA_DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                         "tags": ["math", "engines", "poetry"], "role": "admin",
                         "address": {"city": "London", "zip": "10115"}})
OBJECT_DOC = json.dumps({"model": "SmolLM2", "layers": 30, "tied": True, "heads": [9, 3],
                         "notes": "a small Llama-family model", "vocab": {"size": 49152}})
REGEX = r"\d{4}-\d{2}-\d{2} [A-Z][a-z]+ [0-9a-f]{8}"
REGEX_DOC = "2026-11-25 Wednesday 0123abcd"


class Vocab:
    """The tokenizer.json of the checkpoint: raw token strings, their bytes, EOS."""

    def __init__(self, tokenizer_json: Path):
        import tokenizers
        self.path = tokenizer_json
        self.tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        self.size = self.tok.get_vocab_size()
        raw = self.tok.get_vocab(with_added_tokens=True)
        self.raw = [""] * self.size
        for s, i in raw.items():
            self.raw[i] = s
        dec = {c: b for b, c in enumerate(byte_chars())}  # byte-level char -> byte
        self.special = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        self.bytes = [s.encode() if s in self.special else bytes(dec[c] for c in s)
                      for s in self.raw]
        self.eos = self.tok.token_to_id("<|im_end|>")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def replay(name, start, mask_into, advance, doc_ids, vocab_size, repeat):
    """Compile (start()) and replay doc_ids; returns (compile seconds, per-token seconds)."""
    compile_s, times = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        state = start()
        compile_s.append(time.perf_counter() - t0)
        mask = np.zeros((vocab_size + 31) // 32, np.int32)
        for t in doc_ids:
            t0 = time.perf_counter()
            mask_into(state, mask)
            times.append(time.perf_counter() - t0)
            if not allowed(mask, t):
                raise AssertionError(f"{name}: the document's token {t} is masked")
            advance(state, t)
    return min(compile_s), times


def llguidance_engine(vocab: Vocab):
    import llguidance
    tok = llguidance.LLTokenizer(str(vocab.path))
    grammars = {"schema": llguidance.LLMatcher.grammar_from_json_schema(SCHEMA),
                "json_object": llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}),
                "regex": llguidance.LLMatcher.grammar_from_regex(REGEX)}

    def start(kind):
        m = llguidance.LLMatcher(tok, grammars[kind])
        assert not m.is_error(), m.get_error()
        return m

    def mask_into(m, mask):
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    return start, mask_into, lambda m, t: m.consume_token(t)


def xgrammar_engine(vocab: Vocab):
    import torch
    import xgrammar as xgr
    info = xgr.TokenizerInfo(vocab.raw, vocab_type=xgr.VocabType.BYTE_LEVEL,
                             vocab_size=vocab.size, stop_token_ids=[vocab.eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, vocab.size)

    def start(kind):
        if kind == "schema":
            g = compiler.compile_json_schema(json.dumps(SCHEMA))
        elif kind == "json_object":
            g = compiler.compile_builtin_json_grammar()
        else:
            g = compiler.compile_regex(REGEX)
        return xgr.GrammarMatcher(g)

    def mask_into(m, mask):
        m.fill_next_token_bitmask(bitmask)
        mask[:] = bitmask[0].numpy()  # one copy of 6 KB: what handing it on costs anyway

    del torch
    return start, mask_into, lambda m, t: m.accept_token(t)


def outlines_engine(vocab: Vocab):
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    table: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab.bytes):
        if i != vocab.eos and vocab.raw[i] not in vocab.special:
            table.setdefault(b, []).append(i)
    voc = outlines_core.Vocabulary(vocab.eos, table)
    regexes = {"schema": build_regex_from_schema(json.dumps(SCHEMA)),
               "json_object": build_regex_from_schema(json.dumps({"type": "object"})),
               "regex": REGEX}

    def start(kind):
        return outlines_core.Guide(outlines_core.Index(regexes[kind], voc))

    def mask_into(g, mask):
        g.write_mask_into(mask.ctypes.data, mask.size, 4)

    return start, mask_into, lambda g, t: g.advance(t)


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine,
           "outlines-core": outlines_engine}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="replays of each document")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args(argv)
    from jaxserve.config import load_config
    from jaxserve.checkpoint.sources import default_cache_dir, resolve_checkpoint
    root = Path(__file__).resolve().parents[1]
    ckpt = resolve_checkpoint(load_config(root / "configs" / "smollm2_135m.py").source,
                              Path(args.cache_dir) if args.cache_dir else default_cache_dir())
    vocab = Vocab(Path(ckpt) / "tokenizer.json")
    docs = {"schema": SCHEMA_DOC, "json_object": OBJECT_DOC, "regex": REGEX_DOC}
    results = {}
    for name, make in ENGINES.items():
        try:
            start, mask_into, advance = make(vocab)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        for kind, doc in docs.items():
            ids = vocab.encode(doc)
            try:
                c, times = replay(name, lambda: start(kind), mask_into, advance, ids,
                                  vocab.size, args.repeat)
            except Exception as e:  # noqa: BLE001 - report the engine's failure, go on
                print(f"{name} {kind}: failed: {e!r}"[:300])
                continue
            us = np.array(times) * 1e6
            results[(name, kind)] = us.mean()
            print(f"{name:14s} {kind:12s} compile {c * 1e3:8.1f} ms   per token: mean "
                  f"{us.mean():7.1f} us  p50 {np.percentile(us, 50):7.1f}  p99 "
                  f"{np.percentile(us, 99):7.1f}  max {us.max():8.1f}   ({len(ids)} tokens)")
    print("\nmean per-token mask time / the fastest engine's, per grammar:")
    for kind in docs:
        got = {n: v for (n, k), v in results.items() if k == kind}
        if got:
            best = min(got.values())
            print(f"  {kind:12s} " + "  ".join(f"{n} {v / best:5.2f}x" for n, v in got.items()))
    if results:
        print("\nall grammars, geometric mean ratio: " + "  ".join(
            f"{n} {statistics.geometric_mean([results[(n, k)] / min(v for (m, kk), v in results.items() if kk == k) for k in docs if (n, k) in results]):.2f}x"
            for n in ENGINES if any(k[0] == n for k in results)))


if __name__ == "__main__":
    main()
