"""Serve a model over the OpenAI API.

    python serve.py [--config configs/smollm2_135m.py] [--host H] [--port P] [--cache-dir DIR]

Loads the config file's CONFIG, builds and warms up the engine, and serves
/v1/completions, /v1/chat/completions, /v1/models and /health with uvicorn.
"""

from __future__ import annotations

import argparse
import logging

import uvicorn

from jaxserve.api import DEFAULT_CONFIG, build_engine
from jaxserve.config import load_config
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server import build_app

log = logging.getLogger("jaxserve.serve")


class _Server(uvicorn.Server):
    """uvicorn's server, logging "ready" with the URL once it listens."""

    async def startup(self, sockets=None) -> None:
        """uvicorn's startup (bind, lifespan), then the "ready" log line."""
        await super().startup(sockets)
        if self.started:
            log.info("ready: http://%s:%d/v1", self.config.host, self.config.port)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, build the engine, run the server until interrupted."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="a configs/NAME.py file")
    ap.add_argument("--host", help="bind address (default: the config's, 127.0.0.1)")
    ap.add_argument("--port", type=int, help="port (default: the config's, 8000)")
    ap.add_argument("--cache-dir", help="where converted weights and compiled code are cached")
    ap.add_argument("--no-background-warmup", dest="background_warmup", action="store_false",
                    help="compile every step shape before serving (default: serve once the "
                         "first shapes are compiled, compile the rest in the background)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax's per-file chatter

    config = load_config(args.config)
    host, port = args.host or config.host, args.port or config.port
    # Serve as soon as the first shapes are compiled; the rest compile in the background
    # (from the on-disk compilation cache after the first start: seconds to first token).
    engine = build_engine(config, cache_dir=args.cache_dir,
                          warmup="background" if args.background_warmup else True)
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, engine.tokenizer, config.served_model_name or config.name,
                    config.engine.max_model_len)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on (as uvicorn.run)
        pass
    finally:
        async_engine.shutdown()
        engine.runner.stop_warmup()


if __name__ == "__main__":
    main()
