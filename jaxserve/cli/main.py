"""The `jaxserve` command (also `python -m jaxserve`):

    jaxserve serve [--config NAME|PATH] [flags]      OpenAI-compatible server (vLLM's `vllm serve`)
    jaxserve batch -i IN.jsonl -o OUT.jsonl [flags]  offline batch inference (OpenAI Batch files)
    jaxserve bench serve|step|batch|generate [flags] benchmarks, ratios against a same-run baseline
    jaxserve convert SRC OUT [--dtype D]             HF directory or GGUF file -> jaxserve checkpoint
    jaxserve plan-memory --config NAME|PATH          per-device memory plan, nothing allocated

`jaxserve COMMAND --help` lists a command's flags. Each command is one module's `main(argv)`,
imported only when it runs (so `jaxserve convert --help` does not start JAX's runtime).
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, one-line help); `bench` takes a second word (BENCHMARKS).
COMMANDS = {
    "serve": ("jaxserve.cli.serve", "serve a model over the OpenAI API"),
    "batch": ("jaxserve.cli.batch", "answer an OpenAI Batch file offline"),
    "bench": (None, "benchmarks: serve, step, batch, generate"),
    "convert": ("jaxserve.cli.convert", "convert an HF directory or a GGUF file to a checkpoint"),
    "plan-memory": ("jaxserve.cli.plan_memory", "print a config's per-device memory plan"),
}
BENCHMARKS = {
    "serve": "jaxserve.bench.serve",
    "step": "jaxserve.bench.step",
    "batch": "jaxserve.bench.batch",
    "generate": "jaxserve.bench.generate",
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: jaxserve COMMAND [flags]   (jaxserve COMMAND --help)", "", "commands:"]
    lines += [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run `jaxserve ARGV` (default sys.argv[1:]); returns the command's exit status (2 for
    an unknown command, as argparse does)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{_usage()}\n\njaxserve: error: unknown command {command!r}", file=sys.stderr)
        return 2
    module = COMMANDS[command][0]
    prog = f"jaxserve {command}"
    if command == "bench":
        if not rest or rest[0] not in BENCHMARKS:
            print(f"usage: jaxserve bench {{{','.join(BENCHMARKS)}}} [flags]", file=sys.stderr)
            return 0 if rest and rest[0] in ("-h", "--help") else 2
        module, prog, rest = BENCHMARKS[rest[0]], f"jaxserve bench {rest[0]}", rest[1:]
    status = importlib.import_module(module).main(rest, prog=prog)
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
