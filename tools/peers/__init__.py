"""The peers of tools.bench_peers, one module each, and what they share."""
