"""tools/gpu_checks.sh, the GPU session's one command, run here with a stand-in Python that
only records its arguments: every stage's command line must be one that its tool accepts.
A GPU is lent for minutes at a time (15 in all, the machine's start included); a flag renamed
since the script was last run there would cost a stage of it. Each recorded `jaxserve bench
generate` and `tools.bench_quantized_matmul` command is parsed and checked by the tool's own
main() up to the point where it would build an engine or time a kernel; the pytest stage's
files and marker must exist; the inline Python must compile and name what exists."""

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.bench import generate as bg

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_checks.sh"
STAGES = "env kernels fuse branches generate decode1 fused decode64 quant cmdbuf qmm sweep hf"


class _Reached(Exception):
    """Raised in place of the first engine build or kernel timing: the flags were accepted."""


def _run_script(tmp_path: Path, env_extra: dict, *stages: str) -> tuple[str, list[list[str]]]:
    """Runs the script with PYTHON a recorder (argv as one JSON line a call) and a stand-in
    nvidia-smi; returns its stdout and the recorded calls' arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.jsonl"
    recorder = bin_dir / "python"
    recorder.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'name, memory.total [MiB]'\n")
    for f in (recorder, smi):
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHON": str(recorder), "OUT": str(tmp_path / "out"), **env_extra}
    out = subprocess.run(["bash", str(SCRIPT), *stages], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    recorded = ([json.loads(line) for line in calls.read_text().splitlines()]
                if calls.exists() else [])
    return out.stdout, recorded


def _check_bench_generate(argv: list[str], monkeypatch, capsys) -> None:
    def reached(*args, **kwargs):
        raise _Reached
    monkeypatch.setattr(bg, "build_llm", reached)
    with pytest.raises(_Reached):  # main() returns 2 on a flag it refuses, before this
        bg.main(argv)
    assert "error" not in capsys.readouterr().err


def _check_bench_quantized_matmul(argv: list[str], monkeypatch) -> None:
    from tools import bench_quantized_matmul as bqm

    def reached(*args, **kwargs):
        raise _Reached
    monkeypatch.setattr(bqm, "bench", reached)
    with pytest.raises(_Reached):  # argparse exits 2 on a bad flag or value
        bqm.main(argv)


def _check_pytest(argv: list[str]) -> None:
    markers = (ROOT / "pyproject.toml").read_text()
    assert argv[argv.index("-m", 1) + 1] == "gpu" and '"gpu: ' in markers
    files = [a for a in argv if a.startswith("tests/")]
    assert files == sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/test_kernel_*.py"))
    assert any("paged_attention" in f for f in files) and any("mosaic" in f for f in files)


def test_every_stage_runs_a_command_its_tool_accepts(tmp_path, monkeypatch, capsys):
    stdout, calls = _run_script(tmp_path, {
        "BANDWIDTH_GB_S": "4300", "QUANT_IMPLS": "xla,pallas,pallas_gemv,pallas_mosaic"})
    for stage in STAGES.split():
        assert f"=== {stage} (t=" in stdout
    assert "unknown stage" not in stdout and "skipped" not in stdout
    kinds = []
    for argv in calls:
        if argv[:4] == ["-m", "jaxserve.cli.main", "bench", "generate"]:
            kinds.append("generate")
            assert "--bandwidth-gb-s" in argv and "4300" in argv
            _check_bench_generate(argv[4:], monkeypatch, capsys)
        elif argv[:2] == ["-m", "tools.bench_quantized_matmul"]:
            kinds.append("qmm")
            _check_bench_quantized_matmul(argv[2:], monkeypatch)
        elif argv[:2] == ["-m", "pytest"]:
            kinds.append("pytest")
            _check_pytest(argv)
        elif argv[0] == "-c":
            kinds.append("inline")
            compile(argv[1], "<gpu_checks.sh>", "exec")
        else:
            pytest.fail(f"an unexpected command: python {shlex.join(argv)}")
    # env and hf inline; kernels pytest; fuse, branches, generate, decode1, fused,
    # decode64, quant and cmdbuf bench generate; qmm and sweep the matmul bench
    assert sorted(kinds) == sorted(["inline"] * 2 + ["pytest"] + ["generate"] * 8 + ["qmm"] * 2)
    quant = next(a for a in calls if "--weight-quant" in a)
    assert quant[quant.index("--matmul-impl") + 1] == "xla,pallas,pallas_gemv,pallas_mosaic"


def test_the_hf_stage_reads_the_config_it_compares_against(tmp_path, monkeypatch, capsys):
    _, calls = _run_script(tmp_path, {"HF_CASES": "1x128x256"}, "hf")
    (argv,) = calls
    seen = []
    monkeypatch.setattr(bg, "hf_tok_s", lambda model, case: seen.append((model, case)) or 1.0)
    exec(compile(argv[1], "<gpu_checks.sh hf>", "exec"), {})
    ((model, case),) = seen
    assert case == (1, 128, 256) and model.num_layers == 32  # llama3_8b's shape
    assert "HF eager bf16 tok/s 1.0" in capsys.readouterr().out


def test_a_deadline_too_close_skips_every_stage(tmp_path):
    stdout, calls = _run_script(tmp_path, {"DEADLINE_S": "10"})
    assert stdout.count("skipped: DEADLINE_S reached") == len(STAGES.split())
    assert calls == []
