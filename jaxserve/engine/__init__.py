"""The engine: host-side continuous batching, plain Python (testable without JAX)
but for `builder`, which assembles the device side.

Owns: `engine` (the step loop: schedule -> execute -> update; faults), `scheduler` (which
sequences run each step within the token budget), `page_pool` (free pages, refcounts,
prefix hashes, LRU), `sequence` (one request's state), `batch_builder` (a plan -> one
step's padded arrays), `outputs` (what a step returns per request), `async_engine` (the
engine on a thread of its own for asyncio servers), `builder` (`build_engine`: a Config ->
weights on the mesh, kernels, the KV page pool, the drafter, compiled steps).

May import: the worker, spec_decode, checkpoint, sample, model, kernels, distributed,
tokenization, config;
never the entrypoints, `jaxserve.api` or the command line.
"""
