"""Speculative decoding in the engine: drafts verified in the ragged step, rejected drafts'
pages given back, stops inside an accepted run, metrics, no compilation after warm-up.

Engine-logic tests use the tiny random model with an oracle proposer (it knows the
non-speculative greedy output and proposes it, corrupted where a test says): a random
model accepts no n-gram draft, and these tests need runs of accepted drafts. The real
model's tests (n-gram prompt lookup, greedy identity) are at the end; the scheduler's
planning of drafts alone (pure Python) is tests/test_spec_scheduler.py."""

import dataclasses

import pytest

from engine_utils import outputs, tiny_engine, tiny_params
from jaxserve.config import ConfigError, EngineConfig, SpeculativeConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker import compile_events

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def params():
    return tiny_params()


class Oracle:
    """Proposes the reference continuation of each prompt: `wrong(i)` True makes the
    draft for output index i wrong; `silent(prompt)` True proposes nothing for it."""

    needs_context = True

    def __init__(self, reference, wrong=lambda i: False, silent=lambda prompt: False):
        self.reference = reference  # {prompt tuple: output ids}
        self.wrong, self.silent = wrong, silent
        self.calls = 0

    def propose(self, context, k):
        self.calls += 1
        for prompt, out in self.reference.items():
            if tuple(context[:len(prompt)]) == prompt:
                if self.silent(prompt):
                    return []
                done = len(context) - len(prompt)
                return [(t + 1) % 258 if self.wrong(i) else t
                        for i, t in enumerate(out[done:done + k], start=done)]
        return []


def _requests(max_tokens=24, **sp):
    return [(f"r{i}", [(5 * i + j) % 50 + 3 for j in range(6 + 3 * i)],
             SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **sp))
            for i in range(3)]


def _spec_engine(params, reference, **oracle):
    engine = tiny_engine(params, speculative_config=NGRAM)
    engine.spec.proposer = Oracle(reference, **oracle)
    return engine


def _reference(params, requests, arrivals=(0, 0, 2)):
    base = outputs(tiny_engine(params), requests, list(arrivals))
    return base, {tuple(p): base[rid][0] for rid, p, _ in requests}


def test_steps_without_drafts_back_off_to_multi_step_bursts(params):
    """While the proposer finds nothing: one token per step for SPEC_BURST_AFTER_MISSES
    (3) misses, then decode_steps bursts (the only other compiled size); a step with
    drafts verifies them and the next miss starts over at 1; the greedy tokens are plain
    decoding's."""
    rid, prompt, sp = _requests(max_tokens=48)[0]
    base = outputs(tiny_engine(params, decode_steps=8), [(rid, prompt, sp)], [0])
    ref = base[rid][0]

    class Bursty:
        needs_context = True

        def propose(self, context, k):  # right drafts only at output indices 19..20
            done = len(context) - len(prompt)
            return ref[done:done + k] if 19 <= done < 21 else []

    engine = tiny_engine(params, decode_steps=8, speculative_config=NGRAM)
    engine.spec.proposer = Bursty()
    sizes = []
    dispatch = engine.runner.dispatch

    def record(batch, sampling, n, prev_index=None):
        sizes.append("v" if batch.logits_indices.ndim == 2 else n)
        return dispatch(batch, sampling, n, prev_index)

    engine.runner.dispatch = record
    assert outputs(engine, [(rid, prompt, sp)], [0]) == base
    # prefill (token 0), tokens 1 and 2 alone, bursts 3-10 and 11-18, verify, then 1, ...
    assert sizes[:7] == [1, 1, 1, 8, 8, "v", 1], sizes
    assert set(sizes) == {1, 8, "v"}  # no shape that warm-up does not compile
    assert engine.stats().spec_decode.num_drafts >= 1


