"""What the real-model tests of the served formats share (GGUF blocks, quantised HF
checkpoints, int8 / int4 / fp8, fp8 K/V): the f32 reference engine's outputs
(`float_outputs_of`, the conftest fixture `float_outputs`) and the check of a variant's
next-token distributions against them, tools/quant_accuracy.py's measures on the first
window of its text."""

from __future__ import annotations

import numpy as np

from tools import quant_accuracy

# the f32 reference variant of tools/quant_accuracy.py, without warm-up
XLA_F32 = dict(quant_accuracy.XLA_F32, warmup=False, max_num_seqs=8)
NEXT_TOKEN_PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Water boils at",
    "The largest planet in the solar system is", "Once upon a time", "import numpy as np\n",
    "The quick brown fox", "In 1492, Columbus"]
ACCURACY_WINDOW = 384  # tokens of tests/data/accuracy_text.txt, BOS first (one window)

# Bounds of the served formats against the f32 model (tools/quant_accuracy.py gives
# the whole text's table: PERFORMANCE.md, "Accuracy of the served formats"). An 8-bit
# rounding (x per 32-block in the C++ kernel, Q8_0 weights, an fp8 K/V element) moves an
# element by at most half a step of its block's largest value / 127 (or 2^-4 of itself):
# the bound for an 8-bit rounding, KL <= 0.01 nats, holds for one; q8_0 serving
# adds a second (the weights'), so twice that. Plain top-1 agreement is not bounded:
# SmolLM2-135M's next-token distributions are flat (perplexity ~21 on this text) and its
# argmax flips at near-ties (measured 0.96 for both); where the f32 model's two most
# likely tokens are >= 1 nat apart (quant_accuracy.CONFIDENT_MARGIN, ~6x the ~0.15 nats
# these roundings move a log-probability) none may flip. A wrong panel, nibble or scale
# gives KL of O(1).
ONE_ROUNDING_KL = 0.01


def accuracy_window(llm) -> list[int]:
    """The first ACCURACY_WINDOW tokens of the accuracy text, BOS first."""
    tok = llm.tokenizer
    ids = tok.encode(quant_accuracy.DEFAULT_TEXT.read_text(), add_special_tokens=False)
    return quant_accuracy.windows(ids, ACCURACY_WINDOW, tok.bos_token_id)[0]


def float_outputs_of(gguf, cache_dir):
    """The GGUF file dequantised to f32 (the bf16 preset's conversion), served with XLA's
    matmuls and attention and f32 K/V: (the two most likely next tokens of each
    NEXT_TOKEN_PROMPTS with their log-probabilities, ((token, logprob), (token, logprob)),
    the teacher-forced next-token log-probabilities [383, vocab] of the accuracy text's
    first window and its next tokens [383])."""
    import jaxserve
    from jaxserve import SamplingParams
    llm = jaxserve.LLM("smollm2_135m_bf16", model=gguf, cache_dir=cache_dir, **XLA_F32)
    next_tokens = [tuple(c.logprobs[0].top[:2]) for c in llm.generate(
        NEXT_TOKEN_PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, logprobs=2))]
    return next_tokens, quant_accuracy.next_token_logprobs(llm, [accuracy_window(llm)])


def assert_same_next_tokens(got: list[int], float_outputs) -> None:
    """`got`, a served model's greedy next token of each NEXT_TOKEN_PROMPTS, against the
    f32 model's: the same token wherever the f32 model's two most likely are
    quant_accuracy.CONFIDENT_MARGIN apart, and one of those two at a near-tie (where a
    rounding may flip the argmax: "In 1492, Columbus" is 0.14 nats from a flip)."""
    for prompt, token, ((first, lp1), (second, lp2)) in zip(NEXT_TOKEN_PROMPTS, got,
                                                            float_outputs[0], strict=True):
        if lp1 - lp2 >= quant_accuracy.CONFIDENT_MARGIN:
            assert token == first, (prompt, token, first)
        else:
            assert token in (first, second), (prompt, token, first, second)


def assert_close_distributions(llm, float_outputs, max_kl: float) -> dict:
    """`llm`'s teacher-forced next-token distributions over the accuracy window against
    the f32 engine's: mean KL(f32 || llm) <= max_kl nats, the same most likely token
    wherever the f32 model's top two are >= 1 nat apart (tools/quant_accuracy.py's
    measures). Returns them."""
    ref_logp, targets = float_outputs[1]
    logp, got_targets = quant_accuracy.next_token_logprobs(llm, [accuracy_window(llm)])
    np.testing.assert_array_equal(got_targets, targets)
    r = quant_accuracy.compare(ref_logp, logp, targets)
    assert r["kl"] <= max_kl and r["top1_confident"] == 1.0 and r["confident"] > 0.3, r
    return r
