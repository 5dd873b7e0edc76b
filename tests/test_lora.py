"""jaxserve.lora: PEFT LoRA directories read into jaxserve's layout, the base model with an
adapter merged giving HF peft's logits (the reference), and one-line errors for adapters
that cannot be served."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jaxserve.lora import AdapterError, load_peft_adapter, merge_adapter

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama (HF) saved and converted: (HF dir, jaxserve params f32, cfg)."""
    from hf_reference import save_hf_dir, tiny_hf_model
    from jaxserve.checkpoint import convert, load_model_config, load_params
    d = tmp_path_factory.mktemp("lora_base")
    hf_dir = save_hf_dir(tiny_hf_model("LlamaForCausalLM"), d / "hf", max_shard_size=None)
    ckpt = convert(hf_dir, d / "ckpt", progress=False)
    cfg = load_model_config(ckpt)
    return hf_dir, load_params(ckpt, cfg), cfg


def _peft_adapter(out, seed: int, **lora_kw):
    """A random PEFT LoRA adapter (both factors random: init_lora_weights=False) of the tiny
    base, saved to `out`; returns the PEFT model (the reference)."""
    import torch
    from hf_reference import tiny_hf_model
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = get_peft_model(tiny_hf_model("LlamaForCausalLM"),
                           LoraConfig(init_lora_weights=False, **lora_kw))
    model.save_pretrained(out)
    return model.eval()


def _jax_logits(params, cfg, ids):
    import jax.numpy as jnp
    from jaxserve.functional import logits
    return np.asarray(logits(params, cfg, jnp.asarray([ids], jnp.int32),
                             jnp.asarray([len(ids)], jnp.int32)))[0]


@pytest.mark.parametrize("lora_kw", [
    dict(r=4, lora_alpha=8, target_modules=MODULES),
    dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    dict(r=2, lora_alpha=4, target_modules=["o_proj", "up_proj"], layers_to_transform=[1]),
    dict(r=4, lora_alpha=4, target_modules="all-linear"),
], ids=["all-modules", "rslora-some", "layer1-only", "all-linear"])
def test_merged_adapter_gives_peft_logits(base, tmp_path, lora_kw):
    """The base with the adapter merged (W + scaling A B) gives HF peft's logits on the same
    adapter (f32 both; XLA's summation order against torch's), and differs from the base:
    every module kind, rsLoRA's alpha / sqrt(r), one layer adapted, PEFT's all-linear."""
    import torch
    hf_dir, params, cfg = base
    model = _peft_adapter(tmp_path / "adapter", seed=1, **lora_kw)
    adapter = load_peft_adapter(tmp_path / "adapter", cfg, max_rank=16, name="a")
    assert adapter.rank == lora_kw["r"] and adapter.name == "a"
    ids = [1, 5, 9, 13, 40, 2, 7, 33]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = _jax_logits(merge_adapter(params, adapter), cfg, ids)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    plain = _jax_logits(params, cfg, ids)
    assert np.abs(plain - want).max() > 100 * 1e-4 * np.abs(want).max(), "the adapter matters"


def _edit_config(d, **changes):
    conf = json.loads((d / "adapter_config.json").read_text())
    conf.update(changes)
    (d / "adapter_config.json").write_text(json.dumps(conf))


