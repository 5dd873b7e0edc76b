"""The worker: runs steps on the devices.

Owns: `runner` (the compiled step per shape bucket, dispatch and fetch, the KV pool held
and donated), `input_batch` (a step's all-padding arrays of a bucketed shape),
`compilation` (step shapes and buckets), `kernel_selection` (which kernels an engine runs
and the weights laid out for them), `memory_plan` (bytes of weights, KV pool and a step's
activations; the pool's size, or the refusal of one that does not fit), `device_memory`
(what memory the devices really have), `compile_events` (JAX traces, lowerings, compilations and
compilation-cache fetches in this process), `executable_cache` (the step programs a
multi-process follower compiles, kept on disk: JAX's persistent cache serves process 0 only).

May import: model, sample, spec_decode's device parts, checkpoint, kernels, distributed,
config, tokenization and the package's root utilities (`pytree`, `sampling_params`);
never the engine or the entrypoints.
"""
