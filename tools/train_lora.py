"""Fine-tune a LoRA adapter on chat examples with jaxserve's own functional model, and
write it in PEFT's format for `jaxserve serve --enable-lora --lora-modules NAME=OUT` (or
POST /v1/load_lora_adapter, or HF peft).

    python -m tools.train_lora --data chats.jsonl --out adapters/pirate
        [--config smollm2_135m_bf16] [--rank 8] [--alpha 16]
        [--targets wq,wk,wv,wo,w_gate,w_up,w_down] [--steps 60] [--batch 8] [--lr 2e-3]
        [--max-len 128] [--work DIR] [--save-every 20] [--seed 0]

1. Data: a JSONL of chats, each line {"messages": [..., {"role": "assistant", ...}]} or
   {"prompt", "completion"}; each rendered by the model's chat template, the loss on the
   assistant's tokens only (jaxserve.train.lora.chat_example), fed by a `grain` pipeline
   (shuffled per seed, repeated, batched; each batch padded to --max-len).
2. Model: the config's checkpoint in f32 (the default, smollm2_135m_bf16, is SmolLM2's
   GGUF dequantised: the adapter then serves over the Q4_1 default too), frozen; the
   adapter's factors (rank --rank, lora_alpha --alpha, on --targets) trained with `optax`
   AdamW (warm-up + cosine decay, gradient clipping) on `jaxserve.functional.score`
   (jaxserve.train.lora.sft_loss: the served model's own LoRA formulation).
3. `orbax` checkpoints of the factors and optimiser state every --save-every steps in
   --work (a rerun resumes there); at the end the adapter is written to --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="JSONL of chats")
    ap.add_argument("--out", required=True, help="the adapter's directory (PEFT format)")
    ap.add_argument("--config", default="smollm2_135m_bf16",
                    help="the base model's config (its checkpoint is read in f32)")
    ap.add_argument("--cache-dir")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16)
    ap.add_argument("--targets", default="wq,wk,wv,wo,w_gate,w_up,w_down",
                    help="projections to adapt (jaxserve names)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--work", help="checkpoints (default: OUT/../.OUT-train)")
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import grain
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import orbax.checkpoint as ocp

    from jaxserve.checkpoint import load_model_config, load_params
    from jaxserve.checkpoint.sources import default_cache_dir, resolve_checkpoint
    from jaxserve.config import load_config
    from jaxserve.tokenization.tokenizer import Tokenizer
    from jaxserve.train.lora import (chat_example, init_adapter, pad_batch, read_chats,
                                     save_peft, sft_loss)

    t0 = time.perf_counter()
    config = load_config(args.config)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    ckpt = resolve_checkpoint(config.source, cache)
    cfg = load_model_config(ckpt).replace(dtype="float32")
    tokenizer = Tokenizer.from_dir(ckpt)
    params = load_params(ckpt, cfg)
    examples = [chat_example(tokenizer, c, args.max_len) for c in read_chats(args.data)]
    log(f"{len(examples)} chats, {sum(int(m.sum()) for _, m in examples)} answer tokens")

    ds = (grain.MapDataset.source(examples).shuffle(seed=args.seed).repeat()
          .batch(batch_size=args.batch, batch_fn=lambda xs: pad_batch(xs, args.max_len)))
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    factors = init_adapter(cfg, args.rank, targets, jax.random.key(args.seed))
    scaling = args.alpha / args.rank
    warmup = max(1, args.steps // 10)
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
    opt_state = opt.init(factors)
    out = Path(args.out)
    work = Path(args.work) if args.work else out.parent / f".{out.name}-train"
    mngr = ocp.CheckpointManager(work.resolve(), options=ocp.CheckpointManagerOptions(
        max_to_keep=1, save_interval_steps=args.save_every))
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.latest_step()
        restored = mngr.restore(start, args=ocp.args.StandardRestore(
            {"factors": factors, "opt_state": opt_state}))
        factors, opt_state = restored["factors"], restored["opt_state"]
        log(f"resumed from step {start}")

    # committed to the device as the step's outputs will be: else the second step, whose
    # inputs are the first one's outputs, compiles (or loads) the program a second time
    factors, opt_state = jax.device_put((factors, opt_state), jax.devices()[0])
    # params as an argument, not closed over: a closed-over array is a constant of the
    # program (the f32 model, ~0.5 GB, lowered into it: 7.5 s to lower instead of 1.2)
    @jax.jit
    def step(factors, opt_state, params, batch):
        loss, grads = jax.value_and_grad(sft_loss)(factors, params, cfg, batch["tokens"],
                                                   batch["lengths"], batch["mask"], scaling)
        updates, opt_state = opt.update(grads, opt_state, factors)
        return optax.apply_updates(factors, updates), opt_state, loss

    loss = None
    for i in range(start, args.steps):
        batch = jax.tree.map(jnp.asarray, ds[i])
        factors, opt_state, loss = step(factors, opt_state, params, batch)
        if i % 10 == 0 or i + 1 == args.steps:
            log(f"step {i + 1}/{args.steps}: loss {float(loss):.4f} nats/token "
                f"({time.perf_counter() - t0:.0f} s)")
        mngr.save(i + 1, args=ocp.args.StandardSave({"factors": factors,
                                                     "opt_state": opt_state}))
    mngr.wait_until_finished()
    save_peft(out, jax.tree.map(np.asarray, factors), args.rank, args.alpha,
              config.served_model_name or config.name)
    log(f"adapter written to {out} ({time.perf_counter() - t0:.0f} s"
        + (f", final loss {float(loss):.4f})" if loss is not None else ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
