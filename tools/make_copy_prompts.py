"""Generate jaxserve/bench/data/copy_prompts.jsonl, the copy-heavy workload of speculative decoding's
n-gram benchmark (tools/bench_speculative.py --workload copy).

    python -m tools.make_copy_prompts [--out jaxserve/bench/data/copy_prompts.jsonl] [--seed 7]

Tasks whose answer repeats spans of the prompt, as editing and quoting do: rename a
function in a piece of code and give it back whole, fix the spelling in a paragraph,
replace a word throughout a passage, quote the sentences of a passage that mention a word.
Same schema as bench_prompts.jsonl ({"prompt", "output_len", "prompt_len", "source"}), the
text from the same offline sources (tools/make_bench_prompts.py: Python's documentation
and small standard-library functions), so it depends on the Python version in the same
way; the shipped file was generated with Python 3.11.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from tools.make_bench_prompts import code_snippets, cut_sentences, doc_texts, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "jaxserve" / "bench" / "data" / "copy_prompts.jsonl"
COUNTS = {"rename": 10, "spelling": 8, "replace": 8, "quote": 6}
OUTPUT_LEN = 192        # tokens asked for: the answers are about as long as the passages
PASSAGE_TOKENS = (120, 220)


def _typos(text: str, rng: random.Random, rate: float = 0.08) -> str:
    """`text` with about `rate` of its longer words misspelt (two letters swapped)."""
    def swap(m):
        w = m.group(0)
        if len(w) < 5 or rng.random() > rate:
            return w
        i = rng.randrange(1, len(w) - 2)
        return w[:i] + w[i + 1] + w[i] + w[i + 2:]
    return re.sub(r"[A-Za-z]+", swap, text)


def build(seed: int) -> list[dict]:
    rng = random.Random(seed)
    tok = load_tokenizer()
    count = lambda s: len(tok.encode(s, add_special_tokens=False).ids)  # noqa: E731
    entries = []

    def add(kind, prompt, source):
        entries.append({"prompt": prompt, "output_len": OUTPUT_LEN,
                        "prompt_len": count(prompt), "source": f"{kind}:{source}"})

    code = [(s, c) for s, c in code_snippets() if 100 <= count(c) <= 260]
    for src, c in rng.sample(code, COUNTS["rename"]):
        name = src.rsplit(".", 1)[1]
        add("rename", f"Rename the function `{name}` to `{name}_v2` in this code and reply with "
                      f"the complete modified code, nothing else.\n\n```python\n{c}\n```", src)
    docs = [(s, t) for s, t in doc_texts() if not s.startswith("license:")]
    prose = []
    for src, text in rng.sample(docs, len(docs)):
        p = cut_sentences(re.sub(r"\s+", " ", text), rng.randint(*PASSAGE_TOKENS), count)
        if count(p) >= PASSAGE_TOKENS[0]:
            prose.append((src, p))
    picks = iter(prose)
    for _ in range(COUNTS["spelling"]):
        src, p = next(picks)
        add("spelling", "Fix the spelling mistakes in this text and give back the full corrected "
                        f"text, changing nothing else:\n\n{_typos(p, rng)}", src)
    for _ in range(COUNTS["replace"]):
        src, p = next(picks)
        words = sorted({w for w in re.findall(r"[a-z]{5,}", p) if p.count(w) >= 2})
        word = rng.choice(words) if words else "the"
        add("replace", f'Rewrite the text below, replacing every "{word}" with "{word.upper()}". '
                       f"Change nothing else.\n\n{p}", src)
    for _ in range(COUNTS["quote"]):
        src, p = next(picks)
        words = sorted(set(re.findall(r"[a-z]{6,}", p)))
        word = rng.choice(words) if words else "object"
        add("quote", f'Quote, word for word, every sentence of this passage that mentions '
                     f'"{word}", then the sentence after each.\n\n{p}', src)
    rng.shuffle(entries)
    return entries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    entries = build(args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for e in entries:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")
    lens = sorted(e["prompt_len"] for e in entries)
    print(f"{len(entries)} prompts -> {args.out}; prompt tokens {lens[0]}..{lens[-1]}")


if __name__ == "__main__":
    main()
