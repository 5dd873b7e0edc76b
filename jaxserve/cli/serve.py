"""`jaxserve serve`: serve a model over the OpenAI API (`python serve.py` in a checkout).

    jaxserve serve [--config smollm2_135m] [--host H] [--port P] [--cache-dir DIR]
                    [--model PATH] [--load-format dummy] [--num-layers N]
                    [--tensor-parallel-size N] [--pipeline-parallel-size M]
                    [--api-key KEY] [--allowed-origins O ...]
                    [engine settings, limits: see --help]

Loads the config file's CONFIG, builds and warms up the engine, and serves
/v1/completions, /v1/chat/completions, /v1/models, /health, /ready, /metrics and
/openapi.json with uvicorn. SIGTERM or SIGINT drains: new requests get 503 while the ones
in flight finish (up to --shutdown-timeout seconds; then they are aborted), and the process
exits 0. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import time

import uvicorn

from jaxserve.distributed import multiprocess as distributed
from jaxserve.api import DEFAULT_CONFIG
from jaxserve.engine.builder import build_engine
from jaxserve.checkpoint import CheckpointError
from jaxserve.cli.args import SERVE_FLAGS, apply_flags
from jaxserve.config import ConfigError, load_config
from jaxserve.config.args import add_flags
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.entrypoints.metrics import Metrics
from jaxserve.entrypoints.openai.api_server import Lifecycle, build_app

log = logging.getLogger("jaxserve.serve")

API_KEY_ENV = "JAXSERVE_API_KEY"
# How long uvicorn waits for connections to close once the drain has ended (the aborted
# requests' last SSE events); the drain itself is --shutdown-timeout.
_CLOSE_TIMEOUT_S = 5.0
# glibc's malloc arenas for the server process (--malloc-arena-max): by default glibc makes
# up to 8 per core, and XLA's compiler threads leave memory in each (SmolLM2's engine after
# warm-up: 2,605 MB resident with glibc's default, 2,353 MB with 2; decode speed the same:
# PERFORMANCE.md, "The layer loop, landed").
DEFAULT_MALLOC_ARENA_MAX = 2
_M_ARENA_MAX = -8  # mallopt's parameter number (glibc malloc.h)


def limit_malloc_arenas(n: int) -> bool:
    """Cap glibc's malloc arenas at `n` for the rest of this process (mallopt M_ARENA_MAX,
    as the MALLOC_ARENA_MAX environment variable does at start): arenas threads create
    from now on. 0 leaves glibc's default. Returns whether it was applied (False on a C
    library without mallopt, e.g. musl or macOS, or for n = 0)."""
    if n <= 0:
        return False
    path = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(path).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_ARENA_MAX, n))


class _Server(uvicorn.Server):
    """uvicorn's server, logging "ready" with the URL once it listens, and draining on
    SIGTERM / SIGINT before it stops (uvicorn itself would stop accepting connections at
    once and re-raise the signal on exit, ending the process with the signal's status)."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine,
                 lifecycle: Lifecycle, shutdown_timeout_s: float):
        super().__init__(config)
        self.async_engine, self.lifecycle = async_engine, lifecycle
        self.shutdown_timeout_s = shutdown_timeout_s
        self._drain_deadline: float | None = None

    async def startup(self, sockets=None) -> None:
        """uvicorn's startup (bind, lifespan), then the "ready" log line."""
        await super().startup(sockets)
        if self.started:
            log.info("ready: http://%s:%d/v1", self.config.host, self.config.port)

    def handle_exit(self, sig: int, frame) -> None:
        """First signal: start draining (`on_tick` ends it). Second: stop now."""
        if self.lifecycle.draining:
            log.warning("second signal: stopping without waiting for requests")
            self.should_exit = self.force_exit = True
            return
        log.info("%s: draining %d in-flight requests (up to %g s); new requests get 503",
                 signal.Signals(sig).name, self.async_engine.num_in_flight,
                 self.shutdown_timeout_s)
        self.lifecycle.draining = True
        self._drain_deadline = time.monotonic() + self.shutdown_timeout_s

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s): ends a drain once no request is in flight, or at
        its deadline after aborting the rest."""
        if self._drain_deadline is not None and not self.should_exit:
            left = self.async_engine.num_in_flight
            if left and time.monotonic() >= self._drain_deadline:
                log.warning("shutdown timeout: aborting %d requests", left)
                self.async_engine.abort_all()
                left = 0
            if not left:
                self.should_exit = True
        return await super().on_tick(counter)


def _arena_count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def parser(prog: str = "jaxserve serve") -> argparse.ArgumentParser:
    """The command line: this command's own flags, then the config flags (SERVE_FLAGS)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG),
                    help="a shipped config's name (smollm2_135m, ...) or a config file's path")
    ap.add_argument("--host", help="bind address (default: the config's, 127.0.0.1)")
    ap.add_argument("--port", type=int, help="port (default: the config's, 8000)")
    ap.add_argument("--cache-dir", help="where converted weights and compiled code are cached")
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                    help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}; "
                         "unset = no key)")
    ap.add_argument("--no-background-warmup", dest="background_warmup", action="store_false",
                    help="compile every step shape before serving (default: serve once the "
                         "first shapes are compiled, compile the rest in the background)")
    ap.add_argument("--dist-init-addr",
                    help="multi-process: process 0's HOST:PORT for jax.distributed (sglang's flag)")
    ap.add_argument("--nnodes", type=int, default=1,
                    help="multi-process: how many processes (each with its local devices)")
    ap.add_argument("--node-rank", type=int, default=0,
                    help="multi-process: this process's rank; 0 serves HTTP and schedules")
    ap.add_argument("--malloc-arena-max", type=_arena_count, default=DEFAULT_MALLOC_ARENA_MAX,
                    help="cap glibc's malloc arenas in the server process (fewer: less "
                         "memory left behind by the compiler's threads; 0: glibc's default "
                         f"of 8 per core; default {DEFAULT_MALLOC_ARENA_MAX})")
    add_flags(ap, SERVE_FLAGS)
    return ap


