"""The package as a user installs it: a wheel built from this tree, installed (not editable)
into a fresh virtualenv, run from a directory outside the source tree. The `jaxserve`
command, the shipped configs (by name), the C++ kernels' sources and a batch on the real
model must all work from the wheel alone.

The fresh virtualenv gets the test environment's third-party packages through a `.pth`
line (no download; `.pth` files of that directory are not processed, so its editable
jaxserve stays out) and jaxserve from the wheel only, which the first test checks."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL_CONFIG = ROOT / "tests" / "configs" / "smollm2_two_shapes.py"  # 2 step shapes to warm up


def _source_files() -> list[str]:
    """The files a clean checkout of this tree holds (tracked, or new and not ignored)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (ROOT / f).exists()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of this tree (the tree itself gets no build/ directory)."""
    src = tmp_path_factory.mktemp("src")
    for f in _source_files():
        if f.startswith("tests/"):
            continue
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f, follow_symlinks=False)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(dist), str(src)], check=True, timeout=600)
    (built,) = dist.glob("jaxserve-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtualenv with the wheel installed; returns its bin/ directory."""
    env = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=300)
    bin_dir = env / "bin"
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=300)
    purelib = subprocess.run([str(bin_dir / "python"), "-c",
                              "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "_test_env_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return bin_dir


def run(bin_dir: Path, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_wheel_ships_what_runs_from_it(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for want in ("jaxserve/configs/smollm2_135m.py", "jaxserve/configs/llama70b.py",
                 "jaxserve/kernels/cpu/paged_attention.cc", "jaxserve/kernels/cpu/bf16.h",
                 "jaxserve/bench/data/bench_prompts.jsonl",
                 "jaxserve/spec_decode/heads/smollm2_135m/config.json"):
        assert want in names, want
    assert not any(n.startswith(("tools/", "tests/")) for n in names)
    entry = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry[0]).decode()
    assert "jaxserve = jaxserve.cli.main:main" in text


def test_jaxserve_imports_from_the_wheel_not_the_tree(venv, tmp_path):
    out = run(venv, "python", "-c", "import jaxserve; print(jaxserve.__file__)", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(venv.parent), out.stdout


def test_serve_help_and_plan_memory_by_config_name(venv, tmp_path):
    help_ = run(venv, "jaxserve", "serve", "--help", cwd=tmp_path)
    assert help_.returncode == 0, help_.stderr
    for flag in ("--config", "--max-num-seqs", "--tensor-parallel-size", "--api-key"):
        assert flag in help_.stdout
    plan = run(venv, "jaxserve", "plan-memory", "--config", "llama70b", cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    assert "llama70b: 80 layers" in plan.stdout and "weights / device" in plan.stdout
    bad = run(venv, "jaxserve", "plan-memory", "--config", "nope", cwd=tmp_path)
    assert bad.returncode == 2 and "neither a file nor a shipped config" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_batch_on_the_real_model_from_the_wheel(venv, tmp_path, smollm2_checkpoint, cache_dir):
    """`jaxserve batch` from the wheel: the default model, the C++ kernels built from the
    wheel's sources, two answers, nothing traced or compiled after warm-up."""
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": p, "max_tokens": 8, "temperature": 0}}
             for i, p in enumerate(["The capital of France is", "1, 2, 3,"])]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run(venv, "jaxserve", "batch", "-i", str(inp), "-o", str(out), "--config",
               str(SMALL_CONFIG), "--cache-dir", str(cache_dir), "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1])["jax_compile_events_after_warmup"] == 0
    results = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(results) == {"r0", "r1"}
    for r in results.values():
        body = r["response"]["body"]
        assert r["response"]["status_code"] == 200 and body["usage"]["completion_tokens"] == 8
        assert body["choices"][0]["text"]
