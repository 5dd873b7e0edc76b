"""Speculative decoding: `controller` (the host-side policy and counters: when to speculate,
which drafts, when multi-step bursts take over), the proposers (`ngram` prompt lookup on the
host; `draft_model` and `eagle` propose on device inside the verify step), `eagle_train`
(training an EAGLE head) and the shipped heads (`heads/`). The verifying rejection sampler
is jaxserve.sample.rejection_sampler. See jaxserve.config.SpeculativeConfig.

May import: model, sample, kernels, distributed, config; never the worker or the engine
(the controller sees sequences only through their attributes).
"""