def _one_verify_round(params, kernels, repeat: bool):
    """One verify round of the tiny model over a sequence planned ahead (3 draft rows
    for the n-gram lookup on device): positions 0..5 in the token pool, the pending token
    at 6 (from prev_tokens), rows at 7..9 for drafts. repeat: the pending token also at
    position 2 (the lookup finds a draft), else it occurs nowhere before (no draft).
    Returns (tokens [4] of the round, its tokens kept, the KV pools)."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from engine_utils import TINY_CFG, TINY_PAGE
    from jaxserve.model.inputs import StepBatch
    from jaxserve.model.kv_cache import init_kv_cache
    from jaxserve.sample.sampler import SamplingBatch
    from jaxserve.worker.step import verify_step

    ps, pages = TINY_PAGE, [1, 2, 3]
    slot = [pages[p // ps] * ps + p % ps for p in range(12)]
    pool = np.zeros((8 * ps,), np.int32)
    history = [11, 12, 40, 13, 14, 15]
    pool[slot[:6]] = history
    pending = 40 if repeat else 99
    batch = StepBatch(tokens=np.array([0, 0, 0, 0], np.int32),
                      positions=np.arange(6, 10, dtype=np.int32),
                      slot_mapping=np.array(slot[6:10], np.int32),
                      block_tables=np.array([pages], np.int32),
                      seq_lens=np.array([10], np.int32), query_start=np.array([0, 4], np.int32),
                      logits_indices=np.arange(4, dtype=np.int32)[None])
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0)], [0], [0], 1)
    prev_tokens = np.array([pending, 0, 0, 0], np.int32)
    no_shift = np.zeros((4,), np.int32)
    prev_index = np.array([0, -1, -1, -1], np.int32)  # row 0: planned ahead of prev_tokens[0]
    cache = init_kv_cache(TINY_CFG, 8, ps, jnp.float32, layout="head_major")
    step = jax.jit(functools.partial(verify_step, cfg=TINY_CFG, drafter=None, ngram=(1, 3),
                                     rules=None, kernels=kernels))
    _, _, tokens, _, num, num_drafts, _, cache, _, _ = step(
        params, cache, batch, sampling, prev_tokens, no_shift, prev_index, None, None,
        jnp.asarray(pool))
    assert int(num_drafts[0, 0]) == (3 if repeat else 0)
    return np.asarray(tokens[:, 0]), int(num[0, 0]), cache


@pytest.mark.parametrize("repeat", [False, True])
def test_a_verify_round_without_drafts_runs_the_first_rows_alone(params, repeat):
    """With the C++ CPU matmul (Kernels matmul "cpu"; here it runs the tiny float weights
    in XLA's dot) a verify round whose n-gram lookup on device found no draft runs the
    forward of its first rows alone: its token is the round over every row's (matmul
    "xla": no such branch), and the draft rows' K/V slots are left as they were (zeros)
    where the round over every row writes them; with a draft found, both rounds write
    them and keep the same tokens."""
    import numpy as np
    from jaxserve.model.transformer import Kernels

    got, got_num, got_cache = _one_verify_round(params, Kernels(matmul="cpu"), repeat)
    want, want_num, want_cache = _one_verify_round(params, Kernels(), repeat)
    assert got_num == want_num and (got[:got_num] == want[:want_num]).all()
    # the draft rows' slots: positions 7..9 (page 2's row 3, page 3's rows 0 and 1)
    k_got, k_want = np.asarray(got_cache.k[0]), np.asarray(want_cache.k[0])
    drafts_got = np.abs(k_got[:, 2, 3]).sum() + np.abs(k_got[:, 3, :2]).sum()
    drafts_want = np.abs(k_want[:, 2, 3]).sum() + np.abs(k_want[:, 3, :2]).sum()
    assert drafts_want > 0
    assert (drafts_got > 0) == repeat
    # position 6: XLA's dot sums 1 row and 4 in other orders (the C++ kernel would not):
    # within a reordered f32 sum's bound, hidden_size x 2^-24 x the largest |K|
    from engine_utils import TINY_CFG
    bound = TINY_CFG.hidden_size * 2.0 ** -24 * np.abs(k_want).max()
    np.testing.assert_allclose(k_got[:, 2, 2], k_want[:, 2, 2], rtol=0, atol=bound)


@pytest.mark.parametrize("case", ["all_right", "every_third_wrong", "one_silent"])
def test_greedy_output_is_unchanged_by_speculation(params, case):
    requests = _requests()
    base, ref = _reference(params, requests)
    oracle = {"all_right": {}, "every_third_wrong": {"wrong": lambda i: i % 3 == 2},
              "one_silent": {"silent": lambda p: p == tuple(requests[1][1])}}[case]
    engine = _spec_engine(params, ref, **oracle)
    got = outputs(engine, requests, [0, 0, 2])
    assert got == base
    st = engine.stats()
    assert st.spec_decode.num_drafts > 0
    assert st.spec_decode.num_accepted_tokens <= st.spec_decode.num_draft_tokens
    per_pos = st.spec_decode.num_accepted_tokens_per_pos
    assert sum(per_pos) == st.spec_decode.num_accepted_tokens
    assert per_pos == sorted(per_pos, reverse=True)  # position j accepted => j - 1 was
    if case == "all_right":
        assert st.spec_decode.num_accepted_tokens == st.spec_decode.num_draft_tokens
        # 24 tokens in runs of up to 4 per step instead of 1
        assert engine.num_steps < 3 * 24 / 2
    if case == "every_third_wrong":
        assert 0 < st.spec_decode.num_accepted_tokens < st.spec_decode.num_draft_tokens
    assert not engine.scheduler.running and engine.pool.num_free == engine.pool.capacity


def test_rejected_drafts_pages_go_back(params):
    # one request, every draft wrong: each verify step takes pages for its 3 drafts and
    # must give back those past its next token
    requests = _requests(max_tokens=40)[:1]
    base, ref = _reference(params, requests, (0,))
    engine = _spec_engine(params, ref, wrong=lambda i: True)
    verified, tables = engine.scheduler.verified, []

    def spy(seq, index, tokens, ahead=0):
        verified(seq, index, tokens, ahead)
        tables.append((len(seq.block_table), engine.pool.pages_for(seq.num_tokens)))

    engine.scheduler.verified = spy
    assert outputs(engine, requests, [0]) == base
    assert len(tables) > 10 and all(have == need for have, need in tables)
    assert engine.stats().spec_decode.num_accepted_tokens == 0
    assert engine.pool.num_free == engine.pool.capacity


@pytest.mark.parametrize("stop", ["token", "max_tokens", "max_model_len", "string"])
def test_a_stop_inside_an_accepted_run_ends_where_decoding_would(params, stop):
    prompt = [(7 * j) % 50 + 3 for j in range(9)]
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    free_run = outputs(tiny_engine(params), [("r", prompt, long)], [0])["r"]
    ids, text = free_run[0], free_run[1]
    kw = {"token": dict(stop_token_ids=(ids[6],)),
          "max_tokens": dict(max_tokens=7),
          "max_model_len": {},
          "string": dict(stop=(text[5:7],))}[stop]
    sp = SamplingParams(**{**dict(temperature=0, max_tokens=40, ignore_eos=True), **kw})
    engine_kw = {"max_model_len": len(prompt) + 7} if stop == "max_model_len" else {}
    want = outputs(tiny_engine(params, **engine_kw), [("r", prompt, sp)], [0])["r"]
    engine = tiny_engine(params, speculative_config=NGRAM, **engine_kw)
    engine.spec.proposer = Oracle({tuple(prompt): ids})
    got = outputs(engine, [("r", prompt, sp)], [0])["r"]
    assert got == want
    assert len(want[0]) < 40
    assert engine.stats().spec_decode.num_accepted_tokens > 0
    assert engine.pool.num_free == engine.pool.capacity


def test_seeded_sampling_is_reproducible(params):
    requests = [(rid, p, SamplingParams(temperature=1.0, top_p=0.9, seed=11 + i,
                                        max_tokens=20, ignore_eos=True))
                for i, (rid, p, _) in enumerate(_requests())]
    _, ref = _reference(params, _requests(max_tokens=20))
    runs = []
    for _ in range(2):
        engine = _spec_engine(params, ref)
        runs.append(outputs(engine, requests, [0, 1, 2]))
    assert runs[0] == runs[1]
    assert all(len(ids) == 20 for ids, _, _ in runs[0].values())


def test_no_compilation_after_warmup_and_big_batches_do_not_speculate(params):
    engine = tiny_engine(params, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    requests = _requests()
    _, ref = _reference(params, requests)
    engine.runner.warmup()
    compiled, events = engine.num_compilations, compile_events.snapshot()
    engine.spec.proposer = Oracle(ref)
    batch_sizes = []
    propose = engine.spec.propose

    def spy(running, hold):
        batch_sizes.append(len(running))
        return propose(running, hold)

    engine.spec.propose = spy
    late = ("r9", [9, 9, 9], SamplingParams(temperature=0, max_tokens=30))
    got = outputs(engine, requests + [late], [0, 0, 8, 8])
    assert engine.num_compilations == compiled
    # nothing traced, lowered, compiled or fetched from the cache: verify steps, drafts
    # and their bookkeeping run in the warmed-up executables
    assert (compile_events.snapshot() - events).total == 0
    assert len(got) == 4 and engine.stats().spec_decode.num_drafts > 0
    # proposals only while at most disable_by_batch_size sequences run
    assert batch_sizes and max(batch_sizes) <= 2


# --- a draft model (tiny) ------------------------------------------------------------------

DRAFT = {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 3}


def test_a_draft_that_is_the_target_has_every_draft_accepted(params):
    """The draft model's K/V kept in step with the target's through prefill chunks,
    verify steps and rejections, and its proposals read through the same numbers: a draft
    identical to the target proposes the target's own tokens (greedy), and with sampling
    p == q accepts every draft (probability min(1, p / q) = 1)."""
    requests = _requests(max_tokens=20)
    base = outputs(tiny_engine(params), requests, [0, 0, 2])
    engine = tiny_engine(params, draft_params=params, speculative_config=DRAFT)
    assert outputs(engine, requests, [0, 0, 2]) == base
    st = engine.stats()
    assert st.spec_decode.num_draft_tokens > 20
    assert st.spec_decode.num_accepted_tokens == st.spec_decode.num_draft_tokens
    sampled = [(rid, p, SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=20,
                                       ignore_eos=True)) for rid, p, _ in requests]
    engine = tiny_engine(params, draft_params=params, speculative_config=DRAFT)
    first = outputs(engine, sampled, [0, 0, 2])
    st = engine.stats()
    assert st.spec_decode.num_accepted_tokens == st.spec_decode.num_draft_tokens > 20
    again = outputs(tiny_engine(params, draft_params=params, speculative_config=DRAFT),
                    sampled, [0, 0, 2])
    assert again == first  # seeded: reproducible


@pytest.mark.full  # fast tier: a draft model (tiny) proposing in the verify step
def test_a_truncated_draft_keeps_greedy_output_and_frees_its_pages(params):
    """A one-layer draft of the two-layer target: some drafts rejected, output unchanged,
    stops inside runs included, every page back in the pool."""
    import dataclasses as dc
    draft = dc.replace(params, layers=params.layers[:1])
    requests = _requests(max_tokens=24) + [
        ("stop", [3, 4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))]
    base = outputs(tiny_engine(params), requests, [0, 0, 2, 3])
    engine = tiny_engine(params, draft_params=draft, speculative_config=DRAFT)
    assert outputs(engine, requests, [0, 0, 2, 3]) == base
    st = engine.stats()
    assert 0 < st.spec_decode.num_accepted_tokens < st.spec_decode.num_draft_tokens
    assert engine.pool.num_free == engine.pool.capacity


def _ahead_counter(engine):
    """A list that gets one entry per verify step `engine` plans ahead of the previous
    one's read (Scheduler.schedule_ahead)."""
    planned = []
    schedule_ahead = engine.scheduler.schedule_ahead

    def spy(unread):
        out = schedule_ahead(unread)
        if out is not None:
            planned.append(out)
        return out

    engine.scheduler.schedule_ahead = spy
    return planned


