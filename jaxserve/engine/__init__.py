"""The engine: host-side continuous batching, plain Python (testable without JAX).

Owns: `engine` (the step loop: schedule -> execute -> update; faults), `scheduler` (which
sequences run each step within the token budget), `page_pool` (free pages, refcounts,
prefix hashes, LRU), `sequence` (one request's state), `batch_builder` (a plan -> one
step's padded arrays), `outputs` (what a step returns per request), `async_engine` (the
engine on a thread of its own for asyncio servers).

May import: the worker, spec_decode, sample, model's step inputs, tokenization, config;
never the entrypoints, `jaxserve.api` or the command line.
"""
