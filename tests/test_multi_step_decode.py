"""Multi-step decode (SchedulerConfig.decode_steps): several tokens per sequence in one
dispatched step must change nothing but speed.

- the runner's n-step decode gives the tokens, logprobs and KV pages of n single steps
  (greedy and seeded-sampling rows, a padding sequence, a page boundary crossed inside
  the step);
- the engine with decode_steps=4 returns exactly what decode_steps=1 returns for a mix of
  requests arriving over time (max_tokens not a multiple of 4, stop strings and stop token
  ids hit inside a burst, seeded sampling), leaves the pool empty, and really ran
  multi-step steps;
- a waiting request turns multi-step off; an abort inside a burst reports no placeholder.

Tiny random model with the byte-level test tokenizer (vocab 258), XLA kernels.
"""

import dataclasses

import numpy as np
import pytest

from engine_utils import TINY_CFG as CFG, TINY_ECFG as ECFG, TINY_PAGE as PAGE
from engine_utils import run_staggered, tiny_engine, tiny_params
from jaxserve.engine.batch_builder import step_batch
from jaxserve.engine.engine import Engine
from jaxserve.worker.runner import Runner
from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.engine.sequence import PLACEHOLDER, Sequence
from jaxserve.model.kv_cache import init_kv_cache
from jaxserve.model.transformer import Kernels
from jaxserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def params():
    return tiny_params()


def make_engine(params, decode_steps: int) -> Engine:
    return tiny_engine(params, decode_steps=decode_steps)


def run(engine: Engine, requests, arrivals) -> dict:
    """engine_utils.run_staggered, checking that no output carries a placeholder. Returns
    {id: (token_ids, text, finish_reason)}."""
    def no_placeholder(out):
        assert PLACEHOLDER not in out.token_ids

    done, _ = run_staggered(engine, requests, arrivals, check=no_placeholder, max_steps=1000)
    return {rid: (o.token_ids, o.text, o.finish_reason) for rid, o in done.items()}


