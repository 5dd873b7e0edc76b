"""jaxserve.functional: generation as a pure function (jit, vmap) and teacher-forced
scoring, on the real model and a tiny random one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxserve import functional
from jaxserve.config import ModelConfig
from jaxserve.model.params import init_params
from jaxserve.sampling_params import SamplingParams

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def tiny():
    return init_params(TINY, jax.random.key(0), scale=0.5)


@pytest.fixture(scope="module")
def real(smollm2_checkpoint):
    from jaxserve.checkpoint import load_model_config, load_params
    cfg = load_model_config(smollm2_checkpoint)
    return load_params(smollm2_checkpoint, cfg), cfg


def pad(prompts, width=None):
    width = width or max(map(len, prompts))
    toks = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    return jnp.asarray(toks), jnp.asarray([len(p) for p in prompts], jnp.int32)


def test_greedy_tokens_equal_the_engine_and_logprobs_equal_scoring(real, small_llm):
    """Greedy generation of prompts of three lengths, batched: the engine's greedy tokens
    (jaxserve.LLM), and logprobs equal to a teacher-forced `score` of prompt + output. The
    bound: both are f32 log-softmaxes of the same logits computed in other batch shapes
    (decode rows vs one prefill); measured logit noise from batch shape alone is 7e-5 on
    |logits| of 32 (PERFORMANCE.md), and a log-softmax adds at most as much again."""
    params, cfg = real
    texts = ["The capital of France is", "Write a haiku about rain.", "def fibonacci(n):"]
    prompts = [small_llm.tokenizer.encode(t) for t in texts]
    toks, lens = pad(prompts)
    N = 12
    out, logprobs = functional.generate(params, cfg, toks, lens, jax.random.key(0),
                                        max_new_tokens=N, temperature=0.0)
    want = small_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=N,
                                                      ignore_eos=True))
    assert [list(map(int, r)) for r in out] == [w.token_ids for w in want]
    seqs, seq_lens = pad([p + list(map(int, o)) for p, o in zip(prompts, out)])
    scored = functional.score(params, cfg, seqs, seq_lens)
    for b, p in enumerate(prompts):
        got = np.asarray(scored[b, len(p):len(p) + N])
        np.testing.assert_allclose(np.asarray(logprobs[b]), got, atol=2e-4, rtol=0)
        assert np.all(got <= 0) and np.all(got > -30)
    # sampled (temperature 1, top-p): the raw-logit logprobs of what was drawn, likewise
    out, logprobs = functional.generate(params, cfg, toks, lens, jax.random.key(1),
                                        max_new_tokens=N, temperature=1.0, top_p=0.9)
    seqs, seq_lens = pad([p + list(map(int, o)) for p, o in zip(prompts, out)])
    scored = functional.score(params, cfg, seqs, seq_lens)
    for b, p in enumerate(prompts):
        np.testing.assert_allclose(np.asarray(logprobs[b]),
                                   np.asarray(scored[b, len(p):len(p) + N]), atol=2e-4, rtol=0)


def test_vmap_over_keys_equals_separate_calls(tiny):
    toks, lens = pad([[1, 2, 3], [4, 5]])
    keys = jax.random.split(jax.random.key(1), 3)
    run = lambda k: functional.generate(tiny, TINY, toks, lens, k, max_new_tokens=6)  # noqa: E731
    batched_t, batched_l = jax.vmap(run)(keys)
    for i, k in enumerate(keys):
        t, lp = run(k)
        np.testing.assert_array_equal(batched_t[i], t)
        np.testing.assert_allclose(batched_l[i], lp, atol=1e-5)
    assert len({tuple(np.asarray(t).ravel()) for t in batched_t}) > 1  # keys differ, samples too


def test_vmap_over_prompts_and_rows_do_not_depend_on_each_other(tiny):
    """Prompt batches under vmap give each batch's own results; and a row's samples do not
    depend on the other rows (each row's randomness is its own)."""
    a = pad([[1, 2, 3], [4, 5, 6]])
    b = pad([[7, 8, 9], [10, 11, 12]])
    key = jax.random.key(2)
    run = lambda t, n: functional.generate(tiny, TINY, t, n, key, max_new_tokens=5)  # noqa: E731
    vt, _ = jax.vmap(run)(jnp.stack([a[0], b[0]]), jnp.stack([a[1], b[1]]))
    np.testing.assert_array_equal(vt[0], run(*a)[0])
    np.testing.assert_array_equal(vt[1], run(*b)[0])
    # row 0 with the same prompt and key beside another row: the same tokens
    other = run(*pad([[1, 2, 3], [9, 9]]))[0]
    np.testing.assert_array_equal(other[0], vt[0][0])
    assert not np.array_equal(other[1], vt[0][1])


def test_jit_of_a_loop_around_generate_compiles_once(tiny):
    toks, lens = pad([[1, 2], [3]])

    @jax.jit
    def mean_logprob(params, key):
        _, lp = functional.generate(params, TINY, toks, lens, key, max_new_tokens=4,
                                    temperature=0.7, top_k=8, top_p=0.9)
        return lp.mean()

    v1 = mean_logprob(tiny, jax.random.key(3))
    v2 = mean_logprob(tiny, jax.random.key(4))
    assert mean_logprob._cache_size() == 1 and np.isfinite(v1) and v1 != v2


def test_bad_shapes_are_value_errors(tiny):
    toks, lens = pad([[1, 2]])
    with pytest.raises(ValueError, match=r"prompt_tokens must be \[batch, max_prompt_len\]"):
        functional.generate(tiny, TINY, toks[0], lens, jax.random.key(0), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        functional.generate(tiny, TINY, toks, lens, jax.random.key(0), max_new_tokens=0)


def test_policy_gradient_step_raises_the_rewarded_sequences_logprob(tiny):
    """The README's research loop: sample, score differentiably, one optax update with a
    positive advantage makes the sampled continuation more likely."""
    toks, lens = pad([[1, 2, 3], [4, 5]])
    out, _ = functional.generate(tiny, TINY, toks, lens, jax.random.key(5), max_new_tokens=4)
    seqs, seq_lens = pad([list(map(int, t[:n])) + list(map(int, o))
                          for t, n, o in zip(toks, lens, out)])
    prompt_mask = jnp.arange(seqs.shape[1])[None, :] >= lens[:, None]

    def loss(params):
        return -(functional.score(params, TINY, seqs, seq_lens) * prompt_mask).sum()

    opt = optax.adam(1e-2)
    state = opt.init(tiny)
    before = loss(tiny)
    grads = jax.grad(loss)(tiny)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    updates, state = opt.update(grads, state, tiny)
    after = loss(optax.apply_updates(tiny, updates))
    assert after < before


@pytest.mark.full  # fast tier: the functional generate and score
def test_readme_policy_gradient_example_runs(smollm2_checkpoint, monkeypatch):
    """The README's functional example, as written, on the real model."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text()
    block = text.split("<!-- README example: tests/test_functional.py runs this block -->")[1]
    code = block.split("```python")[1].split("```")[0]
    monkeypatch.chdir(root)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    out, logprobs = ns["out"], ns["logprobs"]
    assert out.shape == (3, 8) and np.all(np.asarray(logprobs) <= 0)
    moved = [float(jnp.abs(u).max()) for u in jax.tree.leaves(ns["updates"])]
    assert all(np.isfinite(moved)) and max(moved) > 0


def test_jaxserve_generate_keeps_its_engine_between_calls(monkeypatch):
    """jaxserve.generate builds the engine of a config once and reuses it for the next
    calls with an equal config; another config replaces it (an LLM stand-in counts the
    builds: building the real one is what this avoids)."""
    from pathlib import Path

    from jaxserve import api
    from jaxserve.config import load_config

    built = []

    class Counting:
        def __init__(self, config, cache_dir=None):
            built.append(config)

        def generate(self, prompts, sampling_params=None):
            return [f"{len(built)}:{p}" for p in prompts]

    monkeypatch.setattr(api, "LLM", Counting)
    api._kept_llm.cache_clear()
    try:
        root = Path(__file__).resolve().parent.parent
        assert api.generate(["a"]) == ["1:a"] and api.generate(["b"]) == ["1:b"]
        assert api.generate(["c"], config=load_config(root / "configs/smollm2_135m.py")) == ["1:c"]
        assert api.generate(["d"], config=root / "tests/configs/smollm2_small.py") == ["2:d"]
        assert len(built) == 2
    finally:
        api._kept_llm.cache_clear()