def _verify_rounds(engine):
    """A list that gets the rounds of each verify step `engine` dispatches."""
    rounds = []
    execute = engine._execute

    def spy(scheduled):
        if scheduled.verify:
            rounds.append(scheduled.num_steps)
        return execute(scheduled)

    engine._execute = spy
    return rounds


@pytest.mark.parametrize("method", ["draft_model", "eagle", "ngram"])
def test_verify_steps_planned_ahead_give_the_output_of_steps_read_first(params, method):
    """Speculation with async scheduling: each verify step is dispatched before the one
    before it is read, its rows moved on device by the accepted count; the tokens, greedy
    and seeded sampling, are exactly those of the engine that reads every step first
    (async_scheduling off): same positions, same draws; and so are those of verify steps
    of 3 rounds each (verify_steps 3: rounds 2 and 3 moved on device by the tokens the
    rounds before kept, their drafts proposed there). A wrong shift of the positions,
    slots or sampling step breaks the equality (draft model: a truncated draft, so that
    the accepted count varies; n-gram: prompts that repeat, proposed on device)."""
    import dataclasses as dc
    if method == "draft_model":
        kw = dict(draft_params=dc.replace(params, layers=params.layers[:1]),
                  speculative_config=DRAFT)
    elif method == "eagle":
        kw = dict(eagle=_tiny_head(params), speculative_config=EAGLE)
    else:
        kw = dict(speculative_config={**NGRAM, "num_speculative_tokens": 4})
    prompts = [[(5 * i + j) % 50 + 3 for j in range(6 + 3 * i)] for i in range(3)]
    if method == "ngram":
        prompts = [[3, 4, 5, 6, 7] * 4, [9, 8, 7] * 5, [11, 12] * 6]
    requests = [(f"g{i}", p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
                for i, p in enumerate(prompts)]
    requests += [(f"s{i}", p, SamplingParams(temperature=1.0, top_k=20, seed=5 + i,
                                             max_tokens=20, ignore_eos=True))
                 for i, p in enumerate(prompts)]
    arrivals = [0, 0, 2, 40, 40, 42]
    runs = []
    for on, rounds in ((False, 1), (True, 1), (True, 3)):
        spec = {**kw["speculative_config"], "verify_steps": rounds}
        engine = tiny_engine(params, async_scheduling=on, **{**kw, "speculative_config": spec})
        planned = _ahead_counter(engine)
        verify_rounds = _verify_rounds(engine)
        runs.append(outputs(engine, requests, arrivals))
        st = engine.stats().spec_decode
        assert st.num_draft_tokens > 0
        assert bool(planned) == on, len(planned)
        # verify_steps 3: steps of 3 rounds, as many tokens as 3 steps of their own
        assert (3 in verify_rounds) == (rounds == 3), verify_rounds
        assert engine.pool.num_free == engine.pool.capacity
    assert runs[1] == runs[0]
    assert runs[2] == runs[0]
    assert runs[0]["g0"] == outputs(tiny_engine(params), requests[:1], [0])["g0"]


# --- an EAGLE head (tiny) ------------------------------------------------------------------

EAGLE = {"method": "eagle", "model": "tiny-head", "num_speculative_tokens": 3}


def _tiny_head(params, n_vocab=64, seed=0):
    import jax
    import numpy as np

    from engine_utils import TINY_CFG
    from jaxserve.spec_decode.eagle import head_config, init_head
    vocab = np.sort(np.random.default_rng(seed).choice(258, n_vocab, replace=False))
    return head_config(TINY_CFG), init_head(TINY_CFG, params, vocab, jax.random.key(seed),
                                            scale=0.5)


def test_an_eagle_heads_fc_runs_packed_in_the_cpu_kernel(params, cpu_kernels_library):
    """layout_head_matrix: with the C++ matmul's bf16 copies from 1 row (the shipped bf16
    configs) a head's fc (and an EAGLE-3 head's fuse) becomes a packed bf16 copy that
    Matmul.dense runs in the kernel, within the bf16 rounding of its weights of the f32
    product; the f32 matrix (XLA's dot) otherwise. An engine whose head runs it keeps
    the plain greedy output."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.config import KernelConfig
    from jaxserve.model.transformer import Kernels
    from jaxserve.model.weight_layouts import DualPrecisionWeight
    from jaxserve.worker.kernel_selection import layout_head_matrix

    kcfg, cpu = KernelConfig(matmul_impl="cpu", bf16_matmul_min_rows=1), Kernels(matmul="cpu")
    hcfg, hp = _tiny_head(params)
    fc = layout_head_matrix(hp.fc, kcfg, cpu, None)
    assert isinstance(fc, DualPrecisionWeight) and fc.packed
    for other, kernels in ((dataclasses.replace(kcfg, bf16_matmul_min_rows=16), cpu),
                           (dataclasses.replace(kcfg, bf16_matmul_max_rows=64), cpu),
                           (KernelConfig(matmul_impl="cpu"), cpu),  # f32 panels
                           (kcfg, Kernels())):
        plain = layout_head_matrix(hp.fc, other, kernels, None)
        assert isinstance(plain, jax.Array) and plain.dtype == jnp.float32
    x = jax.random.normal(jax.random.key(1), (3, hp.fc.shape[0]), jnp.float32)
    w = jnp.asarray(hp.fc, jnp.float32)
    got = np.asarray(cpu.matmul.dense(x, fc, 1, out_dtype=jnp.float32))
    want = np.asarray(jnp.dot(x, w, precision="highest"))
    bound = np.asarray(jnp.dot(jnp.abs(x), jnp.abs(w), precision="highest")) * 2.0 ** -8
    assert (np.abs(got - want) <= bound).all() and not np.array_equal(got, want)
    requests = _requests(max_tokens=16)[:2]
    base = outputs(tiny_engine(params), requests, [0, 0])
    engine = tiny_engine(params, eagle=(hcfg, dataclasses.replace(hp, fc=fc)), kernels=cpu,
                         speculative_config=EAGLE)
    assert outputs(engine, requests, [0, 0]) == base
    assert engine.stats().spec_decode.num_draft_tokens > 0


def test_an_eagle_head_keeps_greedy_output_and_its_pools_in_step(params):
    """A random head over a 64-token draft vocabulary: drafts mostly rejected, output the
    plain greedy's (stops, chunked prompts, batches), pages back; and its proposals are
    exactly what the head computes from the target's features (checked by a head whose
    draft vocabulary is one token: every draft is that token)."""
    import jax
    import numpy as np
    requests = _requests(max_tokens=24)
    base = outputs(tiny_engine(params), requests, [0, 0, 2])
    engine = tiny_engine(params, eagle=_tiny_head(params), speculative_config=EAGLE)
    assert outputs(engine, requests, [0, 0, 2]) == base
    st = engine.stats()
    assert st.spec_decode.num_draft_tokens > 20
    assert engine.pool.num_free == engine.pool.capacity
    # a one-token draft vocabulary: the head can only propose that token
    from jaxserve.spec_decode.eagle import draft_lm_head
    hcfg, hp = _tiny_head(params)
    tok = base["r0"][0][3]   # a token greedy decoding produces
    one = np.array([tok])
    hp = type(hp)(fc=hp.fc, body=type(hp.body)(embed=None, layers=hp.body.layers,
                                               final_norm=hp.body.final_norm,
                                               lm_head=draft_lm_head(params, one)),
                  vocab=jax.numpy.asarray(one, jax.numpy.int32))
    engine = tiny_engine(params, eagle=(hcfg, hp), speculative_config=EAGLE)
    seen = []
    verified = engine._verified_alone

    def spy(seq, rounds, tokens, logprobs, ahead=0):
        seen.append((rounds, tokens))
        verified(seq, rounds, tokens, logprobs, ahead)

    engine._verified_alone = spy
    assert outputs(engine, requests[:1], [0]) == {"r0": base["r0"]}
    # greedy: each accepted draft is `tok`, and a run stops at the first non-`tok` target
    assert any(len(t) > 1 for _, t in seen)
    assert all(x == tok for _, t in seen for x in t[:-1])


def _propose_tiny(params, num_drafts, threshold, stop_early):
    """A one-layer draft model (the tiny model's first layer, its K/V pool zeros) proposes
    for three sequences of a verify batch of 5 rows each (contexts of 6, 7 and 8 tokens):
    (drafts [3, 4], logits [3, 4, V], num_drafts [3]) as numpy arrays."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from engine_utils import TINY_CFG, TINY_PAGE
    from jaxserve.model.inputs import StepBatch
    from jaxserve.model.kv_cache import init_kv_cache
    from jaxserve.model.transformer import Kernels
    from jaxserve.sample.sampler import SamplingBatch
    from jaxserve.spec_decode.draft_model import DraftModel, propose
    S, J, P = 3, 5, 4
    dcfg = TINY_CFG.replace(num_layers=1)
    dparams = dataclasses.replace(params, layers=params.layers[:1])
    tables = np.arange(1, 1 + S * P, dtype=np.int32).reshape(S, P)
    pos = np.concatenate([6 + s + np.arange(J) for s in range(S)]).astype(np.int32)
    seq = np.repeat(np.arange(S), J)
    batch = StepBatch(
        tokens=np.array([(7 * i + 3) % 250 + 3 for i in range(S * J)], np.int32),
        positions=pos,
        slot_mapping=(tables[seq, pos // TINY_PAGE] * TINY_PAGE + pos % TINY_PAGE).astype(np.int32),
        block_tables=tables, seq_lens=np.array([6 + s + J for s in range(S)], np.int32),
        query_start=np.arange(0, S * J + 1, J, dtype=np.int32),
        logits_indices=np.arange(S * J, dtype=np.int32).reshape(S, J))
    sampling = SamplingBatch.from_params([SamplingParams(temperature=0)] * S, [0] * S,
                                         [0] * S, S)
    cache = init_kv_cache(dcfg, 1 + S * P, TINY_PAGE, jnp.float32, layout="head_major")
    run = jax.jit(functools.partial(
        propose, DraftModel(dcfg), k=J - 1, page_size=TINY_PAGE,
        vocab_size=TINY_CFG.vocab_size, rules=None, kernels=Kernels("xla", "xla", "xla"),
        min_confidence=threshold, stop_early=stop_early))
    drafts, logits, _, taken = run(params, dparams, cache, batch, sampling,
                                   num_drafts=jnp.asarray(num_drafts, jnp.int32))
    return np.asarray(drafts), np.asarray(logits), np.asarray(taken)


@pytest.mark.parametrize("stop_early", [False, True])
def test_drafts_end_before_the_first_the_drafter_doubts(params, stop_early):
    """SpeculativeConfig.draft_confidence_threshold: each sequence takes the drafts it
    would take without one, up to (not including) the first whose probability under the
    drafter (the softmax of the logits it returns, at that draft) is below the threshold,
    and no more than it may take; with stop_early the iterations end once no sequence
    takes another (a while loop), and the drafts taken are the same."""
    import numpy as np
    allowed = np.array([4, 4, 2])
    drafts, logits, taken = _propose_tiny(params, allowed, 0.0, stop_early)
    assert (taken == allowed).all()
    z = logits - logits.max(-1, keepdims=True)
    prob = np.take_along_axis(np.exp(z) / np.exp(z).sum(-1, keepdims=True),
                              drafts[..., None], -1)[..., 0]                # [3, 4]
    threshold = float(np.median(prob))
    below = prob < threshold
    want = np.minimum(np.where(below.any(1), below.argmax(1), 4), allowed)
    assert 0 < want.sum() < allowed.sum()   # some stop early, not all at once
    got_drafts, _, got = _propose_tiny(params, allowed, threshold, stop_early)
    assert (got == want).all()
    for s, n in enumerate(want):
        assert (got_drafts[s, :n] == drafts[s, :n]).all()


def test_a_confidence_threshold_keeps_greedy_output_with_fewer_drafts(params):
    """draft_confidence_threshold in the engine, on the C++ CPU matmul's verify path
    (Kernels matmul "cpu", running the tiny float weights in XLA's dot: the proposal loop
    stops early, a round without drafts runs its first rows alone): greedy output the
    plain engine's and every page back at each threshold; the fewer drafts the higher it
    is (a random head over 64 tokens: most of its rounds propose none at 0.9; without a
    threshold: test_an_eagle_head_keeps_greedy_output_and_its_pools_in_step)."""
    from jaxserve.model.transformer import Kernels
    requests = _requests(max_tokens=24)
    base = outputs(tiny_engine(params), requests, [0, 0, 2])
    drafts = {}
    for threshold in (0.5, 0.9):
        engine = tiny_engine(params, eagle=_tiny_head(params), kernels=Kernels(matmul="cpu"),
                             speculative_config={**EAGLE,
                                                 "draft_confidence_threshold": threshold})
        assert outputs(engine, requests, [0, 0, 2]) == base
        assert engine.pool.num_free == engine.pool.capacity
        drafts[threshold] = engine.stats().spec_decode.num_draft_tokens
    assert drafts[0.5] > drafts[0.9] > 0


def test_an_eagle3_head_reads_the_fused_layer_features_the_step_exports(params):
    """An EAGLE-3-style head (fusing the features entering layers 0 and 1): greedy output
    the plain engine's, pages back, and its feature pool holds, at each computed position
    of the sequence, the fusion of what the target's layers read there (the step's
    forward exports them to the head's sync)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from engine_utils import TINY_CFG, TINY_PAGE
    from jaxserve.model.inputs import StepBatch
    from jaxserve.model.kv_cache import init_kv_cache
    from jaxserve.model.transformer import forward_features
    from jaxserve.spec_decode.eagle import fused_features, head_config, init_head
    requests = _requests(max_tokens=24)
    base = outputs(tiny_engine(params), requests, [0, 0, 2])
    vocab = np.sort(np.random.default_rng(1).choice(258, 64, replace=False))
    hp = init_head(TINY_CFG, params, vocab, jax.random.key(1), scale=0.5, num_feature_layers=2)
    engine = tiny_engine(params, eagle=(head_config(TINY_CFG), hp, (0, 1)),
                         speculative_config=EAGLE)
    seen = {}
    verified = engine.scheduler.verified

    def spy(seq, *a, **kw):
        verified(seq, *a, **kw)
        seen[seq.request_id] = (list(seq.block_table), (seq.prompt_ids + seq.output_ids)[:seq.num_computed])

    engine.scheduler.verified = spy
    assert outputs(engine, requests[:1], [0]) == {"r0": base["r0"]}
    assert engine.stats().spec_decode.num_draft_tokens > 10
    assert engine.pool.num_free == engine.pool.capacity
    table, ids = seen["r0"]
    L = len(ids)
    pos = np.arange(L, dtype=np.int32)
    slots = np.asarray(table)[pos // TINY_PAGE] * TINY_PAGE + pos % TINY_PAGE
    pages = np.arange(1, 1 + -(-L // TINY_PAGE), dtype=np.int32)
    batch = jax.tree.map(jnp.asarray, StepBatch(
        tokens=np.asarray(ids, np.int32), positions=pos,
        slot_mapping=pages[pos // TINY_PAGE] * TINY_PAGE + pos % TINY_PAGE,
        block_tables=pages[None], seq_lens=np.array([L], np.int32),
        query_start=np.array([0, L], np.int32), logits_indices=np.array([L - 1], np.int32)))
    _, feats, _ = forward_features(params, init_kv_cache(TINY_CFG, len(pages) + 1, TINY_PAGE,
                                                         TINY_CFG.dtype), batch, TINY_CFG,
                                   feature_layers=(0, 1))
    want = np.asarray(fused_features(hp.fuse, feats))
    got = np.asarray(engine.runner.draft_cache[1])[slots]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_eagle_head_files_round_trip(params, tmp_path):
    import numpy as np

    from engine_utils import TINY_CFG
    from jaxserve.spec_decode.eagle import load_head, save_head
    hcfg, hp = _tiny_head(params)
    save_head(tmp_path / "h", hp, TINY_CFG, {"note": "test"})
    cfg2, hp2, layers = load_head(tmp_path / "h", TINY_CFG, params)
    assert cfg2 == hcfg and layers == () and hp2.fuse is None
    np.testing.assert_array_equal(np.asarray(hp2.vocab), np.asarray(hp.vocab))
    # stored in float16: 11 significant bits, a relative rounding of at most 2**-11
    np.testing.assert_allclose(np.asarray(hp2.body.layers[0].wq), np.asarray(hp.body.layers[0].wq),
                               rtol=2 ** -11, atol=1e-7)
    np.testing.assert_allclose(np.asarray(hp2.body.lm_head), np.asarray(hp.body.lm_head))
    with pytest.raises(ConfigError, match="trained for a target"):
        load_head(tmp_path / "h", TINY_CFG.replace(hidden_size=64, num_heads=8), params)
    with pytest.raises(ConfigError, match="not an EAGLE head"):
        load_head(tmp_path, TINY_CFG, params)
    # an EAGLE-3-style head: its fuse and feature layers come back
    import jax

    from jaxserve.spec_decode.eagle import init_head
    hp3 = init_head(TINY_CFG, params, np.asarray(hp.vocab), jax.random.key(3), scale=0.5,
                    num_feature_layers=2)
    with pytest.raises(ValueError, match="feature_layers"):
        save_head(tmp_path / "h3", hp3, TINY_CFG)
    save_head(tmp_path / "h3", hp3, TINY_CFG, feature_layers=(0, 1))
    _, got, layers = load_head(tmp_path / "h3", TINY_CFG, params)
    assert layers == (0, 1)
    np.testing.assert_allclose(np.asarray(got.fuse), np.asarray(hp3.fuse), rtol=2 ** -11, atol=1e-7)


# --- configuration ------------------------------------------------------------------------

def test_speculative_config_from_vllm_json():
    cfg = EngineConfig().override(speculative_config='{"method": "ngram", '
                                  '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                  '"prompt_lookup_min": 2}')
    assert cfg.speculative == SpeculativeConfig("ngram", 4, 4, 2)
    assert EngineConfig().override(speculative_config=None).speculative is None
    from jaxserve.worker.compilation import StepShapes
    assert StepShapes(cfg).verify_seq_buckets[-1] == cfg.speculative.disable_by_batch_size
    assert SpeculativeConfig("ngram", 2).prompt_lookup_min == 2


def test_every_shipped_config_loads():
    from pathlib import Path

    from jaxserve.config import load_config
    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.py"))
    loaded = {c.name: load_config(c) for c in configs if c.name != "__init__.py"}
    spec = loaded["smollm2_135m_ngram.py"].engine.speculative
    assert spec.method == "ngram" and spec.disable_by_batch_size == 2


@pytest.mark.parametrize("bad, field", [
    ("{not json", "not valid JSON"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 64},
     "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "verify_steps": 0}, "verify_steps"),
    ({"method": "ngram", "num_speculative_tokens": 2, "verify_steps": 17}, "verify_steps"),
    ({"method": "ngram", "num_speculative_tokens": 16, "disable_by_batch_size": 32},
     "max_num_batched_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_confidence_threshold": 0.3},
     "draft_confidence_threshold"),
    ({"method": "eagle", "model": "h", "num_speculative_tokens": 2,
      "draft_confidence_threshold": 1.0}, "draft_confidence_threshold"),
    ({"method": "eagle", "model": "h", "num_speculative_tokens": 2,
      "draft_confidence_threshold": "high"}, "draft_confidence_threshold"),
])
def test_bad_speculative_configs_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig(max_model_len=512).override(max_num_batched_tokens=256,
                                                 speculative_config=bad)


# --- the real model: n-gram prompt lookup -------------------------------------------------

NGRAM4 = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
          "prompt_lookup_min": 2, "verify_steps": 3}


@pytest.fixture(scope="module")
def spec_llm(smollm2_checkpoint, cache_dir):
    """SmolLM2-135M with the small test engine (f32 matmuls: batch-invariant, so greedy
    tokens can be compared exactly) and n-gram speculation; compiles the step shapes the
    tests use on first use (no warm-up); verify steps of up to 3 rounds."""
    from conftest import SMALL_CONFIG
    from jaxserve.api import LLM
    from jaxserve.config import load_config
    return LLM(load_config(SMALL_CONFIG), cache_dir=cache_dir, warmup=False,
               speculative_config=NGRAM4)


def _copy_prompts(tok):
    code = open(__file__.replace("test_spec_decode.py", "../jaxserve/spec_decode/ngram.py")).read()
    text = ("The river rises in the hills, runs west past the mill and the old stone bridge, "
            "and reaches the sea at the harbour town, where the boats come in each evening.")
    return [tok.apply_chat_template([{"role": "user", "content": m}]) for m in (
        "Repeat this sentence word for word, twice:\n" + text,
        "Rename the class to LookupProposer and give back the whole code:\n\n" + code[-700:],
        "Name three colours.")]


def _accepted_positions(engine):
    """Spy on the engine's verify results: {prompt ids tuple: output indices of accepted
    drafts}."""
    seen = {}
    verified = engine._verified_alone

    def spy(seq, rounds, tokens, logprobs, ahead=0):
        index = seq.num_known - len(seq.prompt_ids)  # its verify step's first token
        for num_drafts, kept in rounds:  # each round: accepted drafts, then one more
            seen.setdefault(tuple(seq.prompt_ids), set()).update(
                range(index, index + kept - 1))
            index += kept
        verified(seq, rounds, tokens, logprobs, ahead)

    engine._verified_alone = spy
    return seen


def test_real_model_ngram_greedy_is_token_for_token_the_plain_greedy(small_llm, spec_llm):
    """Alone and batched (a request with no repeats rides along without drafts), and
    with stops (a stop token, max_tokens) that fall inside an accepted run."""
    tok = small_llm.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in _copy_prompts(tok)]
    sp = SamplingParams(temperature=0, max_tokens=80)
    want = [c.token_ids for c in small_llm.generate(prompts, sp)]
    engine = spec_llm.engine
    before = engine.stats()
    accepted = _accepted_positions(engine)
    planned_ahead = _ahead_counter(engine)
    batched = spec_llm.generate(prompts, sp)
    alone = spec_llm.generate([prompts[0]], sp)[0]  # the copy prompt: drafts accepted alone
    assert [c.token_ids for c in batched] == want
    assert alone.token_ids == want[0]
    # most verify steps were dispatched before the one before them was read, their
    # n-gram drafts looked up on device, in rounds
    assert len(planned_ahead) > 10
    assert any(p.num_steps == 3 for p in planned_ahead)
    st = engine.stats()
    drafts = st.spec_decode.num_drafts - before.spec_decode.num_drafts
    gained = st.spec_decode.num_accepted_tokens - before.spec_decode.num_accepted_tokens
    assert drafts > 0 and gained / drafts > 0.5, "the copy prompts should accept drafts"
    # a stop inside an accepted run: the first accepted draft whose token did not occur
    # earlier in the output, as a stop token; and a max_tokens that ends a run early
    prompt, ids = prompts[0], want[0]
    pos = sorted(i for i in accepted[tuple(prompt)]
                 if 3 < i < len(ids) and ids[i] not in ids[:i])
    assert pos, "no accepted draft to stop on"
    for stop in (SamplingParams(temperature=0, max_tokens=80, stop_token_ids=(ids[pos[0]],)),
                 SamplingParams(temperature=0, max_tokens=pos[0])):
        got, plain = spec_llm.generate([prompt], stop)[0], small_llm.generate([prompt], stop)[0]
        assert (got.token_ids, got.finish_reason) == (plain.token_ids, plain.finish_reason)
        assert len(got.token_ids) <= pos[0] + 1
    assert engine.pool.num_free == engine.pool.capacity


@pytest.mark.full  # fast tier: n-gram greedy on the real model; seeded speculative sampling on the tiny one
def test_real_model_seeded_speculative_sampling_is_reproducible(spec_llm):
    tok = spec_llm.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in _copy_prompts(tok)[:2]]
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=48)
    first = [c.token_ids for c in spec_llm.generate(prompts, sp)]
    again = [c.token_ids for c in spec_llm.generate(prompts[::-1], sp)][::-1]
    assert first == again and all(len(t) > 8 for t in first)


@pytest.fixture(scope="module")
def draft_llm(smollm2_checkpoint, cache_dir, tmp_path_factory):
    """SmolLM2-135M (small test engine, f32) with a draft model: its own first 4 layers
    (jaxserve.checkpoint.truncate_checkpoint, what tools/make_draft_model.py writes)."""
    from conftest import SMALL_CONFIG
    from jaxserve.api import LLM
    from jaxserve.checkpoint import truncate_checkpoint
    from jaxserve.config import load_config
    draft = truncate_checkpoint(smollm2_checkpoint, tmp_path_factory.mktemp("draft") / "d4", 4)
    return LLM(load_config(SMALL_CONFIG), cache_dir=cache_dir, warmup=False, speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})


def _same_greedy_as_plain(small_llm, llm, max_tokens, alone):
    """The copy prompts batched, and prompt `alone` by itself, through `llm`: their greedy
    tokens must be small_llm's (plain decoding). Returns llm's engine stats."""
    tok = small_llm.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in _copy_prompts(tok)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    want = [c.token_ids for c in small_llm.generate(prompts, sp)]
    assert [c.token_ids for c in llm.generate(prompts, sp)] == want
    assert llm.generate([prompts[alone]], sp)[0].token_ids == want[alone]
    return llm.engine.stats()


@pytest.mark.full  # fast tier: a draft model (tiny) proposing in the verify step
def test_real_model_draft_model_greedy_is_the_plain_greedy(small_llm, draft_llm):
    """A 4-layer truncated copy as the draft: token for token the plain greedy output,
    alone and batched; its proposals are accepted often enough to be the target's."""
    st = _same_greedy_as_plain(small_llm, draft_llm, 48, alone=1)
    assert st.spec_decode.num_drafts > 10 and st.spec_decode.num_accepted_tokens > 0
    assert st.scheduler.free_pages == st.scheduler.total_pages
    _planned_as_built(draft_llm)


def _planned_as_built(llm):
    """The memory plan of llm's config counts the drafter's pages as build_engine does:
    the same number of pages (fewer than without the drafter), its pool beside the
    target's."""
    from conftest import SMALL_CONFIG
    from jaxserve.config import load_config
    from jaxserve.worker.memory_plan import plan_memory
    eng = llm.engine
    config = load_config(SMALL_CONFIG).replace(engine=eng.engine_config)
    plan = plan_memory(config, eng.model_config)
    plain = plan_memory(config.replace(engine=eng.engine_config.override(speculative_config=None)),
                        eng.model_config)
    assert plan.kv_pages == eng.runner.cache.num_pages < plain.kv_pages
    assert plan.draft_pool > 0 and plan.total > plan.weights + plan.kv_pool + plan.activations
    assert "drafter pool" in plan.table()


# fast tier: an EAGLE head (tiny) keeps greedy output; n-gram greedy on the real model
@pytest.mark.full
def test_real_model_eagle_head_greedy_is_the_plain_greedy(small_llm, cache_dir):
    """The EAGLE head that ships (configs/smollm2_135m_eagle.py's), loaded through the
    config: token for token the plain greedy output, batched and alone, every page back;
    and its drafts are accepted (a random head's over a 4k-token draft vocabulary next to
    never are; the trained one had about half its first drafts accepted on held-out text)."""
    from conftest import SMALL_CONFIG
    from jaxserve.api import LLM
    from jaxserve.config import load_config

    spec = load_config(ROOT / "configs" / "smollm2_135m_eagle.py").engine.speculative
    llm = LLM(load_config(SMALL_CONFIG), cache_dir=cache_dir, warmup=False,
              speculative=spec)
    st = _same_greedy_as_plain(small_llm, llm, 32, alone=2)
    assert st.spec_decode.num_drafts > 10 and st.scheduler.free_pages == st.scheduler.total_pages
    assert st.spec_decode.num_accepted_tokens > 0.1 * st.spec_decode.num_draft_tokens
    _planned_as_built(llm)


def test_a_draft_that_is_not_a_checkpoint_is_refused(tmp_path, smollm2_config):
    from jaxserve.engine.builder import build_engine
    with pytest.raises(ConfigError, match="not a jaxserve checkpoint"):
        build_engine(smollm2_config.replace(engine=smollm2_config.engine.override(
            speculative_config={"method": "draft_model", "model": str(tmp_path),
                                "num_speculative_tokens": 2})), warmup=False)


def test_flag_and_metrics():
    """serve.py --speculative-config takes vLLM's JSON; /metrics carries the counters."""
    import argparse

    from prometheus_client.parser import text_string_to_metric_families

    from jaxserve.config.args import ENGINE_FLAGS, add_flags, given
    from jaxserve.entrypoints.metrics import Metrics

    ap = argparse.ArgumentParser()
    add_flags(ap, ENGINE_FLAGS)
    args = ap.parse_args(["--speculative-config", '{"method": "ngram", '
                          '"num_speculative_tokens": 3}'])
    cfg = EngineConfig().override(**given(args))
    assert cfg.speculative == SpeculativeConfig("ngram", 3)
    with pytest.raises(ConfigError, match="unknown key"):
        given(ap.parse_args(["--speculative-config", '{"k": 1}']))
    from jaxserve.engine.scheduler import SchedulerStats
    from jaxserve.engine.stats import EngineStats
    from jaxserve.spec_decode.controller import SpecDecodeStats
    zeros = lambda cls, *skip: {f.name: 0 for f in dataclasses.fields(cls)  # noqa: E731
                                if f.name not in skip}
    events = compile_events.CompileEvents(
        {"trace": 5, "lowering": 4, "compilation": 3, "cache_fetch": 2},
        dict.fromkeys(compile_events.KINDS, 0.5))
    stats = EngineStats(scheduler=SchedulerStats(**zeros(SchedulerStats)),
                        spec_decode=SpecDecodeStats(4, 12, 7, [4, 2, 1]), compile_events=events,
                        num_forced_tokens=9,
                        **zeros(EngineStats, "scheduler", "spec_decode", "compile_events",
                                "num_forced_tokens"))
    samples = {(s.name, tuple(s.labels.items())): s.value
               for f in text_string_to_metric_families(Metrics(lambda: stats).render().decode())
               for s in f.samples}
    assert samples[("jaxserve:spec_decode_num_drafts_total", ())] == 4
    assert samples[("jaxserve:spec_decode_num_draft_tokens_total", ())] == 12
    assert samples[("jaxserve:spec_decode_num_accepted_tokens_total", ())] == 7
    assert [samples[("jaxserve:spec_decode_num_accepted_tokens_per_pos_total",
                     (("position", str(j)),))] for j in range(3)] == [4, 2, 1]
    # the process's JAX compile events, by kind (/health: as jax_traces, ...)
    assert {k: samples[("jaxserve:jax_compile_events_total", (("kind", k),))]
            for k in compile_events.KINDS} == events.counts
    assert samples[("jaxserve:jax_compile_seconds_total", (("kind", "trace"),))] == 0.5
    # jump-forward's tokens (structured output), /health's num_forced_tokens too
    assert samples[("jaxserve:structured_output_forced_tokens_total", ())] == 9
    health = stats.as_dict()
    assert health["num_forced_tokens"] == 9
    assert (health["jax_traces"], health["jax_lowerings"], health["jax_compilations"],
            health["jax_cache_fetches"], health["jax_compile_events"]) == (5, 4, 3, 2, 14)
