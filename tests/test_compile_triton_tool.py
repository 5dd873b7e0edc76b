"""tools/compile_triton.py: Triton IR extraction from a CUDA-lowered Pallas kernel (no GPU,
no triton needed), ptxas log parsing, the clear message without triton, and, where pip's
triton is importable, an actual sm_80 compile."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "compile_triton.py"
HAVE_TRITON = importlib.util.find_spec("triton") is not None


from tools import compile_triton as ct  # noqa: E402


def _add_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0 + y_ref[...]


def _add(x, y):
    import jax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    spec = pl.BlockSpec((16, 32), lambda i: (i, 0))
    return pl.pallas_call(_add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                          in_specs=[spec, spec], out_specs=spec,
                          compiler_params=plgpu.CompilerParams(num_warps=2, num_stages=1))(x, y)


@pytest.fixture(scope="module")
def lowered():
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    return ct.lower_for_cuda(_add, (x, x))


def test_extract_from_lowered_text(lowered):
    calls = ct.extract_triton_calls(lowered.as_text())
    assert len(calls) == 1
    [call] = calls
    assert "add_kernel" in call.name
    assert call.grid == (4, 1, 1)
    assert (call.num_warps, call.num_stages) == (2, 1)
    assert "tt.func" in call.ttir and "tt.load" in call.ttir and "tt.store" in call.ttir
    assert '"tt.func"' in call.ttir_generic  # the generic op form quotes op names
    # The Lowered object itself gives the same.
    assert ct.extract_triton_calls(lowered) == calls


def test_extract_without_triton_calls():
    import jax
    import jax.numpy as jnp

    low = ct.lower_for_cuda(lambda x: x + 1, (jax.ShapeDtypeStruct((8,), jnp.float32),))
    assert ct.extract_triton_calls(low) == []


def test_parse_ptxas_log():
    log = """ptxas info    : 11 bytes gmem, 8 bytes cmem[4]
ptxas info    : Compiling entry function 'k' for 'sm_80'
ptxas info    : Function properties for k
    80 bytes stack frame, 76 bytes spill stores, 72 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0], 8 bytes cmem[2]
"""
    s = ct.parse_ptxas_log(log, "k")
    assert (s.registers, s.stack_frame, s.spill_stores, s.spill_loads) == (255, 80, 76, 72)
    assert (s.smem, s.cmem, s.barriers) == (1024, 400, 1)
    s = ct.parse_ptxas_log(log.replace("ptxas info", "ptxas-blackwell info")
                           .replace(", 1024 bytes smem, 400 bytes cmem[0], 8 bytes cmem[2]", ""))
    assert (s.registers, s.smem, s.cmem) == (255, 0, None)
    assert ct.parse_arch("sm_90a") == 90 and ct.parse_arch("80") == 80
    with pytest.raises(ValueError):
        ct.parse_arch("hopper")


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   I2F.S8 R8, R4 ;
        /*0040*/                   FFMA R9, R8, R6, R9 ;
        /*0050*/                   FFMA R10, R8, R7, R10 ;
        /*0060*/              @!P1 BRA `(.L_x_1) ;
.L_x_0:
        /*0070*/                   FADD R9, R9, R10 ;
.L_x_2:
        /*0080*/                   NOP ;
        /*0090*/                   BRA `(.L_x_2);
        /*00a0*/                   EXIT ;
"""


def test_sass_loop_counts_the_largest_loop():
    """The K loop of nvdisasm's listing: from the label a backward branch returns to
    through the branch (predicated instructions included, forward branches and the
    trailing self-loop not the largest), opcodes without modifiers; no loop: (0, {})."""
    n, ops = ct.sass_loop(SASS)
    assert n == 5 and ops == {"FFMA": 2, "LDG": 1, "I2F": 1, "BRA": 1}
    assert list(ops)[0] == "FFMA"
    assert ct.sass_loop("        /*0000*/                   EXIT ;\n") == (0, {})


def test_without_triton_clear_message():
    # Hide triton even where it is installed: sys.modules[name] = None makes both
    # find_spec and import fail, as in a venv without it.
    code = ("import runpy, sys; sys.modules['triton'] = None; "
            f"sys.argv = [{str(TOOL)!r}, '--demo']; "
            "runpy.run_module('tools.compile_triton', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "pip install triton" in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err


@pytest.mark.skipif(not HAVE_TRITON, reason="pip's triton is not installed in this venv (it is kept "
                    "out of the project venv; run this file with a venv that has it)")
def test_compile_sm80(lowered):
    [call] = ct.extract_triton_calls(lowered)
    res = ct.compile_ttir(call, "sm_80")
    assert res.stats.registers and res.stats.registers > 0
    assert res.stats.spill_stores == 0 and res.stats.stack_frame == 0
    assert len(res.cubin) > 0 and ".visible .entry" in res.ptx
