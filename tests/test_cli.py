"""The `jaxserve` command's dispatch (jaxserve.cli.main): each command reaches its module's
parser under its own name, and a wrong command is a usage error (status 2), not a
traceback. In process: --help exits before anything heavy is imported."""

import pytest

from jaxserve.cli.main import BENCHMARKS, COMMANDS, main


def test_no_command_prints_the_commands_and_fails(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    assert "plan-memory" in capsys.readouterr().out


def test_an_unknown_command_is_a_usage_error(capsys):
    assert main(["srve"]) == 2
    assert "unknown command 'srve'" in capsys.readouterr().err


def test_bench_needs_a_benchmark(capsys):
    assert main(["bench"]) == 2
    assert main(["bench", "nope"]) == 2
    assert "serve,step,batch" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve"], ["batch"], ["convert"], ["plan-memory"]]
                         + [["bench", b] for b in BENCHMARKS])
def test_each_command_has_its_own_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    assert f"usage: jaxserve {' '.join(argv)}" in capsys.readouterr().out


_ARENAS = """
import sys, threading
from jaxserve.cli.serve import limit_malloc_arenas
n = int(sys.argv[1])
applied = limit_malloc_arenas(n)
def work():
    keep = [bytearray(2000 + i) for i in range(2000)]  # malloc (past pymalloc's 512 bytes)
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
import ctypes
ctypes.CDLL(None).malloc_stats()  # one "Arena i:" block per arena, on stderr
print(applied)
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_malloc_arena_max_caps_the_arenas_threads_make():
    """`jaxserve serve --malloc-arena-max N` (default 2): 8 threads allocating at once get
    one arena with N = 1, several with 0 (glibc's default); a negative N is refused."""
    import subprocess
    import sys
    counts = {}
    for n in (1, 0):
        proc = subprocess.run([sys.executable, "-c", _ARENAS, str(n)], capture_output=True,
                              text=True, check=True)
        assert proc.stdout.strip() == str(n > 0)
        counts[n] = proc.stderr.count("Arena ")
    assert counts[1] == 1 and counts[0] > 1, counts
    from jaxserve.cli.serve import parser
    assert parser().parse_args([]).malloc_arena_max == 2
    with pytest.raises(SystemExit):
        parser().parse_args(["--malloc-arena-max", "-1"])
