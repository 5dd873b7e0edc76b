"""Logits controls (logit_bias, min_tokens, repetition / frequency / presence penalties) and
logprobs: each control's exact effect on a known logits row, then end to end through the
tiny engine (single steps, multi-step decode, speculative verify steps), where a greedy
request with controls must give the tokens of a reference greedy loop that applies the
same formulas in numpy to teacher-forced logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_utils import TINY_CFG, run_staggered, tiny_engine, tiny_params
from jaxserve.sample.logits_processors import (NO_LIMIT, LogitsControls, apply_controls,
                                               bias_entries, history, write_token_pool)
from jaxserve.sample.sampler import SamplingBatch, sample, sample_controlled, top_logprobs
from jaxserve.sampling_params import InvalidRequest, SamplingParams

V = 12
EOS = 257  # the tiny tokenizer's <|im_end|>


def controls(S=1, K=4, **rows):
    c = LogitsControls.neutral(S, K, V)
    for name, value in rows.items():
        getattr(c, name)[...] = value
    return c


def apply(logits, c, step, tokens, num_context):
    return np.asarray(apply_controls(jnp.asarray(logits, jnp.float32), c, jnp.asarray(step),
                                     jnp.asarray(tokens), jnp.asarray(num_context)))


ROW = np.array([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0, -0.5, 4.0, -3.0, 0.25, 1.5]], np.float32)
# prompt [3, 1, 3], output [8, 1, 8, 8]; positions past 7 are stale ids that must not count
TOKENS = np.array([[3, 1, 3, 8, 1, 8, 8, 5, 5, 5]], np.int32)


def test_repetition_penalty_matches_hf_processor():
    import torch  # a test extra: missing, this fails rather than skips
    from transformers import RepetitionPenaltyLogitsProcessor
    got = apply(ROW, controls(repetition_penalty=1.7, prompt_len=3), [4], TOKENS, [7])
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor(TOKENS[:, :7]).long(),
                                                 torch.tensor(ROW))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert got[0, 5] == ROW[0, 5], "token 5 is only past the context"


def test_frequency_and_presence_penalties_count_output_tokens_only():
    got = apply(ROW, controls(frequency_penalty=0.5, presence_penalty=0.25, prompt_len=3),
                [4], TOKENS, [7])
    want = ROW.copy()
    want[0, 8] -= 0.5 * 3 + 0.25   # three times in the output
    want[0, 1] -= 0.5 * 1 + 0.25   # once in the output (once in the prompt: not counted)
    np.testing.assert_allclose(got, want, rtol=1e-6)  # 3 (prompt only) and 5 (stale) untouched


def test_logit_bias_and_min_tokens_mask():
    c = controls(K=3)
    c.bias_ids[0] = [2, 7, -1]
    c.bias_values[0] = [-100.0, -np.inf, 0]
    c.bias_until[0] = [NO_LIMIT, 3, 0]
    early = apply(ROW, c, [2], TOKENS, [7])
    want = ROW.copy()
    want[0, 2] -= 100
    want[0, 7] = -np.inf
    np.testing.assert_array_equal(early, want)
    late = apply(ROW, c, [3], TOKENS, [7])  # 3 tokens out: min_tokens reached
    want[0, 7] = ROW[0, 7]
    np.testing.assert_array_equal(late, want)


def test_min_tokens_yields_to_a_grammar_that_allows_nothing_else():
    """Row 0's grammar allows only token 7 (an EOS that min_tokens masks): the row keeps its
    logits on 7 (vLLM #54218) and its bias and penalties elsewhere stay applied. Row 1's
    grammar allows 7 and 3: min_tokens still masks 7. Row 2 (no grammar) is as row 1
    without the bitmask. Bit for bit what the masks-first order gives where a token is
    left."""
    c = controls(S=3, K=2, presence_penalty=0.25, prompt_len=3)
    c.bias_ids[:] = [7, 3]
    c.bias_values[:] = [-np.inf, 1.5]
    c.bias_until[:] = [3, NO_LIMIT]
    c.allowed[0] = 1 << 7
    c.allowed[1] = (1 << 7) | (1 << 3)
    rows = np.repeat(ROW, 3, axis=0)
    tokens = np.repeat(TOKENS, 3, axis=0)
    got = apply(rows, c, [2, 2, 2], tokens, [7, 7, 7])
    want = rows.copy()
    want[:, 3] += 1.5
    want[:, [8, 1]] -= 0.25  # in the output so far
    assert got[0, 7] == want[0, 7] and np.isfinite(got[0, 7])
    assert np.all(got[0, np.arange(V) != 7] == -np.inf)
    assert got[1, 7] == -np.inf and got[1, 3] == want[1, 3]
    assert np.all(got[1, np.setdiff1d(np.arange(V), [3, 7])] == -np.inf)
    want[2, 7] = -np.inf
    np.testing.assert_array_equal(got[2], want[2])
    late = apply(rows, c, [3, 3, 3], tokens, [7, 7, 7])  # min_tokens reached: no fallback
    assert late[1, 7] == rows[1, 7]  # 7 is not in the output: unpenalised


def test_bias_entries_order_and_min_tokens():
    assert bias_entries({5: 1.0, 2: -3.0}, 0, [9]) == [(2, -3.0, NO_LIMIT), (5, 1.0, NO_LIMIT)]
    assert bias_entries({}, 4, [9, 7, 9]) == [(7, -np.inf, 4), (9, -np.inf, 4)]


def test_history_reads_the_token_pool_through_block_tables():
    page = 4
    pool = jnp.zeros(6 * page, jnp.int32)
    # a sequence on pages [3, 1]: positions 0..5 at slots 12..15, 4..5
    slots = jnp.array([12, 13, 14, 15, 4, 5])
    pool = write_token_pool(pool, slots, jnp.arange(10, 16))
    h = np.asarray(history(pool, jnp.array([[3, 1]]), page))
    np.testing.assert_array_equal(h[0, :6], np.arange(10, 16))


def test_sample_controlled_keeps_raw_logprobs_and_free_rows_unchanged():
    logits = np.tile(ROW, (2, 1))
    sb = SamplingBatch.from_params([SamplingParams(temperature=0)] * 2, [1, 2], [0, 0], 2)
    c = controls(S=2, K=2)
    c.bias_ids[0, 0], c.bias_values[0, 0], c.bias_until[0, 0] = 4, 100.0, NO_LIMIT
    sb = dataclasses.replace(sb, controls=c)
    context = lambda: (jnp.zeros((2, 4), jnp.int32), jnp.zeros(2, jnp.int32))  # noqa: E731
    tokens, lps = jax.jit(lambda x, b: sample_controlled(x, b, "xla", context))(logits, sb)
    raw = np.asarray(jax.nn.log_softmax(ROW[0]))
    assert tokens.tolist() == [4, 8], "row 0 biased to token 4, row 1 untouched"
    np.testing.assert_allclose(lps, [raw[4], raw[8]], rtol=1e-5)
    plain, _ = sample(jnp.asarray(logits), dataclasses.replace(sb, controls=None))
    assert int(plain[1]) == 8


def test_top_logprobs_are_the_largest_of_the_log_softmax():
    logits = np.random.default_rng(0).normal(size=(3, 40)).astype(np.float32) * 4
    ids, lps = top_logprobs(jnp.asarray(logits), 5)
    full = np.asarray(jax.nn.log_softmax(logits, -1))
    np.testing.assert_array_equal(ids, np.argsort(-full, -1)[:, :5])
    np.testing.assert_allclose(lps, np.take_along_axis(full, np.asarray(ids), -1), rtol=1e-5)


@pytest.mark.parametrize("field, value, fragment", [
    ("presence_penalty", 3.0, "[-2, 2]"), ("frequency_penalty", -2.5, "[-2, 2]"),
    ("repetition_penalty", 0.0, "> 0"), ("logit_bias", {1: 101.0}, "[-100, 100]"),
    ("logit_bias", {-1: 1.0}, "token ids"), ("min_tokens", 17, "max_tokens=16"),
    ("logprobs", -1, ">= 0"), ("stop_token_ids", (-3,), "token ids")])
def test_sampling_params_refuse_out_of_range(field, value, fragment):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field and fragment in str(info.value)


# -- end to end, tiny engine ----------------------------------------------------------------

@pytest.fixture(scope="module")
def params():
    return tiny_params()


def reference_greedy(params, prompt, n, sp: SamplingParams, eos=(EOS,)):
    """Greedy tokens with sp's controls applied in numpy (vLLM's formulas) to teacher-forced
    logits of the model (jaxserve.functional.logits), one forward per token."""
    from jaxserve.functional import logits as model_logits
    seq = list(prompt)
    out = []
    for i in range(n):
        row = np.asarray(model_logits(params, TINY_CFG, np.array([seq], np.int32),
                                      np.array([len(seq)])))[0, -1].astype(np.float64)
        for t, b in sp.logit_bias:
            row[t] += b
        if i < sp.min_tokens:
            row[list(set(sp.stop_token_ids) | set(() if sp.ignore_eos else eos))] = -np.inf
        seen = set(seq)
        for t in seen:
            rp = sp.repetition_penalty
            row[t] = row[t] / rp if row[t] > 0 else row[t] * rp
        counts = np.bincount(out, minlength=row.size)
        row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
        token = int(np.argmax(row))
        out.append(token)
        seq.append(token)
    return out


CONTROLLED = {
    "repetition": SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.8,
                                 ignore_eos=True),
    "frequency+presence": SamplingParams(max_tokens=12, temperature=0, frequency_penalty=1.5,
                                         presence_penalty=0.7, ignore_eos=True),
    "bias": SamplingParams(max_tokens=12, temperature=0, logit_bias={65: 3.0, 85: -100.0},
                           ignore_eos=True),
    # "a" until its count outweighs the bias: repeats the n-gram proposer drafts from, some
    # of which the penalty then rejects
    "bias+frequency": SamplingParams(max_tokens=12, temperature=0, logit_bias={97: 6.0},
                                     frequency_penalty=0.8, ignore_eos=True),
    # two tokens far above the rest (the model's logits: std ~6), which one comes next
    # turns on the counts of both, the last one sampled included
    "bias+presence": SamplingParams(max_tokens=12, temperature=0,
                                    logit_bias={97: 100.0, 98: 100.0}, presence_penalty=2.0,
                                    frequency_penalty=2.0, ignore_eos=True),
}


@pytest.mark.parametrize("engine_kw", [{}, {"decode_steps": 4},
                                       {"speculative_config": {
                                           "method": "ngram", "num_speculative_tokens": 3,
                                           "prompt_lookup_max": 3, "prompt_lookup_min": 1}}],
                         ids=["single-step", "multi-step", "ngram-verify"])
def test_controlled_greedy_matches_reference_loop(params, engine_kw):
    """Each control's greedy output equals the numpy reference, alongside a free request
    (which gives its own tokens unchanged), whether the penalties' history includes tokens
    the host has not read yet (async steps, multi-step bursts) or accepted drafts."""
    engine = tiny_engine(params, **engine_kw)
    prompt = list(b"abcabcabc ab")
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reqs = [(name, prompt, sp) for name, sp in CONTROLLED.items()] + [("free", prompt, free)]
    done, _ = run_staggered(engine, reqs, [0, 0, 1, 1, 2, 2])
    for name, sp in CONTROLLED.items():
        assert done[name].token_ids == reference_greedy(params, prompt, 12, sp), name
    assert done["free"].token_ids == reference_greedy(params, prompt, 12, free)
    assert done["free"].token_ids != done["repetition"].token_ids, "the penalty changed output"
    if "speculative_config" in engine_kw:
        assert engine.stats().spec_decode.num_drafts > 0, "verify steps ran"
    if "decode_steps" in engine_kw:
        assert any(k.n == 4 for k in engine.runner._compiled), "multi-step steps ran"


def test_min_tokens_stop_token_ids_and_special_tokens(params):
    engine = tiny_engine(params)
    force_eos = {EOS: 100.0}
    reqs = [("eos", [65, 66], SamplingParams(max_tokens=10, logit_bias=force_eos)),
            ("min5", [65, 66], SamplingParams(max_tokens=10, logit_bias=force_eos,
                                              min_tokens=5, seed=1)),
            ("stop_id", [65, 66], SamplingParams(max_tokens=10, logit_bias={70: 100.0},
                                                 stop_token_ids=[70])),
            ("min_stop_id", [65, 66], SamplingParams(max_tokens=10, logit_bias={70: 100.0},
                                                     stop_token_ids=[70], min_tokens=3,
                                                     seed=2)),
            ("special", [65], SamplingParams(max_tokens=2, logit_bias={256: 100.0},
                                             skip_special_tokens=False)),
            ("skipped", [65], SamplingParams(max_tokens=2, logit_bias={256: 100.0}))]
    done, _ = run_staggered(engine, reqs, [0] * len(reqs))
    assert done["eos"].token_ids == [EOS] and done["eos"].finish_reason == "stop"
    min5 = done["min5"].token_ids
    assert len(min5) == 6 and EOS not in min5[:5] and min5[5] == EOS
    assert done["stop_id"].token_ids == [70] and done["stop_id"].finish_reason == "stop"
    got = done["min_stop_id"].token_ids
    assert len(got) == 4 and 70 not in got[:3] and got[3] == 70
    assert done["special"].text == "<|im_start|>" * 2
    assert done["skipped"].text == ""


def test_min_tokens_defers_stop_strings(params):
    engine = tiny_engine(params)
    force_a = {97: 100.0}  # "a" every step
    reqs = [("plain", [65], SamplingParams(max_tokens=6, logit_bias=force_a, stop=["a"])),
            ("min", [65], SamplingParams(max_tokens=6, logit_bias=force_a, stop=["a"],
                                         min_tokens=3))]
    done, _ = run_staggered(engine, reqs, [0, 0])
    assert done["plain"].text == "" and len(done["plain"].token_ids) == 1
    assert done["min"].text == "aaa" and len(done["min"].token_ids) == 4


def test_engine_logprobs_equal_teacher_forced_log_softmax(params):
    """Sampled-token logprobs, top-N and prompt logprobs (with a chunked prompt) equal
    the log-softmax of teacher-forced logits; a request without logprobs gets none and
    the same tokens."""
    from jaxserve.functional import logits as model_logits
    engine = tiny_engine(params, max_num_batched_tokens=16, token_buckets=(16,))
    prompt = list(b"the cat sat on the mat, the cat")  # 31 tokens: chunks of <= 16
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=5, logprobs=3, prompt_logprobs=2,
                        ignore_eos=True)
    done, _ = run_staggered(engine, [("lp", prompt, sp),
                                     ("none", prompt, dataclasses.replace(
                                         sp, logprobs=None, prompt_logprobs=None))], [0, 0])
    out, none = done["lp"], done["none"]
    assert none.logprobs is None and none.prompt_logprobs is None
    assert none.token_ids == out.token_ids
    seq = prompt + out.token_ids
    logits = np.asarray(model_logits(params, TINY_CFG, np.array([seq], np.int32),
                                     np.array([len(seq)]))[0])
    full = np.asarray(jax.nn.log_softmax(logits, -1))
    # The engine (16-token prompt chunks, then decode rows, beside another request) and the
    # one-prefill reference sum in other orders: f32 rounding, a few ulps of the logits'
    # magnitude through two layers. Allowed: 64 ulps of the row's largest |logit| (~1e-4
    # here); a wrong position or normaliser is off by > 1e-2.
    tol = 64 * np.finfo(np.float32).eps * np.abs(logits).max(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(seq)):
        entry = (out.prompt_logprobs[pos] if pos < len(prompt)
                 else out.logprobs[pos - len(prompt)])
        k = 2 if pos < len(prompt) else 3
        assert entry.token_id == seq[pos]
        np.testing.assert_allclose(entry.logprob, full[pos - 1, seq[pos]], atol=tol[pos - 1])
        ids = [t for t, _ in entry.top]
        assert ids == np.argsort(-full[pos - 1], kind="stable")[:k].tolist()
        np.testing.assert_allclose([lp for _, lp in entry.top], full[pos - 1, ids],
                                   atol=tol[pos - 1])


def test_engine_refuses_sampler_requests_over_its_limits(params):
    engine = tiny_engine(params, max_logprobs=4, max_logit_bias=2)
    for field, sp in (("logprobs", SamplingParams(logprobs=5)),
                      ("prompt_logprobs", SamplingParams(prompt_logprobs=5)),
                      ("logit_bias", SamplingParams(logit_bias={1: 1.0, 2: 1.0, 3: 1.0})),
                      ("logit_bias", SamplingParams(logit_bias={1: 1.0, 2: 1.0}, min_tokens=1)),
                      ("logit_bias", SamplingParams(logit_bias={300: 1.0})),
                      ("stop_token_ids", SamplingParams(stop_token_ids=[258]))):
        with pytest.raises(InvalidRequest) as info:
            engine.add_request("r", [65], sp)
        assert info.value.field == field
    done, _ = run_staggered(engine, [("ok", [65], SamplingParams(
        logprobs=4, logit_bias={1: 1.0}, min_tokens=1, max_tokens=2))], [0])
    assert len(done["ok"].logprobs) == 2 and len(done["ok"].logprobs[0].top) == 4