def test_adapters_that_cannot_be_served_are_one_line_errors(base, tmp_path):
    """A rank above --max-lora-rank, an unknown target module, a factor of another base's
    shape, a missing file, DoRA: AdapterError naming the adapter, the field and the limit."""
    from safetensors.numpy import load_file, save_file
    _, _, cfg = base
    d = tmp_path / "a"
    _peft_adapter(d, seed=2, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with pytest.raises(AdapterError, match="LoRA adapter a: rank 8 is above --max-lora-rank 4"):
        load_peft_adapter(d, cfg, max_rank=4)
    _edit_config(d, target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(AdapterError, match=r"target_modules \['embed_tokens'\] not served"):
        load_peft_adapter(d, cfg, max_rank=8)
    _edit_config(d, target_modules=["q_proj", "v_proj"], use_dora=True)
    with pytest.raises(AdapterError, match="use_dora=True is not served"):
        load_peft_adapter(d, cfg, max_rank=8)
    _edit_config(d, use_dora=False)
    tensors = load_file(d / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({**tensors, key: np.zeros((8, 16), np.float32)}, d / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"q_proj has lora_A \[8, 16\] .* needs \[8, 32\] and "
                                           r"\[32, 8\] \(an adapter of another model\?\)"):
        load_peft_adapter(d, cfg, max_rank=8)
    save_file({k: v for k, v in tensors.items() if k != key}, d / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"q_proj.lora_A.weight is missing"):
        load_peft_adapter(d, cfg, max_rank=8)
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        load_peft_adapter(d, cfg, max_rank=8)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_peft_adapter(tmp_path / "nothing", cfg, max_rank=8)


def test_rows_apply_their_own_adapter_from_the_slots():
    """lora_delta over a batch mixing slots 0 (no adapter), 1, 2 and 3 (ranks 2, 4, 8 in
    pools of rank 8, zero-padded): each row's delta is its own adapter's x A B, computed in
    float64 numpy row by row; base + delta = x (W + A B), the merged weight's product;
    slot 0 rows add exact zeros; refilling a slot changes only its rows."""
    import jax.numpy as jnp
    from jaxserve.lora.batched import empty_slots, lora_delta, put_adapter
    rng = np.random.default_rng(7)
    n_in, n_out, T = 24, 40, 11
    pools = empty_slots(4, n_in, n_out, 8)
    factors = {s: (rng.standard_normal((n_in, r)), rng.standard_normal((r, n_out)))
               for s, r in ((1, 2), (2, 4), (3, 8))}
    for s, (a, b) in factors.items():
        pools = put_adapter(pools, s, jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    row_slot = np.array([0, 1, 2, 3, 3, 0, 2, 1, 1, 0, 3], np.int32)
    x = rng.standard_normal((T, n_in)).astype(np.float32)
    got = np.asarray(lora_delta(jnp.asarray(x), pools, jnp.asarray(row_slot)))
    for t, s in enumerate(row_slot):
        want = np.zeros(n_out) if s == 0 else x[t].astype(np.float64) @ factors[s][0] @ factors[s][1]
        np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5 * max(1, np.abs(want).max()))
        if s == 0:
            assert (got[t] == 0).all()
    w = rng.standard_normal((n_in, n_out)).astype(np.float32)
    a, b = factors[2]
    merged = x[row_slot == 2] @ (w + (a @ b).astype(np.float32))
    np.testing.assert_allclose(x[row_slot == 2] @ w + got[row_slot == 2], merged,
                               rtol=1e-4, atol=1e-4 * np.abs(merged).max())
    new_a = jnp.asarray(rng.standard_normal((n_in, 4)), jnp.float32)
    refilled = put_adapter(pools, 1, new_a, jnp.zeros((4, n_out), jnp.float32))
    again = np.asarray(lora_delta(jnp.asarray(x), refilled, jnp.asarray(row_slot)))
    assert (again[row_slot == 1] == 0).all()
    np.testing.assert_array_equal(again[row_slot != 1], got[row_slot != 1])
    with pytest.raises(ValueError, match=r"LoRA slot must be in 1..3 \(0 is no adapter\)"):
        put_adapter(pools, 0, new_a, jnp.zeros((4, n_out)))
    with pytest.raises(ValueError, match="r <= 8"):
        put_adapter(pools, 1, jnp.zeros((n_in, 9)), jnp.zeros((9, n_out)))


def _served_pools(params, cfg, adapters, max_loras=3, max_rank=8, stacked=False):
    """params with LoRA pools of max_loras slots, adapter i in slot i + 1 (written by the
    engine's one program, jaxserve.model.lora.slot_writer); the layers stacked for the
    layer loop when `stacked`."""
    import jax.numpy as jnp
    from jaxserve.config import LoRAConfig
    from jaxserve.model import lora as model_lora
    from jaxserve.model.layer_loop import stack_layers
    lcfg = LoRAConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=max_rank)
    params = model_lora.attach_pools(params, cfg, lcfg)
    if stacked:
        params = dataclasses.replace(params, layers=stack_layers(params.layers))
    pools = model_lora.lora_pools(params)
    write = model_lora.slot_writer(pools)
    for i, adapter in enumerate(adapters):
        pools = write(pools, jnp.int32(i + 1), model_lora.adapter_arrays(adapter, cfg, lcfg))
    return model_lora.with_pools(params, pools), write, lcfg


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "layer-loop"])
def test_served_rows_give_the_merged_models_logits(base, tmp_path, stacked):
    """One forward over sequences of slots 0, 1, 2, 1 (adapters of ranks 4 and 2 in pools of
    rank 8; different target modules) gives each sequence the logits of the base with its
    own adapter merged (f32: within the f32 noise of the different summation order), slot
    0 the base's bit for bit in value; unrolled and as the layer loop; clearing a slot
    gives its rows the base's logits again."""
    import jax.numpy as jnp
    from jaxserve.functional import logits
    from jaxserve.model import lora as model_lora
    _, params, cfg = base
    _peft_adapter(tmp_path / "a1", seed=3, r=4, lora_alpha=8, target_modules=MODULES)
    _peft_adapter(tmp_path / "a2", seed=4, r=2, lora_alpha=4,
                  target_modules=["q_proj", "o_proj", "down_proj"], use_rslora=True)
    adapters = [load_peft_adapter(tmp_path / n, cfg, max_rank=8, name=n) for n in ("a1", "a2")]
    served, write, lcfg = _served_pools(params, cfg, adapters, stacked=stacked)
    rng = np.random.default_rng(0)
    L = 9
    tokens = rng.integers(1, cfg.vocab_size, (4, L)).astype(np.int32)
    lengths = np.array([9, 7, 9, 5], np.int32)
    slots = np.array([0, 1, 2, 1], np.int32)
    got = np.asarray(logits(served, cfg, jnp.asarray(tokens), jnp.asarray(lengths),
                            lora_slot=jnp.asarray(slots)))
    refs = {0: params, 1: merge_adapter(params, adapters[0]), 2: merge_adapter(params, adapters[1])}
    for b, s in enumerate(slots):
        n = lengths[b]
        want = _jax_logits(refs[int(s)], cfg, list(tokens[b, :n]))
        scale = np.abs(want).max()
        np.testing.assert_allclose(got[b, :n], want, rtol=1e-5, atol=2e-5 * scale)
        if s:
            base_logits = _jax_logits(params, cfg, list(tokens[b, :n]))
            assert np.abs(base_logits - want).max() > 100 * 2e-5 * scale, "the adapter matters"
    # clearing slot 1 (an unload): its rows are the base's again, slot 2's unchanged
    pools = write(model_lora.lora_pools(served), jnp.int32(1),
                  model_lora.adapter_arrays(None, cfg, lcfg))
    cleared = np.asarray(logits(model_lora.with_pools(served, pools), cfg, jnp.asarray(tokens),
                                jnp.asarray(lengths), lora_slot=jnp.asarray(slots)))
    for b, s in enumerate(slots):
        n = lengths[b]
        want = got[b, :n] if s == 2 else _jax_logits(params, cfg, list(tokens[b, :n]))
        np.testing.assert_allclose(cleared[b, :n], want, rtol=1e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("stacked", [False, True], ids=["unrolled", "layer-loop"])
def test_cpu_kernel_deltas_give_the_jnp_forms_logits(base, tmp_path, stacked, cpu_kernels_library):
    """The engine's C++ path: packed bf16 weights (what the CPU configs serve) with LoRA
    slots, the deltas by the C++ kernel (matmul "cpu": each row's own slot, a layer loop's
    stacked pools read in place) give the logits of the same weights with the deltas by
    the batched jnp form (matmul "xla" runs the same packed weights): f32 summation order
    only; the adapters change the logits."""
    import jax.numpy as jnp
    from jaxserve.functional import logits
    from jaxserve.model.transformer import Kernels
    from jaxserve.model.weight_layouts import dual_precision_params
    _, params, cfg = base
    _peft_adapter(tmp_path / "a1", seed=5, r=4, lora_alpha=8, target_modules=MODULES)
    _peft_adapter(tmp_path / "a2", seed=6, r=8, lora_alpha=8, target_modules=["v_proj", "up_proj"])
    adapters = [load_peft_adapter(tmp_path / n, cfg, max_rank=8, name=n) for n in ("a1", "a2")]
    packed = dual_precision_params(params, min_rows=1, packed=True)
    served, _, _ = _served_pools(packed, cfg, adapters, stacked=stacked)
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, cfg.vocab_size, (3, 7)), jnp.int32)
    lengths = jnp.asarray([7, 5, 6], jnp.int32)
    slots = jnp.asarray([1, 2, 0], jnp.int32)
    got = np.asarray(logits(served, cfg, tokens, lengths, Kernels("xla", "cpu"), lora_slot=slots))
    want = np.asarray(logits(served, cfg, tokens, lengths, Kernels("xla", "xla"), lora_slot=slots))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    plain = np.asarray(logits(served, cfg, tokens, lengths, Kernels("xla", "cpu"),
                              lora_slot=jnp.zeros(3, jnp.int32)))
    for b in (0, 1):
        assert np.abs(plain[b, :lengths[b]] - got[b, :lengths[b]]).max() > 1e-2
    np.testing.assert_array_equal(plain[2, :6], got[2, :6])  # slot 0: the base's, exactly


