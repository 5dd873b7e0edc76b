"""`jaxserve batch -i requests.jsonl -o results.jsonl`: build the engine, answer
every request of the input file into the output file, print this run's stats as one JSON
line on stdout (logs go to stderr), with jax_compile_events_after_warmup: the JAX traces,
lowerings and compilations while the batch ran (0: it ran in the warmed-up steps). Run it
again with the same output file after an interrupt and it does only what is left. Exit
status 0 when every line has a result (some may be errors), 1 for a bad file or flag, 2
when the engine stopped, 130 on Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from jaxserve.api import DEFAULT_CONFIG
from jaxserve.engine.builder import build_engine
from jaxserve.entrypoints.openai.batch_file import BatchFileError
from jaxserve.entrypoints.openai.run_batch import BatchInterrupted, run_batch
from jaxserve.checkpoint import CheckpointError
from jaxserve.cli.args import BATCH_FLAGS, apply_flags
from jaxserve.config import ConfigError, load_config
from jaxserve.config.args import add_flags
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.entrypoints.openai.serving import OpenAIServing

log = logging.getLogger("jaxserve.batch")


def parser(prog: str = "jaxserve batch") -> argparse.ArgumentParser:
    """The command line: this command's own flags, then the config flags (BATCH_FLAGS:
    the model and engine flags of `jaxserve serve`)."""
    ap = argparse.ArgumentParser(prog=prog,
                                 description="Offline batch inference over an OpenAI Batch "
                                             "file (vLLM's run_batch format).")
    ap.add_argument("-i", "--input-file", required=True,
                    help="JSON lines, one request each: {custom_id, method: POST, url: "
                         "/v1/completions or /v1/chat/completions, body}")
    ap.add_argument("-o", "--output-file", required=True,
                    help="JSON lines, one result each, in completion order; an existing file "
                         "from an interrupted run is resumed")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG),
                    help="a shipped config's name (smollm2_135m, ...) or a config file's path")
    ap.add_argument("--cache-dir", help="where converted weights and compiled code are cached")
    ap.add_argument("--max-concurrency", type=int,
                    help="most requests in the engine at once (default: 2 x max_num_seqs, "
                         "so a finished sequence's slot is refilled at once)")
    ap.add_argument("--read-threads", type=int, default=2,
                    help="grain reader threads that parse and tokenise ahead (default 2)")
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar")
    add_flags(ap, BATCH_FLAGS)
    return ap


def parse_args(argv: list[str] | None = None, prog: str = "jaxserve batch") -> argparse.Namespace:
    """The command line, parsed (`parser`)."""
    return parser(prog).parse_args(argv)


def main(argv: list[str] | None = None, prog: str = "jaxserve batch") -> int:
    """Run the batch; the exit status (see the module docstring)."""
    args = parse_args(argv, prog)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    logging.getLogger("jaxserve.entrypoints.openai.serving").setLevel(logging.WARNING)  # a line a request
    try:
        config = apply_flags(load_config(args.config), args)
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        if args.read_threads < 1:
            raise ConfigError(f"--read-threads must be >= 1, got {args.read_threads}")
        if not Path(args.input_file).is_file():  # before the engine's minute of building
            raise ConfigError(f"--input-file: {args.input_file} is not a file")
        engine = build_engine(config, cache_dir=args.cache_dir)
        warm = engine.stats().compile_events
    except (ConfigError, CheckpointError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted before the batch started", file=sys.stderr)
        return 130
    concurrency = args.max_concurrency or 2 * config.engine.scheduler.max_num_seqs
    async_engine = AsyncEngine(engine, max_queued_requests=None)
    serving = OpenAIServing(async_engine, engine.tokenizer,
                            config.served_model_name or config.name,
                            config.engine.max_model_len, config.server)
    try:
        stats = asyncio.run(run_batch(serving, args.input_file, args.output_file,
                                      max_concurrency=concurrency, progress=args.progress,
                                      read_threads=args.read_threads))
    except BatchFileError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except BatchInterrupted as e:
        print(f"{prog}: {e}; run the same command again to finish the "
              "batch", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; run the same command again to finish "
              "the batch", file=sys.stderr)
        return 130
    finally:
        async_engine.shutdown()
        engine.runner.stop_warmup()
    after = (engine.stats().compile_events - warm).total
    print(json.dumps({**stats.summary(), "jax_compile_events_after_warmup": after}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
