"""The config flags of `jaxserve serve` and `jaxserve batch` (generated from the config
fields by jaxserve.config.args), and how they override a config file's Config. Here rather
than there because `--model PATH` becomes a ModelSource by looking at what the path holds
(jaxserve.checkpoint.sources.source_from_path)."""

from __future__ import annotations

import argparse

from jaxserve.checkpoint.sources import source_from_path
from jaxserve.config import Config
from jaxserve.config.args import ENGINE_FLAGS, MODEL_FLAGS, SERVER_FLAGS, apply, given

BATCH_FLAGS = MODEL_FLAGS + ENGINE_FLAGS  # jaxserve batch
SERVE_FLAGS = BATCH_FLAGS + SERVER_FLAGS  # jaxserve serve


def apply_flags(config: Config, args: argparse.Namespace) -> Config:
    """`config` with the config flags that were given (jaxserve.config.args.add_flags).
    Raises ConfigError (or CheckpointError for --model) naming a value the config
    refuses."""
    fields = given(args)
    if "source" in fields:
        fields["source"] = source_from_path(fields["source"])
    return apply(config, fields)
