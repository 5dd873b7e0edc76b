"""Offline batch inference over an OpenAI Batch file (`python -m jaxserve.batch`).

    python -m jaxserve.batch -i requests.jsonl -o results.jsonl [--config configs/NAME.py]
        [--max-concurrency N] [--no-progress] [model and engine flags as serve.py]

Each input line is one `/v1/completions` or `/v1/chat/completions` request, answered as the
HTTP server would answer it (`jaxserve.openai_serving`), without HTTP. See
`jaxserve.batch.batch_file` for the formats and `jaxserve.batch.runner` for how it reads,
runs and resumes. Source: vLLM's `python -m vllm.entrypoints.openai.run_batch`.
"""

from jaxserve.batch.batch_file import BatchFileError
from jaxserve.batch.runner import BatchInterrupted, BatchStats, run_batch

__all__ = ["BatchFileError", "BatchInterrupted", "BatchStats", "run_batch"]
