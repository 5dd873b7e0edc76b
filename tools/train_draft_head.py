"""Train an EAGLE-style draft head for a config's model by self-distillation.

    python -m tools.train_draft_head [--config configs/smollm2_135m.py]
        [--out jaxserve/spec_decode/heads/smollm2_135m] [--work ~/.cache/jaxserve/eagle-train]
        [--num-prompts 1920] [--instruction-share 0.5] [--steps 3200] [--seed 0] ...

1. Prompts from two sources, no benchmark prompt and no held-out prompt among them:
   instructions of many kinds as people write to a chat assistant (tools/instruction_prompts.py:
   advice, explanations, lists, emails, stories, summaries and rewrites of given text, code,
   word problems, other languages; --instruction-share of them), and prompts built like the
   benchmark's (tools/make_bench_prompts.py: Python's documentation, standard-library code,
   licence texts, with other seeds). The held-out evaluation sets
   (jaxserve/bench/data/chat_handwritten.jsonl, copy_handwritten.jsonl) are written by hand
   and come from neither.
2. Answers: the target's own greedy answers (jaxserve.LLM, all prompts batched).
3. Features: the target's final hidden states over prompt + answer (its XLA forward), and
   for an EAGLE-3-style head (--feature-layers) the residual streams entering those layers.
4. Draft vocabulary: the --draft-vocab most frequent tokens of the answers.
5. Training: windows of --window tokens fed by a `grain` pipeline (shuffled per seed),
   `optax` AdamW with warm-up + cosine decay and gradient clipping, the loss of
   jaxserve.spec_decode.eagle_train; `orbax` checkpoints every --save-every steps in
   --work, from which a rerun resumes (steps 1-4 are cached there too).
6. Every --eval-every steps: the held-out sequences' teacher-forced top-1 agreement and
   the mean acceptance length of greedy chains of --k drafts (the head feeding its own
   guesses, as when serving), printed beside the progress bar.
7. The head is written to --out (config.json + head.safetensors, float16; its LM head is
   the target's, not stored): what {"method": "eagle", "model": OUT} loads.
Reproducible from --seed (data order, noise, init; the answers are greedy).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- data ------------------------------------------------------------------------------

def training_prompts(n: int, seed: int, instruction_share: float = 0.5) -> list[str]:
    """`n` prompts: round(n * instruction_share) from tools/instruction_prompts.py, the rest
    built like the benchmark's with other seeds; none of the benchmark's or of the held-out
    sets' prompts; in a seeded shuffled order."""
    import random

    from jaxserve.bench.serve import DATA_DIR, DEFAULT_DATASET, read_dataset
    from tools import instruction_prompts, make_bench_prompts
    excluded = {r.prompt for path in (DEFAULT_DATASET, DATA_DIR / "chat_handwritten.jsonl",
                                      DATA_DIR / "copy_handwritten.jsonl")
                for r in read_dataset(path)}
    n_inst = round(n * instruction_share)
    out = [e["prompt"] for e in instruction_prompts.build(n_inst, seed)
           if e["prompt"] not in excluded]
    seen, s = excluded | set(out), seed
    while len(out) < n:
        s += 1
        for e in make_bench_prompts.build(10_000 + s):
            if e["prompt"] not in seen and len(out) < n:
                seen.add(e["prompt"])
                out.append(e["prompt"])
    random.Random(seed).shuffle(out)
    return out


def generate_answers(llm, prompts: list[str], max_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + answer ids, prompt length) of each prompt: the target's greedy answer."""
    from tqdm import tqdm

    from jaxserve.sampling_params import SamplingParams
    tok = llm.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                      add_special_tokens=False) for p in prompts]
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i, x in enumerate(ids):
        eng.add_request(f"t{i}", x, sp)
    done = {}
    with tqdm(total=len(ids), desc="answers", unit="req") as bar:
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
                    bar.update()
    return [(x + done[f"t{i}"], len(x)) for i, x in enumerate(ids)]


