"""Driving an Engine in tests: requests arriving over engine steps."""

from __future__ import annotations


def run_staggered(engine, requests, arrivals, check=None, max_steps=5000):
    """Add request i = (id, prompt ids, SamplingParams) at engine step arrivals[i]; step
    until all of them finish. `check`, if given, is called on every RequestOutput of theirs.
    Returns ({id: the final RequestOutput}, the largest number of running sequences seen).
    Fails the test if they have not finished after max_steps steps."""
    done, step, max_running = {}, 0, 0
    ids = {rid for rid, _, _ in requests}
    pending = sorted(range(len(requests)), key=lambda i: arrivals[i])
    while len(done) < len(requests):
        while pending and arrivals[pending[0]] <= step:
            rid, prompt, params = requests[pending.pop(0)]
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.request_id not in ids:
                continue
            if check is not None:
                check(out)
            if out.finished:
                done[out.request_id] = out
        max_running = max(max_running, len(engine.scheduler.running))
        step += 1
        assert step < max_steps, "engine made no progress"
    return done, max_running
