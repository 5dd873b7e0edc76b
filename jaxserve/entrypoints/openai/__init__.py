"""The OpenAI API: `protocol` (the request and response models, pydantic), `request`
(parsing and validating a request into engine inputs), `response` (shaping outputs,
logprobs, SSE), `serving` (one request's life without HTTP: submit, collect, respond),
`api_server` (Starlette routes, streaming, health, drain), `openapi`, and the batch-file
runner (`batch_file`, `run_batch`: OpenAI's Batch format, as vLLM's run_batch).

May import: the engine (AsyncEngine, its outputs and stats), structured output's request
types (jaxserve.sample.grammar), tokenization, config, `sampling_params`; never the model
or the worker (they are the engine's).
"""
