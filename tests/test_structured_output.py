"""Structured output: the packed bitmask on device, the grammar matcher (llguidance), and
constrained requests through the tiny engine beside free ones."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from engine_utils import tiny_engine, tiny_params
from jaxserve.sample.logits_processors import apply_bitmask, bitmask_words
from jaxserve.sampling_params import InvalidRequest, SamplingParams
from jaxserve.sample.grammar import GrammarTokenizer, StructuredOutput

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"},
                                           "tag": {"enum": ["red", "blue"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def test_apply_bitmask_keeps_exactly_the_set_bits():
    V = 70
    allowed = {0, 5, 31, 32, 63, 69}
    words = np.zeros((1, bitmask_words(V)), np.uint32)
    for t in allowed:
        words[0, t // 32] |= np.uint32(1 << (t % 32))
    logits = np.arange(V, dtype=np.float32)[None]
    out = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(words.view(np.int32))))
    assert set(np.flatnonzero(np.isfinite(out[0]))) == allowed
    np.testing.assert_array_equal(out[0, sorted(allowed)], sorted(allowed))
    everything = np.full((1, bitmask_words(V)), -1, np.int32)
    np.testing.assert_array_equal(apply_bitmask(jnp.asarray(logits), jnp.asarray(everything)),
                                  logits)


@pytest.fixture(scope="module")
def grammar_tok():
    from fake_engine import tiny_tokenizer
    return GrammarTokenizer(tiny_tokenizer().backend, 258, [257])


def allowed_ids(matcher, words):
    mask = np.zeros(words, np.int32)
    matcher.fill_bitmask(mask)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_matcher_masks_follow_the_grammar(grammar_tok):
    m = grammar_tok.matcher(StructuredOutput("regex", "[ab]c"))
    assert allowed_ids(m, grammar_tok.words) == {97, 98}
    assert m.accept(98)
    assert allowed_ids(m, grammar_tok.words) == {99}
    assert m.accept(99) and allowed_ids(m, grammar_tok.words) == {257}  # only EOS now
    m = grammar_tok.matcher(StructuredOutput("choice", json.dumps(["yes", "no"])))
    assert allowed_ids(m, grammar_tok.words) == {ord("y"), ord("n")}
    assert not m.accept(ord("x")) and m.error


def test_a_reasoning_models_grammar_starts_after_the_thinking(grammar_tok):
    """With `after` ("</think>", a reasoning parser's end tag) every token is allowed until
    the output has that text, the grammar holds from the next token on."""
    m = grammar_tok.matcher(StructuredOutput("regex", "[ab]c", after="</think>"))
    everything = set(range(32 * grammar_tok.words))
    for ch in "x</think":  # the tag arrives a byte at a time: not there yet
        assert allowed_ids(m, grammar_tok.words) == everything and not m.done
        assert m.accept(ord(ch))
    assert m.accept(ord(">"))
    assert allowed_ids(m, grammar_tok.words) == {97, 98}
    assert m.accept(97) and not m.accept(97) and m.error


@pytest.mark.parametrize("spec, fragment", [
    (StructuredOutput("json", "{not json"), "invalid json"),
    (StructuredOutput("regex", "(("), "invalid regex"),
    (StructuredOutput("grammar", "start: (("), "invalid grammar"),
    (StructuredOutput("xml", "<a/>"), "unknown kind"),
])
def test_bad_grammars_are_invalid_requests(spec, fragment, grammar_tok):
    with pytest.raises(InvalidRequest) as info:
        spec.validate()
    assert info.value.field == "structured_outputs" and fragment in str(info.value)


@pytest.fixture(scope="module")
def params():
    return tiny_params()


def run_counting_steps(engine, requests):
    """Add requests, step until all finish: ({id: final output}, {id: engine steps until
    its final output came back})."""
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    done, steps, n = {}, {}, 0
    while len(done) < len(requests):
        n += 1
        assert n < 1000
        for out in engine.step():
            if out.finished:
                done[out.request_id], steps[out.request_id] = out, n
    return done, steps


def test_constrained_and_free_requests_share_steps(params):
    """Regex, choice and JSON-schema requests (sampled, temperature 1) beside a free one:
    every constrained output matches its constraint; the free request's tokens are those
    it gets alone, and it finishes after as many engine steps (nobody waits for a
    constrained request); a constrained request takes every step too (its grammar's
    bitmask goes to the sampler half of the step, after its last token is read): its
    steps past its tokens are no more than a free request's; some steps held
    constrained and free rows together."""
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone, alone_steps = run_counting_steps(tiny_engine(params), [("free", [65, 66], free)])

    engine = tiny_engine(params)
    mixed_steps, live = [], []
    forward, sample = engine.runner.dispatch_forward, engine.runner.dispatch_sample

    def forward_spy(batch, sampling, prev_index=None):
        live.append(int(np.sum(np.asarray(batch.seq_lens) > 0)))
        return forward(batch, sampling, prev_index)

    def sample_spy(fwd, sampling):
        c = sampling.controls
        if c is not None:
            constrained = int(np.sum(np.any(np.asarray(c.allowed) != -1, axis=1)))
            mixed_steps.append((constrained, live[-1]))
        return sample(fwd, sampling)

    engine.runner.dispatch_forward, engine.runner.dispatch_sample = forward_spy, sample_spy
    so = {
        "regex": StructuredOutput("regex", "[a-c]{3}-[0-9]{2}"),
        "choice": StructuredOutput("choice", json.dumps(["alpha", "beta gamma"])),
        "json": StructuredOutput("json", json.dumps(SCHEMA)),
    }
    reqs = [(k, [65, 66], SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                                         structured_outputs=v))
            for i, (k, v) in enumerate(so.items())]
    done, steps = run_counting_steps(engine, [("free", [65, 66], free)] + reqs)
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", done["regex"].text)
    assert done["choice"].text in ("alpha", "beta gamma")
    value = json.loads(done["json"].text)
    assert set(value) == {"n", "tag"} and isinstance(value["n"], int)
    assert value["tag"] in ("red", "blue")
    free_extra = alone_steps["free"] - len(alone["free"].token_ids)
    for k in so:
        assert done[k].finish_reason == "stop", k
        assert steps[k] - len(done[k].token_ids) <= free_extra, (k, steps[k], free_extra)
    assert done["free"].token_ids == alone["free"].token_ids
    assert steps["free"] == alone_steps["free"], "the free request was never held up"
    assert any(0 < c < n for c, n in mixed_steps), "a step held both kinds"


def test_constrained_request_refused_by_the_engine_fails_alone(params):
    engine = tiny_engine(params)
    with pytest.raises(InvalidRequest) as info:
        engine.add_request("bad", [65], SamplingParams(
            structured_outputs=StructuredOutput("regex", "((", "guided_regex")))
    assert info.value.field == "guided_regex"
    assert not engine.has_unfinished_requests()


CHOICES = ["alpha", "beta gamma"]


def _choice(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 40, "temperature": 0, **kw},
                          structured_outputs=StructuredOutput("choice", json.dumps(CHOICES)))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_jump_forward_computes_forced_tokens_as_a_chunk(params, async_scheduling):
    """Jump-forward (SchedulerConfig.jump_forward): the tokens a grammar forces join the
    output without a step each. With the byte-level tokenizer a forced token is the only
    one the mask allows, so greedy outputs are the same token for token with it on and
    off; on, the JSON and choice requests finish in fewer steps than they have tokens
    (off: one step a token at least), the engine counts the forced tokens, and a free
    request beside them gets the tokens it gets alone. With async scheduling the step in
    flight drops its token for the request; without, the tokens follow the one read."""
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone, _ = run_counting_steps(tiny_engine(params), [("free", [65, 66], free)])
    schema = SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutput(
        "json", json.dumps(SCHEMA)))
    reqs = [("free", [65, 66], free), ("json", [65, 66], schema), ("choice", [67], _choice())]
    runs = {}
    for jf in (True, False):
        engine = tiny_engine(params, jump_forward=jf, async_scheduling=async_scheduling)
        runs[jf] = (*run_counting_steps(engine, reqs), engine.stats().num_forced_tokens)
    (on, on_steps, forced), (off, off_steps, none_forced) = runs[True], runs[False]
    assert none_forced == 0 and forced > 0
    for k in ("json", "choice"):
        assert on[k].token_ids == off[k].token_ids and on[k].text == off[k].text, k
        assert on[k].finish_reason == "stop", k
        assert off_steps[k] >= len(off[k].token_ids), k
        assert on_steps[k] < len(on[k].token_ids), (k, on_steps[k], len(on[k].token_ids))
    assert on["choice"].text in CHOICES
    value = json.loads(on["json"].text)
    assert set(value) == {"n", "tag"} and value["tag"] in ("red", "blue")
    assert on["free"].token_ids == off["free"].token_ids == alone["free"].token_ids


def test_jump_forward_keeps_stops_limits_and_logprobs(params):
    """Forced tokens go through the output processor as sampled ones do: a stop string
    inside them ends the request there, max_tokens cuts them; a request that asks for
    logprobs samples every token (a forced one would have none)."""
    engine = tiny_engine(params)
    done, _ = run_counting_steps(engine, [
        ("stop", [67], _choice(stop=["ph"])),
        ("length", [67], _choice(max_tokens=3)),
        ("logprobs", [67], _choice(logprobs=0))])
    assert done["stop"].text in ("al", "beta gamma") and done["stop"].finish_reason == "stop"
    assert len(done["length"].token_ids) == 3 and done["length"].finish_reason == "length"
    assert done["length"].text in ("alp", "bet")
    lp = done["logprobs"]
    assert lp.text in CHOICES and len(lp.logprobs) == len(lp.token_ids)
    assert all(x.token_id == t for x, t in zip(lp.logprobs, lp.token_ids))


@pytest.mark.parametrize("jump_forward", [True, False])
def test_a_value_the_grammar_completed_ends_before_min_tokens(params, jump_forward):
    """min_tokens masks EOS, and a grammar whose value is complete allows only EOS: the
    request ends there ("stop", short of min_tokens) instead of sampling a token outside
    the grammar and failing (vLLM #54218). Where the grammar leaves other tokens, min_tokens
    still holds: "beta gamma" with min_tokens past "beta" but within it is generated whole,
    and a free request beside them keeps its min_tokens."""
    engine = tiny_engine(params, jump_forward=jump_forward)
    free = SamplingParams(max_tokens=12, temperature=0, min_tokens=12)
    done, _ = run_counting_steps(engine, [
        ("short", [67], _choice(min_tokens=30)),
        ("sampled", [68], _choice(min_tokens=30, temperature=1.0, seed=5)),
        ("within", [69], SamplingParams(max_tokens=40, temperature=0, min_tokens=7,
                                        structured_outputs=StructuredOutput(
                                            "choice", json.dumps(["beta", "beta gamma"])))),
        ("free", [70], free)])
    for rid in ("short", "sampled"):
        assert done[rid].text in CHOICES and done[rid].finish_reason == "stop", done[rid]
    assert done["within"].text == "beta gamma" and done["within"].finish_reason == "stop"
    assert len(done["free"].token_ids) == 12
    assert engine.stats().num_failed_requests == 0
    assert engine.pool.num_free == engine.pool.capacity
