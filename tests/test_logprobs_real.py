"""Logprobs on the real model through the OpenAI API, against HF transformers' log-softmax
on the same dequantised weights (tests/hf_reference.py).

The test engine serves f32 matmuls, whose logits are within 1e-3 of HF's
(tests/test_real_model_parity.py); a log-softmax adds at most that again (its log-sum-exp
moves by at most the largest logit error), so logprobs agree within 2e-3.
"""

import json

import numpy as np
import pytest

LOGPROB_ATOL = 2 * 1e-3
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def client(small_llm_client):
    return small_llm_client


def hf_log_softmax(hf_model, ids):
    import torch
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def sse(resp) -> list[dict]:
    out = []
    for line in resp.text.split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


def test_completion_echo_logprobs_match_hf(client, small_llm, hf_smollm2_model):
    """echo + logprobs=5 (lm-eval's loglikelihood request, with top 5): every prompt and
    output token's logprob and its top 5 equal HF's log-softmax; the first prompt token's
    are null; the text is prompt + completion; a request without logprobs samples the same
    tokens; nothing compiles for it."""
    engine = small_llm.engine
    compiled = engine.num_compilations
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    plain = client.post("/v1/completions", json=body).json()
    r = client.post("/v1/completions", json={**body, "logprobs": 5, "echo": True}).json()
    assert engine.num_compilations == compiled, "logprobs run in the warmed-up executables"
    choice = r["choices"][0]
    assert choice["text"] == PROMPT + plain["choices"][0]["text"]
    lp = choice["logprobs"]
    tok = small_llm.tokenizer
    prompt_ids = tok.encode(PROMPT)
    n_prompt = len(prompt_ids)
    assert len(lp["tokens"]) == n_prompt + 4 == r["usage"]["total_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    out_ids = [tok.encode(t, add_special_tokens=False) for t in lp["tokens"][n_prompt:]]
    ids = prompt_ids + [i[0] for i in out_ids]
    assert [tok.decode([i], skip_special_tokens=False) for i in ids] == lp["tokens"]
    assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1])
    ref = hf_log_softmax(hf_smollm2_model, ids)
    for pos in range(1, len(ids)):
        want = ref[pos - 1]
        assert abs(lp["token_logprobs"][pos] - want[ids[pos]]) <= LOGPROB_ATOL, pos
        top = lp["top_logprobs"][pos]
        want_top = np.sort(want)[::-1][:5]
        got_top = sorted(top.values(), reverse=True)
        # the sampled token is always in the dict: 5 entries, or 6 when it is not a top 5
        assert len(top) in (5, 6) and (len(top) == 5) == (want[ids[pos]] >= want_top[-1] - 1e-9)
        np.testing.assert_allclose(got_top[:5], want_top, atol=LOGPROB_ATOL)
    # greedy output tokens are the top token at each output position
    for pos in range(n_prompt, len(ids)):
        assert lp["token_logprobs"][pos] == max(lp["top_logprobs"][pos].values())


def test_chat_logprobs_streamed_equal_non_streamed_and_completions(client, small_llm):
    """Chat `logprobs` + `top_logprobs` (OpenAI's chat shape): the streamed chunks' entries,
    joined, equal the non-streamed response's; the tokens and values are those a
    completions request of the same prompt token ids reports."""
    messages = [{"role": "user", "content": "Name three colours."}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    full = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    chunks = sse(client.post("/v1/chat/completions", json={**body, "stream": True}))
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"]
                for e in ch["logprobs"]["content"]]
    # the later requests take the prompt's pages from the prefix cache: their prefill is
    # split otherwise, so f32 rounding differs (measured 8e-6)
    assert len(streamed) == len(full["content"]) == 8
    for a, b in zip(streamed, full["content"]):
        assert [a["token"]] + [t["token"] for t in a["top_logprobs"]] == \
            [b["token"]] + [t["token"] for t in b["top_logprobs"]]
        np.testing.assert_allclose([a["logprob"]] + [t["logprob"] for t in a["top_logprobs"]],
                                   [b["logprob"]] + [t["logprob"] for t in b["top_logprobs"]],
                                   atol=1e-4)
    for e in streamed:
        assert e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][-1]["logprob"]
    tok = small_llm.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                     add_special_tokens=False)
    ref = client.post("/v1/completions", json={
        "prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 3}).json()
    ref = ref["choices"][0]["logprobs"]
    assert [e["token"] for e in streamed] == ref["tokens"]
    np.testing.assert_allclose([e["logprob"] for e in streamed], ref["token_logprobs"],
                               rtol=0, atol=1e-4)
    for e, top in zip(streamed, ref["top_logprobs"]):
        assert {t["token"] for t in e["top_logprobs"]} <= set(top)
    no = client.post("/v1/chat/completions", json={**body, "logprobs": False,
                                                   "top_logprobs": 0}).json()
    assert no["choices"][0]["logprobs"] is None


def test_penalties_and_bias_reach_the_model(client):
    """Through the API on the real model: logit_bias forces a token, a large repetition or
    frequency penalty changes a greedy continuation that repeats itself, min_tokens holds
    back a forced EOS."""
    prompt = "one two three one two three one two three one two three"
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}

    def text(**kw):
        return client.post("/v1/completions", json={**body, **kw}).json()["choices"][0]

    base = text()["text"]
    assert base.count(" one") >= 2, "the greedy continuation repeats the pattern"
    assert text(repetition_penalty=2.0)["text"] != base
    assert text(frequency_penalty=2.0, presence_penalty=2.0)["text"] != base
    forced = text(logit_bias={"45": 100}, max_tokens=3)  # token 45: "="
    assert forced["text"] == "===", forced
    eos = 2  # <|im_end|>
    assert text(logit_bias={str(eos): 100})["finish_reason"] == "stop"
    held = text(logit_bias={str(eos): 100}, min_tokens=5, max_tokens=20)
    assert held["finish_reason"] == "stop"
    r = client.post("/v1/completions", json={**body, "logit_bias": {str(eos): 100},
                                             "min_tokens": 5, "max_tokens": 20}).json()
    assert r["usage"]["completion_tokens"] == 6  # five held tokens, then the EOS