def test_trained_factors_written_as_peft_serve_what_was_trained(base, tmp_path):
    """jaxserve.train.lora on the tiny model: the new adapter (B = 0) starts at the base's
    loss; a few Adam steps of sft_loss halve the loss of the masked tokens; the factors written by save_peft load back (load_peft_adapter) as an adapter
    whose merged model gives the logits the trained pools gave (f32); and HF peft reads the
    same directory to the same logits."""
    import jax
    import jax.numpy as jnp
    import optax
    import torch
    from peft import PeftModel
    from hf_reference import tiny_hf_model
    from jaxserve.functional import logits
    from jaxserve.train.lora import init_adapter, save_peft, sft_loss, with_adapter
    _, params, cfg = base
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (4, 9)), jnp.int32)
    lengths = jnp.asarray([9, 8, 9, 7], jnp.int32)
    mask = jnp.asarray(np.arange(9)[None, :] >= 4, jnp.int8) * jnp.ones((4, 1), jnp.int8)
    factors = init_adapter(cfg, 4, ["wq", "wv", "wo", "w_up", "w_down"], jax.random.key(0))
    assert float(sft_loss(factors, params, cfg, tokens, lengths, mask, 2.0)) == pytest.approx(
        float(sft_loss(jax.tree.map(jnp.zeros_like, factors), params, cfg, tokens, lengths,
                       mask, 2.0)))  # B = 0: the base model's loss
    opt = optax.adam(1e-2)
    state = opt.init(factors)
    grad = jax.jit(jax.value_and_grad(sft_loss), static_argnums=(2,))
    first = None
    for _ in range(15):
        loss, g = grad(factors, params, cfg, tokens, lengths, mask, 2.0)
        first = float(loss) if first is None else first
        updates, state = opt.update(g, state)
        factors = optax.apply_updates(factors, updates)
    assert float(loss) < 0.5 * first
    out = save_peft(tmp_path / "trained", factors, rank=4, alpha=8)
    adapter = load_peft_adapter(out, cfg, max_rank=8)
    want = np.asarray(logits(with_adapter(params, cfg, factors, 2.0), cfg, tokens, lengths,
                             lora_slot=jnp.zeros(4, jnp.int32)))
    got = np.asarray(logits(merge_adapter(params, adapter), cfg, tokens, lengths))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    peft_model = PeftModel.from_pretrained(tiny_hf_model("LlamaForCausalLM"), out).eval()
    with torch.no_grad():
        hf = peft_model(torch.tensor(np.asarray(tokens[:1, :9]))).logits[0].numpy()
    np.testing.assert_allclose(want[0], hf, rtol=1e-4, atol=1e-4 * np.abs(hf).max())


