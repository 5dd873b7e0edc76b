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
