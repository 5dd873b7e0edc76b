"""The peers of tools/bench_peers.py, one module each, and what they share."""
