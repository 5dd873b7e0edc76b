"""lm-eval-harness against the served real model: its `local-completions` model (echo +
logprobs requests to /v1/completions) scores a multiple-choice task the same as its own
`hf` backend on an HF directory written from the same dequantised weights, item by item
up to near-ties; a generate_until task runs through the server too.

The tasks are defined here over tests/data/lm_eval/*.jsonl (no hub access). The server is
jaxserve's app over the session's small real-model engine (f32 matmuls), served by
uvicorn on a free port; the HF directory is transformers' own dequantisation of the same
GGUF (tests/hf_reference.py), saved with save_pretrained.

Tolerance: the engine's logprobs are within 2e-3 of HF's per token (tests/
test_logprobs_real.py: f32 logits within 1e-3, doubled for the log-softmax), so a
choice's summed loglikelihood is within 2e-3 x its token count; two choices whose HF
loglikelihoods are closer than twice that are a near-tie the two may rank either way.
"""

import json
from pathlib import Path

import lm_eval  # a test extra: a missing one fails this real-model test, never skips it
import pytest

from app_server import uvicorn_thread
from tools.quant_accuracy import MC_TASK  # the multiple-choice task, shared with the tool

pytestmark = pytest.mark.full  # fast tier: logprobs with echo through the server (test_logprobs_real)

DATA = Path(__file__).parent / "data" / "lm_eval"
PER_TOKEN_ATOL = 2e-3
# f32 engine vs HF f32: each logit within 1e-3 (tests/test_real_model_parity.py), so a
# top-2 margin below twice that may be ranked either way
TIE_MARGIN = 2e-3

QA_TASK = """task: jaxserve_qa
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    (d / "jaxserve_mc.yaml").write_text(MC_TASK.format(path=DATA / "mc.jsonl"))
    (d / "jaxserve_qa.yaml").write_text(QA_TASK.format(path=DATA / "qa.jsonl"))
    from lm_eval.tasks import TaskManager
    # only the two tasks here: indexing lm-eval's own ~14k task files takes ~11 s
    return TaskManager(include_path=str(d), include_defaults=False)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, hf_smollm2_model, hf_smollm2_tokenizer):
    import copy

    import torch
    from transformers import AutoModelForCausalLM
    d = tmp_path_factory.mktemp("smollm2_hf")
    # the GGUF-loaded model keeps its "gguf" quantizer, which cannot save: the same
    # dequantised weights in a plain float32 model of the same config
    config = copy.deepcopy(hf_smollm2_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(hf_smollm2_model.state_dict())
    model.save_pretrained(d)
    hf_smollm2_tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def server_url(small_llm):
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.entrypoints.openai.api_server import build_app
    engine = small_llm.engine
    bridge = AsyncEngine(engine)
    app = build_app(bridge, small_llm.tokenizer, "smollm2", engine.engine_config.max_model_len)
    try:
        with uvicorn_thread(app) as url:
            yield url
    finally:
        bridge.shutdown()


def evaluate(model, model_args, tasks, names, batch_size=1):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=names,
                                   task_manager=tasks, log_samples=True, batch_size=batch_size,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


def loglikelihoods(result, task):
    """{doc_id: [summed loglikelihood of each choice]}."""
    return {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in result["samples"][task]}


@pytest.fixture(scope="module")
def results(server_url, hf_dir, tasks, monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    names = ["jaxserve_mc", "jaxserve_qa"]
    # the hf backend's requests in batches of 16 (right-padded: a causal model's logits at
    # the real tokens are those of the sequence alone, to f32 noise); the served model
    # gets them one by one over 16 connections, batched by the engine
    hf = evaluate("hf", {"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
                  tasks, names, batch_size=16)
    served = evaluate("local-completions", {
        "base_url": f"{server_url}/completions", "model": "smollm2",
        "tokenizer_backend": "huggingface", "tokenizer": str(hf_dir),
        "tokenized_requests": True, "num_concurrent": 16, "max_retries": 1,
        "max_length": 512}, tasks, names)
    return hf, served


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_multiple_choice_accuracy_equals_the_hf_backend_item_by_item(results, hf_dir):
    from transformers import AutoTokenizer
    hf, served = results
    tok = AutoTokenizer.from_pretrained(hf_dir)
    docs = [json.loads(line) for line in (DATA / "mc.jsonl").read_text().splitlines()]
    want, got = loglikelihoods(hf, "jaxserve_mc"), loglikelihoods(served, "jaxserve_mc")
    assert set(want) == set(got) == set(range(len(docs)))
    disagree = []
    for i, doc in enumerate(docs):
        n_tokens = [len(tok.encode(" " + c, add_special_tokens=False)) for c in doc["choices"]]
        for c, (a, b, n) in enumerate(zip(want[i], got[i], n_tokens)):
            assert abs(a - b) <= PER_TOKEN_ATOL * n, (i, c, a, b)
        best_hf = max(range(4), key=lambda c: want[i][c])
        best_served = max(range(4), key=lambda c: got[i][c])
        if best_hf != best_served:
            margin = want[i][best_hf] - want[i][best_served]
            tie = PER_TOKEN_ATOL * (n_tokens[best_hf] + n_tokens[best_served])
            assert margin <= tie, (i, want[i], got[i])
            disagree.append(i)
    acc_hf = hf["results"]["jaxserve_mc"]["acc,none"]
    acc_served = served["results"]["jaxserve_mc"]["acc,none"]
    if not disagree:
        assert acc_served == acc_hf
    print(f"jaxserve_mc acc: hf {acc_hf:.4f}, local-completions {acc_served:.4f}; "
          f"near-ties ranked otherwise: {disagree}")


def test_generate_until_answers_equal_the_hf_backend(results, hf_dir, hf_smollm2_model):
    """The served greedy answers are the hf backend's, doc by doc; where the texts differ,
    HF's own greedy continuation of the same context must have a near tie (top-2 logits
    within TIE_MARGIN) at the token where they part."""
    from hf_reference import hf_greedy
    from transformers import AutoTokenizer
    hf, served = results
    want = {s["doc_id"]: s for s in hf["samples"]["jaxserve_qa"]}
    got = {s["doc_id"]: s for s in served["samples"]["jaxserve_qa"]}
    assert set(want) == set(got) and len(got) == 8
    tok = AutoTokenizer.from_pretrained(hf_dir)
    differ = 0
    for doc_id, sample in want.items():
        a, b = sample["resps"][0][0], got[doc_id]["resps"][0][0]
        assert isinstance(b, str)
        if a == b:
            continue
        differ += 1
        context = sample["arguments"][0][0]
        ids = tok.encode(context, add_special_tokens=False)
        tokens, margins = hf_greedy(hf_smollm2_model, ids, 8)
        part = next(i for i, (x, y) in enumerate(zip(a + "\0", b + "\1")) if x != y)
        j = next(j for j in range(len(tokens)) if len(tok.decode(tokens[:j + 1])) > part)
        assert margins[j] < TIE_MARGIN, (doc_id, a, b, j, margins[j])
    em = [r["results"]["jaxserve_qa"]["exact_match,none"] for r in (hf, served)]
    assert abs(em[0] - em[1]) <= differ / 8 + 1e-9, (em, differ)
