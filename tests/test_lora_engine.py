"""Serving LoRA adapters in the engine, on a tiny random model (engine logic; the real
model: tests/test_lora_real.py): requests of different adapters (and none) in the same
steps, each giving the tokens of the base with its own adapter merged; adapters beyond
max_loras waiting for a slot; loading, swapping and unloading without compiling; the
prefix cache keyed by adapter; and the LoRA manager's host bookkeeping."""

from __future__ import annotations


import numpy as np
import pytest

from engine_utils import TINY_CFG, outputs, tiny_engine, tiny_params
from jaxserve.lora.dummy import write_peft_adapter
from jaxserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def params():
    return tiny_params()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three adapters of the tiny model: ranks 4, 2 and 8, different modules (big enough
    B that each changes the greedy text)."""
    d = tmp_path_factory.mktemp("tiny_adapters")
    return {
        "a1": write_peft_adapter(d / "a1", TINY_CFG, r=4, seed=1, b_std=0.5),
        "a2": write_peft_adapter(d / "a2", TINY_CFG, r=2, seed=2, b_std=0.5, use_rslora=True,
                                 modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
        "a3": write_peft_adapter(d / "a3", TINY_CFG, r=8, seed=3, b_std=0.5,
                                 modules=["gate_proj", "up_proj", "k_proj"], layers=[1]),
    }


def _merged_tokens(params, adapter_dir, prompts):
    """Greedy tokens of the base with the adapter merged (None: the base), by
    jaxserve.functional.generate: the reference."""
    import jax
    import jax.numpy as jnp
    from jaxserve import functional
    from jaxserve.lora import load_peft_adapter, merge_adapter
    p = params if adapter_dir is None else merge_adapter(
        params, load_peft_adapter(adapter_dir, TINY_CFG, max_rank=8))
    width = max(map(len, prompts))
    toks = np.zeros((len(prompts), width), np.int32)
    for i, q in enumerate(prompts):
        toks[i, :len(q)] = q
    out, _ = functional.generate(p, TINY_CFG, jnp.asarray(toks),
                                 jnp.asarray([len(q) for q in prompts], jnp.int32),
                                 jax.random.key(0), max_new_tokens=GREEDY.max_tokens,
                                 temperature=0.0)
    return [list(map(int, r)) for r in np.asarray(out)]


def test_rows_of_different_adapters_share_steps_and_match_the_merged_models(params, adapters):
    """Eight requests over adapters a1, a2, a3 and the base, arriving together and staggered,
    with max_loras 2: each gets the greedy tokens of the base with its adapter merged;
    steps mixed adapters (and base rows); at most 2 adapters held slots at once, so the
    third waited and a slot was rewritten; the adapters matter (their tokens differ from
    the base's)."""
    engine = tiny_engine(params, enable_lora=True, max_loras=2, max_lora_rank=8)
    for name, path in adapters.items():
        engine.add_lora(name, str(path))
    prompts = [[5, 17, 42, 7], [99, 3, 250, 8, 16], [1, 2, 3], [200, 100, 50, 25, 12, 6]]
    names = ["a1", "a2", None, "a3", "a1", None, "a2", "a3"]
    reqs = [(f"r{i}", prompts[i % 4], GREEDY, n) for i, n in enumerate(names)]
    seen_slots: list[dict] = []
    step = engine.step

    def watched_step():
        seen_slots.append(engine.lora.slots())
        held = {s.lora_name for s in engine.scheduler.running if s.lora_name}
        assert len(held) <= 2
        return step()

    engine.step = watched_step
    got = outputs(engine, reqs, arrivals=[0, 0, 0, 0, 2, 3, 5, 9])
    refs = {}
    for name in ("a1", "a2", "a3", None):
        refs[name] = _merged_tokens(params, None if name is None else adapters[name], prompts)
    for i, name in enumerate(names):
        assert got[f"r{i}"][0] == refs[name][i % 4], (i, name)
    for name in ("a1", "a2", "a3"):
        assert refs[name] != refs[None], f"{name} changes the greedy tokens"
    assert any(len(s) == 2 for s in seen_slots)
    assert {n for s in seen_slots for n in s} == {"a1", "a2", "a3"}  # a slot was reused


def test_loading_swapping_and_unloading_compile_nothing(params, adapters):
    """A workload run once (its shapes compiled), then adapters unloaded, loaded again
    under other names, swapped through the slots and the same workload run again: no
    compilation of any kind (jax.monitoring's events), same tokens for the same
    adapters."""
    from jaxserve.worker import compile_events
    compile_events.install()
    engine = tiny_engine(params, enable_lora=True, max_loras=1, max_lora_rank=8)
    engine.add_lora("a1", str(adapters["a1"]))
    engine.add_lora("a2", str(adapters["a2"]))
    prompt = [5, 17, 42, 7]
    reqs = [("x0", prompt, GREEDY, "a1"), ("x1", prompt, GREEDY, "a2"),
            ("x2", prompt, GREEDY, None)]
    first = outputs(engine, reqs, arrivals=[0, 0, 0])
    before = (engine.num_compilations, compile_events.snapshot())
    engine.remove_lora("a1")
    engine.add_lora("b1", str(adapters["a1"]))
    engine.add_lora("a3", str(adapters["a3"]))
    reqs = [("y0", prompt, GREEDY, "a2"), ("y1", prompt, GREEDY, "b1"),
            ("y2", prompt, GREEDY, "a3"), ("y3", prompt, GREEDY, None)]
    second = outputs(engine, reqs, arrivals=[0, 0, 1, 1])
    assert (engine.num_compilations, compile_events.snapshot()) == before
    assert second["y0"][0] == first["x1"][0] and second["y1"][0] == first["x0"][0]
    assert second["y3"][0] == first["x2"][0]
    assert engine.lora_names() == ["a2", "a3", "b1"]


def test_prefix_cache_pages_are_keyed_by_adapter(params, adapters):
    """A 12-token prompt (3 full pages of 4) under a1, then under a2, then under a1 again:
    a2 finds none of a1's pages (its output is its own, as on a cold cache), a1 again finds
    them; the base, and a1 loaded again under the same name, find none."""
    engine = tiny_engine(params, enable_lora=True, max_loras=2, max_lora_rank=8)
    engine.add_lora("a1", str(adapters["a1"]))
    engine.add_lora("a2", str(adapters["a2"]))
    prompt = list(range(30, 43))  # 13 tokens: 3 full pages usable from the cache
    kv = engine.kv_cache_manager

    def run(rid, name):
        hits = kv.prefix_cache_hits
        out = outputs(engine, [(rid, prompt, GREEDY, name)], arrivals=[0])[rid][0]
        return out, kv.prefix_cache_hits - hits

    a1, hit = run("p0", "a1")
    assert hit == 0
    a2, hit = run("p1", "a2")
    assert hit == 0 and a2 == _merged_tokens(params, adapters["a2"], [prompt])[0]
    again, hit = run("p2", "a1")
    assert hit == 12 and again == a1
    _, hit = run("p3", None)
    assert hit == 0
    engine.remove_lora("a1")
    engine.add_lora("a1", str(adapters["a3"]))  # the same name, other weights
    _, hit = run("p4", "a1")
    assert hit == 0


def test_bad_adapters_and_unknown_names_fail_alone(params, adapters, tmp_path):
    """An unknown adapter name, an adapter over max_lora_rank, a missing directory, a name
    in use: one-line errors, the engine serving on; an adapter unloaded while its request
    waits fails that request only."""
    from jaxserve.lora import AdapterError
    from jaxserve.sampling_params import InvalidRequest
    engine = tiny_engine(params, enable_lora=True, max_loras=1, max_lora_rank=4)
    with pytest.raises(InvalidRequest, match="no LoRA adapter 'nope' is loaded"):
        engine.add_request("u", [1, 2], GREEDY, "nope")
    with pytest.raises(AdapterError, match="rank 8 is above --max-lora-rank 4"):
        engine.add_lora("big", str(adapters["a3"]))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        engine.add_lora("gone", str(tmp_path / "missing"))
    engine.add_lora("a1", str(adapters["a1"]))
    with pytest.raises(AdapterError, match="'a1' is already loaded"):
        engine.add_lora("a1", str(adapters["a2"]))
    engine.add_lora("a2", str(adapters["a2"]))
    # a1's request holds the one slot; a2's waits, and a2 is unloaded meanwhile
    engine.add_request("w1", [5, 6, 7], GREEDY, "a1")
    engine.add_request("w2", [5, 6, 7], GREEDY, "a2")
    engine.add_request("w3", [5, 6, 7], GREEDY, None)
    engine.step()
    assert {s.request_id for s in engine.scheduler.waiting} == {"w2"}
    engine.remove_lora("a2")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["w2"].finish_reason == "error" and "unloaded" in done["w2"].error
    assert done["w1"].finish_reason == "length" and done["w3"].finish_reason == "length"
    with pytest.raises(KeyError):
        engine.remove_lora("a2")


def test_lora_manager_keeps_host_and_slot_lrus_without_jax():
    """Host-side bookkeeping (plain Python, no JAX imported): adapters read on the host
    beyond max_cpu_loras are evicted least recently used and read again when needed; a
    slot no running sequence holds is reused, least recently used first; a full set of
    held slots makes acquire wait; slot writes come out in order."""
    import subprocess
    import sys
    # written as plain asserts in a subprocess: no JAX may be imported by the host side
    code = """
from jaxserve.config import LoRAConfig
from jaxserve.engine.lora_manager import LoraManager
from jaxserve.engine.sequence import Sequence
from jaxserve.lora.adapter import LoraAdapter
from jaxserve.sampling_params import SamplingParams
import sys
reads = []
def read(path, name):
    reads.append(name)
    return LoraAdapter(a=(), b=(), name=name, rank=1)
m = LoraManager(LoRAConfig(enable_lora=True, max_loras=2, max_cpu_loras=2), None, read)
for n in "abc":
    m.add(n, "/" + n)
assert reads == ["a", "b", "c"] and m.names == {"a", "b", "c"}
def seq(n):
    return Sequence(request_id=str(n), prompt_ids=[1], params=SamplingParams(), seed=0, lora_name=n)
sa, sb, sc, sbase = seq("a"), seq("b"), seq("c"), seq(None)
assert m.acquire(sbase) and sbase.lora_slot == 0
assert m.acquire(sa) and sa.lora_slot == 1 and reads[-1] == "a"  # evicted by c: read again
assert m.acquire(sb) and sb.lora_slot == 2 and reads[-1] == "b"  # evicted by a: read again
assert not m.acquire(sc) and sc.lora_slot == 0                   # both slots held
assert [(s, a.name) for s, a in m.take_writes()] == [(1, "a"), (2, "b")]
m.release(sb)                       # slot 2 free (b stays in it)
sb2 = seq("b")
assert m.acquire(sb2) and sb2.lora_slot == 2 and m.take_writes() == []  # b still there
m.release(sb2)
m.release(sa)                       # slots free, LRU: 2 then 1
assert m.acquire(sc) and sc.lora_slot == 2 and [s for s, _ in m.take_writes()] == [2]
assert m.slots() == {"a": 1, "c": 2}
m.remove("a")                       # in a free slot: cleared now
assert m.take_writes() == [(1, None)] and m.slots() == {"c": 2}
m.remove("c")                       # held by sc: cleared when sc leaves
assert m.take_writes() == [] and m.slots() == {}
m.add("c", "/c2")                   # the name again, other weights: not sc's slot
sc2 = seq("c")
assert m.acquire(sc2) and sc2.lora_slot == 1 and [s for s, _ in m.take_writes()] == [1]
m.release(sc)
assert m.take_writes() == [(2, None)] and m.slots() == {"c": 1}
salt = m.cache_salt("b")
assert m.cache_salt(None) is None and salt not in (m.cache_salt(n) for n in m.names - {"b"})
m.remove("b")
m.add("b", "/b")
assert m.cache_salt("b") != salt   # registered again: its old pages never match
assert "jax" not in sys.modules, "the host side imported JAX"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
