"""What users and clients reach: the OpenAI-compatible server (`openai/`), offline batch
files (`openai/run_batch`), Prometheus metrics (`metrics`).

May import: everything below it (engine, api, tokenization, config, ...); nothing imports
it except `jaxserve.cli` and `jaxserve.bench`.
"""