def target_features(ckpt, cfg, seqs: list[list[int]], max_len: int,
                    feature_layers: tuple[int, ...] = ()):
    """The target's final hidden states [L, D] (float16) of each sequence (cut to max_len),
    and the residual streams entering `feature_layers` [L, n, D] (float16; None when
    there are none), by its XLA forward, one sequence per call."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from jaxserve.checkpoint import load_params
    from jaxserve.model.kv_cache import init_kv_cache
    from jaxserve.model.inputs import StepBatch
    from jaxserve.model.transformer import forward_features

    params = load_params(ckpt, cfg)
    ps = 16
    buckets = [b for b in (128, 256, 384, 512, 768, 1024) if b <= max_len] or [max_len]

    @jax.jit
    def run(params, cache, batch):
        hidden, aux, cache = forward_features(params, cache, batch, cfg,
                                              feature_layers=feature_layers)
        return hidden, (jnp.stack(aux, 1) if aux else None), cache

    out, out_aux = [], []
    caches = {}
    for ids in tqdm(seqs, desc="features", unit="seq"):
        ids = ids[:max_len]
        L = len(ids)
        T = next(b for b in buckets if b >= L)
        P = T // ps
        if T not in caches:
            caches[T] = init_kv_cache(cfg, P + 1, ps, jnp.float32)
        pos = np.arange(T, dtype=np.int32)
        pages = np.arange(1, P + 1, dtype=np.int32)
        tok = np.zeros(T, np.int32)
        tok[:L] = ids
        slot = np.where(pos < L, pages[pos // ps] * ps + pos % ps, 0).astype(np.int32)
        batch = StepBatch(tokens=tok, positions=np.where(pos < L, pos, 0).astype(np.int32),
                          slot_mapping=slot, block_tables=pages[None], seq_lens=np.array([L], np.int32),
                          query_start=np.array([0, L], np.int32),
                          logits_indices=np.array([L - 1], np.int32))
        hidden, aux, caches[T] = run(params, caches[T], batch)
        out.append(np.asarray(hidden[:L], np.float16))
        out_aux.append(None if aux is None else np.asarray(aux[:L], np.float16))
    return out, (out_aux if feature_layers else None)


class Windows:
    """Windows of `window` tokens (stride window) of each sequence, built when read (a
    grain source): tokens, features, positions, mask (1 where a position counts: real,
    and not a sequence's first), and aux [window, n, D] when the sequences have them."""

    def __init__(self, seqs, feats, window: int, aux=None):
        self.seqs, self.feats, self.aux, self.window = seqs, feats, aux, window
        self.index = [(i, s) for i, f in enumerate(feats) for s in range(0, len(f) - 1, window)]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, k):
        i, s = self.index[k]
        f, window = self.feats[i], self.window
        n = min(window, len(f) - s)
        w = {"tokens": np.zeros(window, np.int32),
             "features": np.zeros((window, f.shape[1]), np.float16),
             "positions": np.zeros(window, np.int32), "mask": np.zeros(window, np.float32)}
        w["tokens"][:n] = self.seqs[i][s:s + n]
        w["features"][:n] = f[s:s + n]
        w["positions"][:n] = np.arange(s, s + n)
        w["mask"][:n] = 1.0
        if s == 0:
            w["mask"][0] = 0.0
        if self.aux is not None:
            a = self.aux[i]
            w["aux"] = np.zeros((window,) + a.shape[1:], np.float16)
            w["aux"][:n] = a[s:s + n]
        return w


# --- evaluation ------------------------------------------------------------------------

def acceptance(hp, embed, cfg, heldout, k: int, rng, num_positions: int = 64):
    """(teacher-forced top-1 agreement, mean acceptance length of greedy chains of k
    drafts) on held-out sequences [(ids, prompt_len, features, aux or None)], at
    num_positions answer positions drawn by rng."""
    import jax

    from jaxserve.spec_decode.eagle_train import head_forward, input_features
    fuse = jax.jit(lambda hp, f, a: input_features(hp, {"features": f, "aux": a})[0])
    heldout = [(ids, pl, np.asarray(fuse(hp, f[None], None if a is None else a[None])))
               for ids, pl, f, a in heldout]
    lm = np.asarray(hp.body.lm_head, np.float32)
    vocab = np.asarray(hp.vocab)
    W = 256 + k  # every chain padded to one shape (causal: padding after does not matter)
    # embed as an argument: closed over, it would be lowered into the program as a constant
    fwd = jax.jit(lambda hp, e, t, f, q: head_forward(hp, e, t, f, q, cfg))
    lengths, agree, total = [], 0, 0
    cands = [(i, p) for i, (ids, pl, f) in enumerate(heldout)
             for p in range(max(pl, 1), len(f) - k - 1)]
    picks = [cands[j] for j in rng.choice(len(cands), min(num_positions, len(cands)), replace=False)]
    for i, p in picks:
        ids, _, f = heldout[i]  # f: what the head reads beside each token
        lo = max(0, p - 255)
        toks = np.zeros(W, np.int32)
        prev = np.zeros((W, f.shape[1]), np.float32)
        n_ctx = p + 1 - lo
        toks[:n_ctx] = ids[lo:p + 1]
        prev[:n_ctx] = [np.zeros_like(f[0]) if q == 0 else f[q - 1] for q in range(lo, p + 1)]
        pos = np.arange(lo, lo + W, dtype=np.int32)
        n = 0
        for j in range(k):
            last = n_ctx + j - 1
            guess = np.asarray(fwd(hp, embed, toks[None], prev[None], pos[None]))[0, last]
            d = int(vocab[np.argmax(guess @ lm)])
            if j == 0:
                total += 1
                agree += d == ids[p + 1]
            if d != ids[p + 1 + j]:
                break
            n += 1
            toks[last + 1] = d
            prev[last + 1] = guess
        lengths.append(n + 1)
    return agree / max(total, 1), float(np.mean(lengths)) if lengths else 0.0


