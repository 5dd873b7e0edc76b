"""The real model (SmolLM2-135M-Instruct) against HF transformers (torch, f32) on the same
dequantised GGUF weights.

1. Teacher-forced logits of our paged forward (the prompt's first part as one prefill
   step over shuffled pages, the rest as single-token decode steps) vs HF's all-position
   logits: max |diff| <= 1e-3.
2. Greedy 64-token continuations through the whole engine (`LLM.generate`, all prompts
   batched together) vs HF's greedy loop: identical, except that they may part after a
   step where HF's top-2 logit margin was below 1e-3 (a near tie that f32 rounding may
   break either way).
"""

import numpy as np
import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

LOGIT_ATOL = 1e-3
TIE_MARGIN = 1e-3
N_GREEDY = 64
N_DECODE = 6  # teacher-forced tokens fed one at a time after the prefill step

CODE = '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    out = [0, 1]
    while len(out) < n:
        out.append(out[-1] + out[-2])
    return out[:n]
'''

LONG = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based inks and a wooden screw press. ") * 6 + \
       "Summarise the paragraph above in one sentence."


@pytest.fixture(scope="module")
def prompts(small_llm):
    tok = small_llm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    texts = {
        "ascii": ("The quick brown fox jumps over the lazy dog.", True),
        "unicode": ("Grüße aus München! 東京の天気は晴れです。 Ça va très bien 🌸🚀 — naïve café", True),
        "code": (CODE, True),
        "chat": (chat, False),
        "long": (LONG, True),
    }
    ids = {name: tok.encode(text, add_special_tokens=special) for name, (text, special) in texts.items()}
    assert len(ids["long"]) > 8 * 16, "the long prompt must span several pages"
    assert len(ids["long"]) + N_GREEDY <= small_llm.engine.engine_config.max_model_len
    return ids


@pytest.fixture(scope="module")
def model(smollm2_checkpoint):
    from jaxserve.checkpoint import load_model_config, load_params
    cfg = load_model_config(smollm2_checkpoint)
    return cfg, load_params(smollm2_checkpoint, cfg)


def hf_logits(hf_model, ids):
    import torch
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(hf_model, ids, n):
    """HF greedy loop (KV cache): tokens and the top-2 logit margin at each step."""
    import torch
    tokens, margins = [], []
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            logits = out.logits[0, -1]
            top2 = torch.topk(logits, 2).values
            margins.append(float(top2[0] - top2[1]))
            tokens.append(int(logits.argmax()))
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                           use_cache=True)
    return tokens, margins


@pytest.mark.parametrize("name", ["ascii", "unicode", "code", "chat", "long"])
def test_teacher_forced_logits_match_hf(name, prompts, model, hf_smollm2_model):
    from model_utils import PagedDriver
    cfg, params = model
    ids = prompts[name]
    want = hf_logits(hf_smollm2_model, ids)
    driver = PagedDriver(params, cfg, num_pages=48, page_size=16, seed=len(ids))
    n_prefill = len(ids) - N_DECODE
    Q = 1 << (n_prefill - 1).bit_length()
    P = 40
    got = [driver.step({"s": ids[:n_prefill]}, Q=Q, P=P)["s"]]
    for t in ids[n_prefill:]:
        got.append(driver.step({"s": [t]}, Q=1, P=P)["s"])
    got = np.concatenate(got)
    assert got.shape == want.shape
    diff = np.abs(got - want).max()
    assert diff <= LOGIT_ATOL, f"{name}: max |logit diff| {diff:.2e} over {len(ids)} tokens"


def test_greedy_continuations_match_hf(prompts, small_llm, hf_smollm2_model):
    from jaxserve import SamplingParams
    names = list(prompts)
    outs = small_llm.generate([prompts[n] for n in names],
                              SamplingParams(max_tokens=N_GREEDY, temperature=0, ignore_eos=True))
    for name, out in zip(names, outs):
        want, margins = hf_greedy(hf_smollm2_model, prompts[name], N_GREEDY)
        got = out.token_ids
        assert len(got) == N_GREEDY and out.finish_reason == "length"
        first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first_diff is not None:
            closest = min(margins[:first_diff + 1])
            assert closest < TIE_MARGIN, (
                f"{name}: diverged at token {first_diff} ({got[first_diff]} vs HF "
                f"{want[first_diff]}) with no near tie before it (smallest top-2 margin {closest:.2e})")