def main(argv: list[str] | None = None, prog: str = "jaxserve serve") -> None:
    """Parse the command line, build the engine, run the server until a signal drains it."""
    ap = parser(prog)
    args = ap.parse_args(argv)
    limit_malloc_arenas(args.malloc_arena_max)  # before the compiler's threads start
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-file chatter

    try:
        config = apply_flags(load_config(args.config), args)
    except (ConfigError, CheckpointError) as e:
        ap.error(str(e))
    host, port = args.host or config.host, args.port or config.port
    multi = args.nnodes > 1
    if multi:
        if not args.dist_init_addr:
            ap.error("--nnodes > 1 needs --dist-init-addr HOST:PORT (process 0's address)")
        try:
            distributed.initialize(args.dist_init_addr, args.nnodes, args.node_rank)
        except ValueError as e:
            ap.error(str(e))
    # Serve as soon as the first shapes are compiled; the rest compile in the background
    # (from the on-disk compilation cache after the first start: seconds to first token).
    warmup = "background" if args.background_warmup else True
    try:
        engine = build_engine(config, cache_dir=args.cache_dir, warmup=False if multi else warmup)
    except (ConfigError, CheckpointError) as e:  # no weights, a plan that does not fit:
        print(f"{prog}: error: {e}", file=sys.stderr)  # one line, argparse's status 2
        raise SystemExit(2) from None
    channel = None
    if multi:
        channel = _join_processes(engine, args, prog)
        if channel is None:  # a follower: it ran process 0's steps until told to stop
            return
        if warmup == "background":
            engine.runner.warmup_in_background()
        else:
            engine.runner.warmup()
    metrics = Metrics(engine.stats)
    server_config = config.server
    async_engine = AsyncEngine(engine, request_timeout_s=server_config.request_timeout_s,
                               max_stream_buffer_bytes=server_config.max_stream_buffer_bytes,
                               max_queued_requests=server_config.max_queued_requests,
                               metrics=metrics)
    lifecycle = Lifecycle()
    app = build_app(async_engine, engine.tokenizer, config.served_model_name or config.name,
                    config.engine.max_model_len, server_config, api_key=args.api_key,
                    metrics=metrics, lifecycle=lifecycle)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="info",
                                    timeout_graceful_shutdown=_CLOSE_TIMEOUT_S),
                     async_engine, lifecycle, server_config.shutdown_timeout_s)
    try:
        server.run()
    finally:
        async_engine.shutdown()
        engine.runner.stop_warmup()
        if channel is not None:
            channel.stop()


def _join_processes(engine, args: argparse.Namespace, prog: str):
    """Multi-process: process 0 opens the step channel and returns it (its runner sends
    every step through it); a follower runs process 0's steps until it says stop, then
    returns None, or exits with an error naming what is gone. When a follower dies,
    process 0 logs it and exits (status 3): no step can run without its devices."""
    rank = args.node_rank
    if rank == 0:
        def lost(r: int) -> None:
            log.error("process %d of %d is gone: stopping (its devices hold part of the "
                      "model)", r, args.nnodes)
            logging.shutdown()
            os._exit(3)

        host = args.dist_init_addr.rpartition(":")[0]
        try:
            channel = distributed.StepChannel.lead(args.nnodes, host, lost)
        except distributed.DistributedError as e:
            raise SystemExit(f"{prog}: error: {e}") from None
        engine.runner.mirror = channel
        return channel
    try:
        engine.runner.follow(distributed.StepChannel.follow(rank))
    except distributed.DistributedError as e:
        log.error("process %d: %s", rank, e)
        logging.shutdown()
        os._exit(3)  # the runtime's own shutdown would wait on the dead process
    log.info("process %d: process 0 stopped; exiting", rank)
    return None


if __name__ == "__main__":
    main()