def test_runner_multi_step_equals_single_steps(params):
    """4 tokens in one step == 4 single steps chained through the device (prev_index):
    same tokens, same logprobs, same K/V in every page."""
    seqs = []
    for i, (n, sp) in enumerate([(5, SamplingParams(temperature=0)),
                                 (3, SamplingParams(temperature=0.9, seed=11)),
                                 (7, SamplingParams(temperature=0.7, top_k=20, seed=5))]):
        seq = Sequence(request_id=str(i), prompt_ids=list(range(10 + i, 10 + i + n)),
                       params=sp, seed=sp.seed or 0)
        # room for the prompt and 4 more tokens; prompt 3 -> 3 + 4 crosses a page boundary
        seq.block_table = [1 + 4 * i + j for j in range(-(-(n + 4) // PAGE))]
        seqs.append(seq)
    results = []
    for n_steps in (1, 4):
        runner = Runner(CFG, ECFG, params,
                        init_kv_cache(CFG, 65, PAGE, CFG.dtype, layout="head_major"),
                        Kernels("xla", "xla", "xla"))
        run_seqs = [dataclasses.replace(s, output_ids=[], block_table=list(s.block_table))
                    for s in seqs]
        b, smp, _ = step_batch(SchedulerOutput(run_seqs, [s.num_tokens for s in run_seqs]),
                               runner.shapes)
        first = runner.run(b, smp).tokens
        for j, s in enumerate(run_seqs):
            s.output_ids.append(int(first[0, j]))
        tokens, logprobs, prev = [], [], {}
        for _ in range(4 // n_steps):
            for s in run_seqs:  # every token but the last is in the pages
                s.num_computed = s.num_tokens - 1
            b, smp, prev_index = step_batch(SchedulerOutput(run_seqs, [1] * len(run_seqs)),
                                            runner.shapes, prev)
            t, lp = runner.run(b, smp, n_steps, prev_index=prev_index)[:2]
            tokens.append(t[:, :3])
            logprobs.append(lp[:, :3])
            for j, s in enumerate(run_seqs):  # the next step reads them from the device
                s.output_ids.extend([PLACEHOLDER] * n_steps)
            prev = {s: j for j, s in enumerate(run_seqs)}
        assert b.seq_lens.shape == (4,) and b.seq_lens[3] == 0, "one padding sequence"
        results.append((np.concatenate(tokens), np.concatenate(logprobs),
                        [np.asarray(k) for k in runner.cache.k + runner.cache.v]))
    (t1, lp1, kv1), (t4, lp4, kv4) = results
    np.testing.assert_array_equal(t4, t1)
    np.testing.assert_allclose(lp4, lp1, atol=1e-5)
    for a, b in zip(kv4, kv1):  # the null page (0) takes padding writes: compare the rest
        np.testing.assert_allclose(a[:, 1:], b[:, 1:], atol=1e-5)
    assert np.abs(kv4[0][:, 1:]).sum() > 0


def test_engine_multi_step_equals_single_step(params):
    """A mix of requests arriving over time: decode_steps=4 returns exactly the tokens,
    text and finish reasons of decode_steps=1, with the stops inside a burst."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in (3, 9, 14, 6, 11)]
    base = [SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=22, temperature=0.9, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=17, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)]
    arrivals = [0, 0, 3, 5, 6]
    single = make_engine(params, 1)
    free = run(single, [(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, base))],
               arrivals)
    # stops that land mid-burst: request 2 stops on the token at output index 6 (sixth of
    # a 4-token burst after the first), request 4 on a string ending inside its output
    stop_tok = free["2"][0][6]
    text4 = free["4"][1]
    stop_str = text4[len(text4) // 2:len(text4) // 2 + 2]
    params_ = list(base)
    params_[2] = dataclasses.replace(base[2], stop_token_ids=[stop_tok])
    params_[4] = dataclasses.replace(base[4], stop=[stop_str])
    requests = [(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params_))]
    want = run(make_engine(params, 1), requests, arrivals)
    multi = make_engine(params, 4)
    got = run(multi, requests, arrivals)
    assert got == want
    assert want["2"][2] == "stop" and len(want["2"][0]) <= 7
    assert want["4"][2] == "stop" and stop_str not in want["4"][1]
    assert {k.n for k in multi.runner._compiled} == {1, 4}, "multi-step steps ran"
    assert multi.num_steps < single.num_steps
    assert not multi.scheduler.running and not multi.scheduler.waiting
    assert multi.pool.num_free == multi.pool.capacity


def test_waiting_request_turns_multi_step_off(params):
    engine = make_engine(params, 4)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], sp)
    engine.step()  # prefill of a
    engine.step()  # decode: nothing waits -> 4 tokens
    seq = engine.scheduler.requests["a"]
    assert seq.output_ids.count(PLACEHOLDER) == 4
    assert engine.scheduler._num_decode_steps(SchedulerOutput([seq], [1]), False) == 4
    engine.add_request("b", [4, 5], sp)
    assert engine.scheduler._num_decode_steps(SchedulerOutput([seq], [1]), False) == 1
    # near max_tokens: fewer than 4 tokens left -> single steps
    engine.abort_request("b")
    seq.params = dataclasses.replace(sp, max_tokens=len(seq.output_ids) + 3)
    assert engine.scheduler._num_decode_steps(SchedulerOutput([seq], [1]), False) == 1


@pytest.mark.parametrize("host_branches", [False, True])
def test_host_branches_burst_only_plain_batches(params, host_branches):
    """With the host deciding the sampler's branches (Kernels.host_branches, GPUs') a batch
    in which a sequence uses logits controls or asks for top logprobs decodes one token
    a step (its multi-step program would be the one with conditionals,
    jaxserve.sample.plan: Scheduler.plain_bursts); with the device deciding it bursts."""
    engine = tiny_engine(params, decode_steps=4,
                         kernels=Kernels("xla", "xla", "xla", host_branches=host_branches))
    assert engine.scheduler.plain_bursts == host_branches
    plain = SamplingParams(max_tokens=20, temperature=0.8, seed=1, ignore_eos=True)
    engine.add_request("a", [1, 2, 3], plain)
    engine.step()  # prefill of a
    seq = engine.scheduler.requests["a"]
    assert engine.scheduler._num_decode_steps(SchedulerOutput([seq], [1]), False) == 4
    for i, asks in enumerate([dict(logprobs=2), dict(presence_penalty=0.5),
                              dict(logit_bias={7: 1.0})]):
        engine.add_request(f"b{i}", [4, 5], dataclasses.replace(plain, **asks))
        engine.step()  # its prefill (a decodes beside it)
        other = engine.scheduler.requests[f"b{i}"]
        n = engine.scheduler._num_decode_steps(SchedulerOutput([seq, other], [1, 1]), False)
        assert n == (1 if host_branches else 4), asks
        engine.abort_request(f"b{i}")
        engine.step()


def test_abort_inside_a_burst_reports_no_placeholder(params):
    engine = make_engine(params, 4)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=40, temperature=0,
                                                      ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.requests["a"].output_ids[-1] == PLACEHOLDER
    engine.abort_request("a")
    outs = [o for _ in range(3) for o in engine.step()]
    aborted = [o for o in outs if o.request_id == "a" and o.finished]
    assert aborted and aborted[0].finish_reason == "abort"
    assert PLACEHOLDER not in aborted[0].token_ids and aborted[0].token_ids
    assert engine.pool.num_free == engine.pool.capacity
