"""Embeddings (EngineConfig.pooling, /v1/embeddings, LLM.embed) on the real SmolLM2-135M:
related sentences closer than unrelated ones, the engine's vectors equal to
`jaxserve.functional.embed` (mean over chunked prefills too), embedding requests sharing
ragged steps with generation without changing it and keeping no pages, and the OpenAI
endpoint through the openai SDK (base64 by default, floats, token ids, batches, errors)."""

import numpy as np
import pytest

from jaxserve import functional
from jaxserve.model.inputs import StepBatch
from jaxserve.sampling_params import SamplingParams
from jaxserve.model.pooling import pool_hidden

SMALL = "tests/configs/smollm2_small.py"
SENTENCES = ["A cat sits on the mat.", "A kitten is sitting on a rug.",
             "The stock market fell sharply today.", "Stocks dropped a lot on Wall Street."]


@pytest.fixture(scope="module")
def embed_llm(smollm2_checkpoint, cache_dir):
    """The small test engine with mean pooling and 128-token steps (a longer input is
    prefilled in chunks)."""
    from jaxserve.api import LLM
    from jaxserve.config import load_config
    cfg = load_config(SMALL)
    cfg = cfg.replace(engine=cfg.engine.override(pooling="mean", max_num_batched_tokens=128))
    return LLM(cfg, cache_dir=cache_dir, warmup=False)


def reference(llm, texts, pooling="mean") -> np.ndarray:
    """functional.embed of the texts (one padded batch) with the engine's own params."""
    ids = [llm.tokenizer.encode(t) if isinstance(t, str) else t for t in texts]
    tokens = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for i, x in enumerate(ids):
        tokens[i, :len(x)] = x
    return np.asarray(functional.embed(llm.engine.runner.params, llm.engine.model_config,
                                       tokens, np.array([len(x) for x in ids]), pooling))