def test_adapters_follow_kv_heads_repeated_over_devices(base, tmp_path):
    """With more devices than KV heads each KV head is served repeated (tensor_parallel.
    expand_kv_heads); an adapter's wk / wv outputs are repeated alike when its slot is
    written (model.lora.adapter_arrays), so the expanded model with the adapter gives the
    logits of the model as trained with it (one device; the same attention)."""
    import jax.numpy as jnp
    from jaxserve.functional import logits
    from jaxserve.model.tensor_parallel import expand_kv_heads, served_kv_heads
    _, params, cfg = base
    tp = cfg.num_heads  # one query head per device: each KV head repeated H / K times
    assert served_kv_heads(cfg, tp) > cfg.num_kv_heads
    _peft_adapter(tmp_path / "kv", seed=8, r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"])
    adapter = load_peft_adapter(tmp_path / "kv", cfg, max_rank=8, name="kv")
    served, _, _ = _served_pools(params, cfg, [adapter])
    wide, wide_cfg = expand_kv_heads(params, cfg, tp)
    served_wide, _, _ = _served_pools(wide, wide_cfg, [adapter])
    tokens = jnp.asarray(np.random.default_rng(4).integers(1, cfg.vocab_size, (2, 6)), jnp.int32)
    lengths, slots = jnp.asarray([6, 6], jnp.int32), jnp.asarray([1, 0], jnp.int32)
    want = np.asarray(logits(served, cfg, tokens, lengths, lora_slot=slots))
    got = np.asarray(logits(served_wide, wide_cfg, tokens, lengths, lora_slot=slots))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    plain = np.asarray(logits(served, cfg, tokens, lengths, lora_slot=jnp.zeros(2, jnp.int32)))
    assert np.abs(plain[0] - want[0]).max() > 1e-3  # the adapter matters


def test_training_chats_are_json_lines_cut_at_newlines_only(tmp_path):
    """A JSON string may hold U+2028, U+2029 or U+0085 unescaped (ensure_ascii=False, as
    jaxserve's own batch output writes): they are no line ends of a JSON-lines file."""
    from jaxserve.train.lora import read_chats
    data = tmp_path / "chats.jsonl"
    texts = ["one\u2028line", "a\u0085b\u2029c"]
    data.write_text("\n".join(json.dumps({"prompt": t, "completion": t[::-1]},
                                         ensure_ascii=False) for t in texts) + "\n\n",
                    encoding="utf-8")
    chats = read_chats(data)
    assert [c[0]["content"] for c in chats] == texts
    assert [c[1]["content"] for c in chats] == [t[::-1] for t in texts]
