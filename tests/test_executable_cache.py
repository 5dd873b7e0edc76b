"""The executable cache a multi-process follower compiles through
(jaxserve.worker.executable_cache). Its programs are compiled in a subprocess with JAX's
persistent cache off, as a follower's are (a follower never reads JAX's cache:
tests/executable_cache_check.py); here, where JAX's cache is on, a program JAX read from
its cache is not kept. Two processes serving with it: tests/test_distributed.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxserve.worker.executable_cache import ExecutableCache

HERE = Path(__file__).resolve().parent


@pytest.mark.full  # fast tier: the SIGTERM test's follower keeps its programs (test_distributed)
def test_programs_compiled_once_are_read_back_by_later_processes(tmp_path):
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(HERE / "executable_cache_check.py"),
                           str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    # a program is compiled and written once, then read back: the same results, its
    # donated argument still donated
    assert r["jit"] == {"first": [0, 1], "again": [1, 0], "donated": True, "equal": True,
                        "files": 1}
    # a truncated file is compiled again and replaced by a whole one
    assert r["truncated"] == {"again": [0, 1], "third": [1, 0], "equal": True}
    # an engine's step programs: all compiled by the first engine, all read back by the
    # second, which gives the first's tokens (greedy and seeded)
    made = r["engine"]["first"][1]
    assert made >= 3 and r["engine"]["first"][0] == 0
    assert r["engine"]["second"] == [made, 0] and r["engine"]["equal"]
    assert r["engine"]["finished"] == ["length"] * 3


def test_a_program_jax_read_from_its_own_cache_is_not_kept(tmp_path):
    """Such an executable serialises incompletely on XLA:CPU (it loads, then fails at its
    first run), so the cache compiles it and writes nothing."""
    f = jax.jit(lambda x: jnp.cumsum(x * 3))
    arg = jax.ShapeDtypeStruct((5,), jnp.float32)
    f.lower(arg).compile()  # now in JAX's persistent cache (on in the tests: conftest.py)
    cache = ExecutableCache(tmp_path, [jax.devices()[0]])
    compiled = cache.compile(f.lower(arg), lambda lo: lo.compile())
    assert (cache.hits, cache.misses) == (0, 1) and not list(tmp_path.iterdir())
    assert compiled(jnp.ones(5)).tolist() == [3.0, 6.0, 9.0, 12.0, 15.0]