def test_related_sentences_are_closer_and_match_functional(embed_llm):
    got = np.array(embed_llm.embed(SENTENCES))
    assert got.shape == (4, embed_llm.engine.model_config.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cos = got @ got.T
    assert cos[0, 1] > max(cos[0, 2], cos[0, 3]) and cos[1, 0] > max(cos[1, 2], cos[1, 3])
    assert cos[2, 3] > max(cos[2, 0], cos[2, 1]) and cos[3, 2] > max(cos[3, 0], cos[3, 1])
    # f32 matmuls: the served vectors are the functional forward's (1e-4: summation order)
    np.testing.assert_allclose(got, reference(embed_llm, SENTENCES), atol=1e-4)


def test_a_long_input_is_mean_pooled_over_its_chunks(embed_llm):
    """300 tokens in 128-token steps: three chunks, summed on the host; a prefix in the
    prefix cache is not reused (every row must be computed for the mean)."""
    rng = np.random.default_rng(0)
    long_ids = rng.integers(100, 40000, 300).tolist()
    first = embed_llm.embed([long_ids])[0]
    again = embed_llm.embed([long_ids])[0]  # its pages are in the prefix cache now
    ref = reference(embed_llm, [long_ids])[0]
    np.testing.assert_allclose(first, ref, atol=1e-4)
    np.testing.assert_allclose(again, ref, atol=1e-4)


def test_embeddings_share_steps_with_generation_and_keep_no_pages(embed_llm):
    engine = embed_llm.engine
    prompts = ["Write a haiku about the sea.", "List three colours."]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    alone = [c.token_ids for c in embed_llm.generate(prompts, greedy)]
    free = engine.scheduler.kv.num_free
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", embed_llm.tokenizer.encode(p), greedy)
    for i, s in enumerate(SENTENCES):
        engine.add_request(f"e{i}", embed_llm.tokenizer.encode(s), greedy, embed=True)
    done, mixed_steps = {}, 0
    while len(done) < 6:
        outs = engine.step()
        mixed_steps += any(o.request_id.startswith("g") and not o.finished for o in outs) and \
            any(o.request_id.startswith("e") for o in outs)
        done.update({o.request_id: o for o in outs if o.finished})
    assert mixed_steps >= 1  # an embedding finished in a step that also decoded
    assert [done[f"g{i}"].token_ids for i in range(2)] == alone
    embedded = np.array([done[f"e{i}"].embedding for i in range(4)])
    np.testing.assert_allclose(embedded, reference(embed_llm, SENTENCES), atol=1e-4)
    assert all(done[f"e{i}"].finish_reason in ("stop", "length") for i in range(4))
    assert engine.scheduler.kv.num_free == free  # nothing kept but the prefix cache's


def test_pool_hidden_last_and_mean_per_sequence():
    """The step's pooling: "last" each sequence's logits row, "mean" the sum of its rows,
    padding rows and sequences adding nothing."""
    hidden = np.arange(7 * 2, dtype=np.float32).reshape(7, 2)
    batch = StepBatch(tokens=np.zeros(7, np.int32), positions=np.zeros(7, np.int32),
                      slot_mapping=np.zeros(7, np.int32), block_tables=np.zeros((3, 1), np.int32),
                      seq_lens=np.array([2, 3, 0], np.int32),
                      query_start=np.array([0, 2, 5, 5], np.int32),
                      logits_indices=np.array([1, 4, 0], np.int32))
    last = np.asarray(pool_hidden(hidden, batch, "last"))
    np.testing.assert_array_equal(last[:2], hidden[[1, 4]])
    mean = np.asarray(pool_hidden(hidden, batch, "mean"))
    np.testing.assert_array_equal(mean, [hidden[0:2].sum(0), hidden[2:5].sum(0), [0, 0]])


def test_embeddings_endpoint_through_the_openai_sdk(embed_llm):
    import openai
    from starlette.testclient import TestClient

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.openai.api_server import build_app
    want = np.array(embed_llm.embed(SENTENCES))
    bridge = AsyncEngine(embed_llm.engine)
    try:
        app = build_app(bridge, embed_llm.tokenizer, "smollm2", 512)
        with TestClient(app) as http, openai.OpenAI(
                base_url="http://testserver/v1", api_key="x", http_client=http,
                max_retries=0) as client:
            r = client.embeddings.create(model="smollm2", input=SENTENCES)  # base64 asked
            got = np.array([d.embedding for d in r.data])
            np.testing.assert_allclose(got, want, atol=1e-5)
            assert [d.index for d in r.data] == [0, 1, 2, 3]
            ids = [embed_llm.tokenizer.encode(s) for s in SENTENCES]
            assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
            body = http.post("/v1/embeddings", json={"input": ids[1],
                                                     "encoding_format": "float"}).json()
            np.testing.assert_allclose(body["data"][0]["embedding"], want[1], atol=1e-5)
            body = http.post("/v1/embeddings", json={"input": SENTENCES[2], "dimensions": 576})
            assert body.status_code == 200
            for bad, param, status in [
                    ({"input": "x", "dimensions": 64}, "dimensions", 400),
                    ({"input": ""}, "input", 400), ({"input": ["ok", ""]}, "input.1", 400),
                    ({"input": [[1, 2], [49152]]}, "input.1", 400),
                    ({"input": list(range(1, 600))}, "input", 400),
                    ({"input": "x", "encoding_format": "int8"}, "encoding_format", 400),
                    ({"input": "x", "model": "other"}, "model", 404)]:
                r = http.post("/v1/embeddings", json=bad)
                assert (r.status_code, r.json()["error"]["param"]) == (status, param), bad
            assert http.get("/health").status_code == 200
    finally:
        bridge.shutdown()


def test_offline_batch_embeds_beside_chat(embed_llm, tmp_path):
    """`jaxserve batch` lines for /v1/embeddings are answered as the server answers them,
    beside chat lines, through the same engine."""
    import asyncio
    import json

    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.openai.run_batch import run_batch
    from jaxserve.entrypoints.openai.serving import OpenAIServing
    want = np.array(embed_llm.embed(SENTENCES[:2]))
    lines = [{"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": SENTENCES[:2]}},
             {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": "x", "dimensions": 3}}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    bridge = AsyncEngine(embed_llm.engine)
    try:
        serving = OpenAIServing(bridge, embed_llm.tokenizer, "smollm2", 512)
        stats = asyncio.run(run_batch(serving, inp, out, max_concurrency=4, progress=False))
    finally:
        bridge.shutdown()
    got = {r["custom_id"]: r["response"] for r in map(json.loads, out.read_text().splitlines())}
    assert (stats.succeeded, stats.failed) == (2, 1)
    body = got["e"]["body"]
    assert body["object"] == "list" and got["c"]["body"]["object"] == "chat.completion"
    np.testing.assert_allclose([d["embedding"] for d in body["data"]], want, atol=1e-5)
    assert got["bad"]["status_code"] == 400
    assert got["bad"]["body"]["error"]["param"] == "dimensions"
