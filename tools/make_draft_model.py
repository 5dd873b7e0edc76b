"""Write a draft model for speculative decoding: the first layers of a config's model.

    python -m tools.make_draft_model OUT [--config configs/smollm2_135m.py] [--num-layers 4]
    python serve.py --speculative-config '{"method": "draft_model", "model": "OUT",
                                           "num_speculative_tokens": 3}'

No smaller sibling of SmolLM2-135M can be had offline; a truncated copy (its first
`--num-layers` decoder layers, read out through its own final norm and LM head) shares its
tokenizer and is what the draft-model path is tested with
(jaxserve.checkpoint.truncate_checkpoint). Fetches / converts the config's weights first if
they are not in the cache.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from jaxserve.checkpoint import truncate_checkpoint
from jaxserve.checkpoint.sources import default_cache_dir, resolve_checkpoint
from jaxserve.config import load_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory to write the draft checkpoint to")
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2_135m.py"))
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--cache-dir", help="jaxserve's cache (default ~/.cache/jaxserve)")
    args = ap.parse_args(argv)
    config = load_config(args.config)
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    out = truncate_checkpoint(resolve_checkpoint(config.source, cache), args.out,
                              args.num_layers)
    print(f"draft model: the first {args.num_layers} layers -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
