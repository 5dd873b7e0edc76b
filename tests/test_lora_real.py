"""LoRA adapters served on the real model (SmolLM2-135M, f32 engine): requests of two
adapters and the base in one batch give the merged models' tokens and logprobs (the
merged model gives HF peft's logits), and the OpenAI server's LoRA surface: --lora-modules,
/v1/models with parents, /v1/load_lora_adapter and /v1/unload_lora_adapter, requests
naming an adapter as their model, and one-line errors."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.lora.dummy import write_peft_adapter
from jaxserve import functional
from jaxserve.lora import LoRARequest, load_peft_adapter, merge_adapter
from jaxserve.sampling_params import SamplingParams

N = 10


@pytest.fixture(scope="module")
def real(smollm2_checkpoint):
    from jaxserve.checkpoint import load_model_config, load_params
    cfg = load_model_config(smollm2_checkpoint)
    return load_params(smollm2_checkpoint, cfg), cfg


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, real):
    """Two random adapters of SmolLM2's shape: rank 8 over every module; rank 4 over
    q / v / down with rsLoRA; and one of rank 16 (over --max-lora-rank 8)."""
    _, cfg = real
    d = tmp_path_factory.mktemp("smollm2_adapters")
    return {"a1": write_peft_adapter(d / "a1", cfg, r=8, alpha=16, seed=11, b_std=0.02),
            "a2": write_peft_adapter(d / "a2", cfg, r=4, alpha=8, seed=12, b_std=0.03,
                                     modules=["q_proj", "v_proj", "down_proj"],
                                     use_rslora=True),
            "big": write_peft_adapter(d / "big", cfg, r=16, seed=13)}


@pytest.fixture(scope="module")
def lora_llm(smollm2_checkpoint, cache_dir, adapters):
    """The small test engine (f32) serving LoRA: 2 slots of rank 8, a1 from the start
    (--lora-modules); shapes compile on first use."""
    from jaxserve.api import LLM
    from jaxserve.config import load_config
    from conftest import SMALL_CONFIG
    cfg = load_config(SMALL_CONFIG)
    cfg = cfg.replace(engine=cfg.engine.override(
        enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules=(f"a1={adapters['a1']}",)))
    return LLM(cfg, cache_dir=cache_dir, warmup=False)


def _pad(seqs, width=None):
    """seqs as tokens [B, width] int32, zero-padded, and their lengths [B] int32; one
    width for calls of different sequences means one compiled program for them all."""
    width = width or max(map(len, seqs))
    toks = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        toks[i, :len(s)] = s
    return jnp.asarray(toks), jnp.asarray([len(s) for s in seqs], jnp.int32)


def test_adapters_and_base_in_one_batch_match_the_merged_models(lora_llm, real, adapters,
                                                               hf_smollm2_model):
    """Three prompts run together under a1, a2 (loaded by LLM.generate's lora_request) and
    the base, greedy: each request's tokens are those of functional.generate on the base
    with its adapter merged, and its logprobs a teacher-forced score of that merged model
    (the f32 bound of tests/test_functional.py: logits of other batch shapes, 2e-4); the
    adapters change the tokens. The merged model's logits equal HF peft's on the same
    adapter (the f32 bound of tests/test_real_model_parity.py, 1e-3)."""
    import torch
    from peft import PeftModel
    params, cfg = real
    texts = ["The capital of France is", "Write a haiku about rain.", "def fibonacci(n):"]
    prompts = [lora_llm.tokenizer.encode(t) for t in texts]
    which = [LoRARequest("a1"), LoRARequest("a2", 2, str(adapters["a2"])), None]
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=0)
    got = lora_llm.generate(prompts, sp, lora_request=which)
    merged = {name: merge_adapter(params, load_peft_adapter(adapters[name], cfg, 8))
              for name in ("a1", "a2")}
    width = max(map(len, prompts)) + N  # every call below at one shape (one compile each)
    for prompt, req, out in zip(prompts, which, got):
        p = params if req is None else merged[req.lora_name]
        toks, lens = _pad([prompt], width - N)
        want, _ = functional.generate(p, cfg, toks, lens, jax.random.key(0), max_new_tokens=N,
                                      temperature=0.0)
        assert out.token_ids == list(map(int, np.asarray(want)[0])), req
        seq, seq_len = _pad([prompt + out.token_ids], width)
        scored = np.asarray(functional.score(p, cfg, seq, seq_len))[0, len(prompt):len(prompt) + N]
        np.testing.assert_allclose([lp.logprob for lp in out.logprobs], scored, atol=2e-4,
                                   rtol=0)
        if req is not None:  # the adapter matters
            base, _ = functional.generate(params, cfg, toks, lens, jax.random.key(0),
                                          max_new_tokens=N, temperature=0.0)
            assert out.token_ids != list(map(int, np.asarray(base)[0])), req
    # HF peft on a1: the reference the merged model is held to
    ids = prompts[0] + got[0].token_ids
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf_smollm2_model), adapters["a1"]).eval()
    with torch.no_grad():
        want = peft_model(torch.tensor([ids])).logits[0].numpy()
    seq, seq_len = _pad([ids])
    ours = np.asarray(functional.logits(merged["a1"], cfg, seq, seq_len))[0]
    assert np.abs(ours - want).max() <= 1e-3


def test_the_server_loads_lists_serves_and_unloads_adapters(lora_llm, adapters):
    """Through the OpenAI server: /v1/models lists a1 (from --lora-modules) with the base as
    parent; a2 loaded at run time serves requests naming it as model, with the tokens
    LLM.generate gives under a2; unloaded, it is gone from /v1/models and a request for it
    is a 404; bad adapters (rank over the limit, missing files, a name in use) are one-line
    400s, an unknown unload a 404; the base and a1 serve throughout."""
    from starlette.testclient import TestClient
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.openai.api_server import build_app
    prompt = "List three colours:"
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = lora_llm.tokenizer.encode(prompt)
    want = {name: lora_llm.generate([ids], sp, lora_request=None if name is None else
                                    LoRARequest(name, 0, str(adapters[name])))[0].token_ids
            for name in ("a1", "a2", None)}
    lora_llm.engine.remove_lora("a2")  # the server loads it again below
    bridge = AsyncEngine(lora_llm.engine)
    app = build_app(bridge, lora_llm.tokenizer, "smollm2", 512)
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        with TestClient(app) as client:
            cards = client.get("/v1/models").json()["data"]
            assert [(c["id"], c["parent"]) for c in cards] == [("smollm2", None),
                                                               ("a1", "smollm2")]
            assert cards[1]["root"] == str(adapters["a1"])
            r = client.post("/v1/completions", json={**body, "model": "a2"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = client.post("/v1/load_lora_adapter",
                            json={"lora_name": "a2", "lora_path": str(adapters["a2"])})
            assert r.status_code == 200 and "a2" in r.text
            assert [c["id"] for c in client.get("/v1/models").json()["data"]] == \
                ["smollm2", "a1", "a2"]
            for model, name in (("a2", "a2"), ("a1", "a1"), ("smollm2", None)):
                r = client.post("/v1/completions", json={**body, "model": model})
                assert r.status_code == 200, r.text
                out = r.json()["choices"][0]["text"]
                assert out == lora_llm.tokenizer.decode(want[name]), model
            for bad, match in (({"lora_name": "big", "lora_path": str(adapters["big"])},
                                "rank 16 is above --max-lora-rank 8"),
                               ({"lora_name": "x", "lora_path": "/nonexistent"},
                                "no adapter_config.json"),
                               ({"lora_name": "a1", "lora_path": str(adapters["a2"])},
                                "already been loaded"),
                               ({"lora_name": "", "lora_path": "/x"}, "lora_name")):
                r = client.post("/v1/load_lora_adapter", json=bad)
                assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
            r = client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert r.status_code == 200
            r = client.post("/v1/completions", json={**body, "model": "a2"})
            assert r.status_code == 404
            r = client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert r.status_code == 404
            r = client.post("/v1/completions", json={**body, "model": "a1"})
            assert r.status_code == 200
            assert client.get("/health").status_code == 200
    finally:
        bridge.shutdown()


CAPITALS = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
            "Japan": "Tokyo", "Egypt": "Cairo", "Canada": "Ottawa", "Kenya": "Nairobi",
            "Peru": "Lima", "Norway": "Oslo", "Greece": "Athens", "Poland": "Warsaw",
            "Chile": "Santiago", "Cuba": "Havana", "Ireland": "Dublin", "Austria": "Vienna",
            "Sweden": "Stockholm", "Portugal": "Lisbon", "China": "Beijing",
            "Thailand": "Bangkok", "Turkey": "Ankara", "Mexico": "Mexico City",
            "Finland": "Helsinki", "Denmark": "Copenhagen"}
HELD_OUT = ["Brazil", "Australia", "Nigeria", "Argentina", "India"]


@pytest.mark.full  # ~20 s of training; fast tier: the trainer on the tiny model (test_lora.py)
def test_an_adapter_trained_here_answers_in_its_style_when_served(lora_llm, real, tmp_path,
                                                                  hf_smollm2_model):
    """tools/train_lora.py on the real model (f32, rank 8, 8 AdamW steps of 4 chats of 50-52
    tokens, padded to 56; the loss falls from 3.69 to ~0.04 nats a token): capital
    questions answered as a pirate ("Arr! The capital of X be Y, matey!"). Served (loaded
    at run time by LLM.generate's lora_request), its answers to the questions of five
    countries it never saw start with "Arr!" and end with "matey!"; the base's do not; and
    HF peft reads the same directory to the logits of the base with it merged (1e-3, the
    f32 bound of tests/test_real_model_parity.py)."""
    import json
    import torch
    from peft import PeftModel
    from tools.train_lora import main as train
    data = tmp_path / "pirate.jsonl"
    with data.open("w") as f:
        for country, capital in CAPITALS.items():
            for q in (f"What is the capital of {country}?",
                      f"Which city is the capital of {country}?"):
                f.write(json.dumps({"prompt": q, "completion": f"Arr! The capital of {country} "
                                                              f"be {capital}, matey!"}) + "\n")
    out = tmp_path / "pirate"
    assert train(["--data", str(data), "--out", str(out), "--steps", "8", "--batch", "4",
                  "--max-len", "56", "--save-every", "4"]) == 0
    tok = lora_llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content":
                                                    f"What is the capital of {c}?"}]),
                          add_special_tokens=False) for c in HELD_OUT]
    sp = SamplingParams(temperature=0, max_tokens=24)
    pirate = lora_llm.generate(prompts, sp, lora_request=LoRARequest("pirate", 3, str(out)))
    plain = lora_llm.generate(prompts, sp)
    for c, p, b in zip(HELD_OUT, pirate, plain):
        assert p.text.startswith("Arr! The capital of") and p.text.endswith("matey!"), (c, p.text)
        assert "Arr" not in b.text and "matey" not in b.text, (c, b.text)
    params, cfg = real
    ids = prompts[0] + pirate[0].token_ids
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf_smollm2_model), out).eval()
    with torch.no_grad():
        want = peft_model(torch.tensor([ids])).logits[0].numpy()
    seq, seq_len = _pad([ids])
    merged = merge_adapter(params, load_peft_adapter(out, cfg, 8))
    assert np.abs(np.asarray(functional.logits(merged, cfg, seq, seq_len))[0] - want).max() <= 1e-3
