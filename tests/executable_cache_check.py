"""Run as a subprocess with JAX's persistent compilation cache off
(JAX_ENABLE_COMPILATION_CACHE=false), so every program is compiled here, as a
multi-process follower's are (tests/test_executable_cache.py): the executable cache
(jaxserve.worker.executable_cache) in DIR, used by three cache objects in turn, as three
processes would. Prints JSON:
{"jit": {"first": [hits, misses], "again": [...], "equal": bool, "donated": bool,
         "files": n},
 "truncated": {"again": [hits, misses], "equal": bool, "third": [hits, misses]},
 "engine": {"first": [hits, misses], "second": [hits, misses], "equal": bool,
            "finished": [finish reasons]}}

    python tests/executable_cache_check.py DIR
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine_utils import outputs, tiny_engine, tiny_params  # tests/: the script's directory
from jaxserve.sampling_params import SamplingParams
from jaxserve.worker.executable_cache import ExecutableCache


def lowered():
    f = jax.jit(lambda x, y: (x * 2 + y, (y ** 2).sum()), donate_argnums=(0,))
    return f.lower(jax.ShapeDtypeStruct((8,), jnp.float32),
                   jax.ShapeDtypeStruct((8,), jnp.float32))


def run(compiled):
    x, y = jnp.arange(8, dtype=jnp.float32), jnp.ones(8, jnp.float32)
    out = jax.tree.map(np.asarray, compiled(x, y))
    return out, x.is_deleted()


def counts(cache):
    return [cache.hits, cache.misses]


def main(directory: str) -> None:
    devices = [jax.devices()[0]]
    d = Path(directory)
    out = {}
    first = ExecutableCache(d / "jit", devices)
    want, _ = run(first.compile(lowered(), lambda lo: lo.compile()))
    again = ExecutableCache(d / "jit", devices)
    got, donated = run(again.compile(lowered(), lambda lo: lo.compile()))
    out["jit"] = {"first": counts(first), "again": counts(again), "donated": donated,
                  "equal": all(np.array_equal(a, b) for a, b in zip(got, want)),
                  "files": len(list((d / "jit").glob("*.bin")))}
    (path,) = (d / "jit").glob("*.bin")
    path.write_bytes(path.read_bytes()[:100])  # a truncated write
    again = ExecutableCache(d / "jit", devices)
    got, _ = run(again.compile(lowered(), lambda lo: lo.compile()))
    third = ExecutableCache(d / "jit", devices)
    third.compile(lowered(), lambda lo: lo.compile())
    out["truncated"] = {"again": counts(again), "third": counts(third),
                        "equal": all(np.array_equal(a, b) for a, b in zip(got, want))}
    # the Runner's step programs (forward, sampler, multi-step decode) through the cache
    params = tiny_params()
    rng = np.random.default_rng(0)
    requests = [(str(i), rng.integers(0, 256, n).tolist(),
                 SamplingParams(max_tokens=12, temperature=t, seed=3, ignore_eos=True))
                for i, (n, t) in enumerate([(5, 0.0), (11, 0.8), (3, 0.0)])]
    got = []
    for _ in range(2):
        cache = ExecutableCache(d / "engine", devices)
        done = outputs(tiny_engine(params, executable_cache=cache, decode_steps=4), requests,
                       [0, 0, 2])
        got.append((counts(cache), done))
    (first, want), (second, again) = got
    out["engine"] = {"first": first, "second": second, "equal": again == want,
                     "finished": sorted(reason for _, _, reason in want.values())}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
