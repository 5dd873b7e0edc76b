"""The distributed path from the command line: serve.py's model, load and parallel flags
(vLLM's names), the deployment errors they give, and big configs on simulated devices."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "serve.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_config_without_weights_says_how_to_get_them():
    proc = _serve("--config", "configs/llama70b.py", "--port", "1")
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    assert "Config 'llama70b' has no weights: give --model PATH" in err[-1]
    assert "--load-format dummy" in err[-1]


def test_bad_deployment_flags_are_one_line_errors(tmp_path):
    proc = _serve("--config", "configs/llama70b.py", "--tensor-parallel-size", "0")
    assert proc.returncode == 2 and "ParallelConfig.tensor_parallel_size must be > 0" in proc.stderr
    proc = _serve("--config", "configs/llama70b.py", "--num-layers", "81")
    assert proc.returncode == 2 and "Config.num_layers=81 exceeds the model's 80 layers" in proc.stderr
    proc = _serve("--config", "configs/llama70b.py", "--model", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "no such model directory or .gguf file" in proc.stderr
    assert "Traceback" not in proc.stderr
