"""Benchmarks users run (`jaxserve bench serve|step|batch|generate`), each printing ratios
against a baseline measured in the same run: `serve` (an OpenAI server under a workload:
TTFT, TPOT, ITL, throughput; vLLM's benchmark_serving metrics), `step` (one compiled step's
time per shape, two kernel or layout choices side by side), `batch` (offline batch vs the
server on one workload), `generate` (offline generation against the memory-bandwidth bound
measured in the run and HF transformers on the same shapes: the GPU session's one
command). The workloads ship in `data/`. Results belong in PERFORMANCE.md.

May import: anything in jaxserve except `jaxserve.cli`.
"""