# --- main ------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2_135m.py"))
    ap.add_argument("--out", default=str(ROOT / "jaxserve" / "spec_decode" / "heads" / "smollm2_135m"))
    ap.add_argument("--work", default=None, help="default: <cache>/eagle-train-<seed>")
    ap.add_argument("--cache-dir")
    ap.add_argument("--num-prompts", type=int, default=1920)
    ap.add_argument("--instruction-share", type=float, default=0.5,
                    help="the share of prompts from tools/instruction_prompts.py")
    ap.add_argument("--max-answer-tokens", type=int, default=192)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--intermediate-size", type=int, default=768)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3200)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=800)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--depths", type=int, default=3,
                    help="draft depths trained: 1 = EAGLE's teacher forcing; 2+ = the head "
                         "also learns from its own guesses (EAGLE-3's training-time test; "
                         "~2.3x the time per step at 3, the shipped head's)")
    ap.add_argument("--feature-layers", default="eagle3",
                    help="'eagle3': the head fuses the residual streams entering layers 2, "
                         "L // 2 and L - 3 (EAGLE-3; the shipped head); 'none': it reads the "
                         "target's final hidden state (EAGLE); or comma-separated indices")
    ap.add_argument("--reg-weight", type=float, default=1.0,
                    help="the feature regression's weight in the loss (EAGLE's 1.0; EAGLE-3 "
                         "drops it, 0, which over-fitted here: PERFORMANCE.md)")
    ap.add_argument("--k", type=int, default=4, help="chain length of the acceptance estimate")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import grain
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    import jaxserve
    from jaxserve.checkpoint import load_model_config, load_params
    from jaxserve.config import load_config
    from jaxserve.checkpoint.sources import default_cache_dir, resolve_checkpoint
    from jaxserve.spec_decode.eagle import (default_feature_layers, head_config, init_head,
                                            save_head)
    from jaxserve.spec_decode.eagle_train import join, loss_fn, split

    t_start = time.perf_counter()
    config = load_config(args.config)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    work = Path(args.work) if args.work else cache / f"eagle-train-{args.seed}"
    work.mkdir(parents=True, exist_ok=True)
    ckpt = resolve_checkpoint(config.source, cache)
    cfg = load_model_config(ckpt)
    if args.feature_layers == "none":
        feature_layers = ()
    elif args.feature_layers == "eagle3":
        feature_layers = default_feature_layers(cfg.num_layers)
    else:
        feature_layers = tuple(int(x) for x in args.feature_layers.split(","))

    data_file = work / "data.npz"
    aux_file = work / f"aux-{'-'.join(map(str, feature_layers))}.npz"
    aux = None
    if data_file.exists():
        z = np.load(data_file, allow_pickle=True)
        seqs, prompt_lens, feats = list(z["seqs"]), list(z["prompt_lens"]), list(z["feats"])
        log(f"data: {len(seqs)} sequences from {data_file}")
    else:
        prompts = training_prompts(args.num_prompts, args.seed, args.instruction_share)
        log(f"prompts: {len(prompts)} (no benchmark or held-out prompt among them)")
        llm = jaxserve.LLM(config, cache_dir=cache)
        pairs = generate_answers(llm, prompts, args.max_answer_tokens)
        del llm
        seqs = [np.asarray(ids[:args.max_len], np.int32) for ids, _ in pairs]
        prompt_lens = [pl for _, pl in pairs]
        # one forward a sequence gives both the final hidden states and the layers' inputs
        feats, aux = target_features(ckpt, cfg, [s.tolist() for s in seqs], args.max_len,
                                     feature_layers)
        if aux is not None:
            np.savez(aux_file, aux=np.asarray(aux, dtype=object))
        np.savez(data_file, seqs=np.asarray(seqs, dtype=object),
                 prompt_lens=np.asarray(prompt_lens), feats=np.asarray(feats, dtype=object))
        log(f"data: {len(seqs)} sequences, {sum(len(s) for s in seqs)} tokens -> {data_file}")

    if feature_layers:  # the residual streams entering them, cached beside the data
        if aux is None and aux_file.exists():
            aux = list(np.load(aux_file, allow_pickle=True)["aux"])
        elif aux is None:  # cached data of another head's layers: their inputs alone
            _, aux = target_features(ckpt, cfg, [s.tolist() for s in seqs], args.max_len,
                                     feature_layers)
            np.savez(aux_file, aux=np.asarray(aux, dtype=object))
        log(f"features entering layers {list(feature_layers)}: {aux_file}")

    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(seqs))
    n_held = max(8, len(seqs) // 20)
    held_idx, train_idx = order[:n_held], order[n_held:]
    answers = np.concatenate([seqs[i][prompt_lens[i]:] for i in train_idx])
    counts = np.bincount(answers, minlength=cfg.vocab_size)
    vocab = np.sort(np.argsort(-counts, kind="stable")[:args.draft_vocab])
    coverage = counts[vocab].sum() / max(counts.sum(), 1)
    log(f"draft vocabulary: {len(vocab)} tokens cover {coverage:.1%} of the answers' tokens")

    target = load_params(ckpt, cfg)
    embed = jnp.asarray(target.embed)
    hcfg = head_config(cfg, args.intermediate_size)
    hp = init_head(cfg, target, vocab, jax.random.key(args.seed), args.intermediate_size,
                   num_feature_layers=len(feature_layers))
    trainable, frozen = split(hp, embed)
    train = Windows([seqs[i] for i in train_idx], [feats[i] for i in train_idx], args.window,
                    None if aux is None else [aux[i] for i in train_idx])
    log(f"train: {len(train)} windows of {args.window} tokens; held out: {len(held_idx)} sequences")

    ds = (grain.MapDataset.source(train).shuffle(seed=args.seed).repeat()
          .batch(batch_size=args.batch))
    warmup = min(args.warmup, max(1, args.steps // 5))
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(sched, weight_decay=0.01))
    opt_state = opt.init(trainable)
    mngr = ocp.CheckpointManager(work / "ckpt", options=ocp.CheckpointManagerOptions(
        max_to_keep=2, save_interval_steps=args.save_every))
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        restored = mngr.restore(start, args=ocp.args.StandardRestore(
            {"trainable": trainable, "opt_state": opt_state}))
        trainable, opt_state = restored["trainable"], restored["opt_state"]
        log(f"resumed from step {start}")

    # committed to the device as the step's outputs will be (else step 2 compiles again)
    trainable, opt_state = jax.device_put((trainable, opt_state), jax.devices()[0])

    @jax.jit  # frozen as an argument, not a constant lowered into the program
    def step(trainable, opt_state, frozen, batch, key):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, frozen, batch, hcfg, key, args.depths, args.reg_weight)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss, aux

    heldout = [(seqs[i], prompt_lens[i], feats[i], None if aux is None else aux[i])
               for i in held_idx]
    key = jax.random.key(args.seed)
    history = []
    bar = tqdm(range(start, args.steps), desc="train", unit="step", initial=start,
               total=args.steps)
    for i in bar:
        batch = jax.tree.map(jnp.asarray, ds[i])
        trainable, opt_state, loss, aux = step(trainable, opt_state, frozen, batch,
                                               jax.random.fold_in(key, i))
        if i % 10 == 0:
            bar.set_postfix(loss=f"{float(loss):.3f}", top1=f"{float(aux['top1']):.2f}")
        history.append(float(loss))
        mngr.save(i + 1, args=ocp.args.StandardSave({"trainable": trainable,
                                                     "opt_state": opt_state}))
        if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
            top1, mal = acceptance(join(trainable, frozen), embed, hcfg, heldout, args.k,
                                   np.random.default_rng(args.seed))
            bar.write(f"step {i + 1}: loss {float(loss):.4f}; held-out top-1 {top1:.3f}, "
                      f"mean acceptance length (k={args.k}, greedy) {mal:.2f}")
    mngr.wait_until_finished()
    top1, mal = acceptance(join(trainable, frozen), embed, hcfg, heldout, args.k,
                           np.random.default_rng(args.seed + 1), num_positions=128)
    info = {"steps": args.steps, "seed": args.seed, "num_sequences": len(seqs),
            "draft_vocab_coverage": round(float(coverage), 4),
            "heldout_top1": round(top1, 4), "heldout_mean_acceptance_length": round(mal, 3),
            "final_loss": history[-1] if history else None,
            "minutes": round((time.perf_counter() - t_start) / 60, 1),
            "args": vars(args)}
    out = save_head(args.out, join(trainable, frozen), cfg, info, feature_layers)
    size = sum(f.stat().st_size for f in out.iterdir())
    log(f"head -> {out} ({size / 2**20:.1f} MiB); held-out top-1 {top1:.3f}, mean acceptance "
        f"length {mal:.2f}; {info['minutes']} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
