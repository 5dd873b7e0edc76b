"""tools/bench_trees.py: one command run from two trees of the repository in turns, each in
a process of its own, and the JSON numbers it writes compared. The timing is a benchmark;
what is tested is that each run ran the code of its own tree, in the promised order, and
that the numbers are read and summarised as documented."""

import json
import math
import subprocess
import sys

import pytest

from tools.bench_trees import REPO, command_for, flatten, main, summarise


def test_flatten_keys_the_numbers_and_leaves_out_per_request_lists():
    doc = {"shapes": [{"shape": "decode:32x16", "rows": 32, "bf16x_ms": 35.5},
                      {"shape": "prefill:1x512", "rows": 512, "bf16x_ms": 150.0}],
           "output_throughput": 480.5, "ok": True, "itls": [0.1, 0.2], "name": "x",
           "nested": {"a": {"b": 3}}, "plain": [{"v": 1}, {"v": 2}]}
    assert flatten(doc) == {
        "shapes[decode:32x16].rows": 32.0, "shapes[decode:32x16].bf16x_ms": 35.5,
        "shapes[prefill:1x512].rows": 512.0, "shapes[prefill:1x512].bf16x_ms": 150.0,
        "output_throughput": 480.5, "nested.a.b": 3.0, "plain[0].v": 1.0, "plain[1].v": 2.0}


def test_summary_is_medians_their_ratio_and_the_per_round_range():
    runs = {"base": [{"t": 10.0, "u": 1.0}, {"t": 12.0, "u": 1.0}, {"t": 11.0}],
            "variant": [{"t": 9.0, "u": 2.0}, {"t": 12.0, "u": 2.0}, {"t": 8.8}]}
    (row,) = summarise(runs, None)  # "u" is missing from a run: left out
    assert row["key"] == "t" and row["base"] == 11.0 and row["variant"] == 9.0
    assert math.isclose(row["ratio"], 9.0 / 11.0)
    assert math.isclose(row["lo"], 0.8) and math.isclose(row["hi"], 1.0)
    assert summarise(runs, "^u$") == []
    assert [r["key"] for r in summarise(runs, "t")] == ["t"]


def test_command_words():
    assert command_for(["jaxserve", "bench", "step", "--json", "{json}"], "/o.json") == [
        sys.executable, "-m", "jaxserve", "bench", "step", "--json", "/o.json"]
    assert command_for(["python", "x.py", "--out={json}"], "/o.json") == [
        sys.executable, "x.py", "--out=/o.json"]
    with pytest.raises(ValueError, match=r"\{json\}"):
        command_for(["jaxserve", "bench", "step"], "/o.json")
    with pytest.raises(ValueError, match="no COMMAND"):
        command_for([], "/o.json")


# Writes which tree it ran in (1: the working tree, 2: a worktree of HEAD) and when.
PROBE = ("import json, os, sys, time, tools; "
         "json.dump({'tree': 1 if os.path.realpath(tools.__file__).startswith("
         f"{str(REPO)!r} + '/') else 2, 't': time.time_ns()}}, open(sys.argv[1], 'w'))")


def test_each_run_is_its_own_trees_code_and_the_order_alternates(tmp_path, capsys):
    """base HEAD (a worktree, removed afterwards) against the working tree: each run
    imported the tools package of its own tree (PYTHONPATH), the rounds alternate which
    runs first, and the ratio is of the two trees' numbers."""
    if not (REPO / ".git").exists():
        pytest.skip("the repository is not a git checkout here: no revisions to check out")
    worktrees = lambda: subprocess.run(["git", "-C", str(REPO), "worktree", "list"],  # noqa: E731
                                       capture_output=True, text=True).stdout
    before = worktrees()
    out = tmp_path / "rows.json"
    assert main(["--base", "HEAD", "--rounds", "3", "--json", str(out), "--",
                 "python", "-c", PROBE, "{json}"]) == 0
    got = json.loads(out.read_text())
    tree = {r["key"]: r for r in got["rows"]}["tree"]
    assert (tree["base"], tree["variant"], tree["ratio"]) == (2.0, 1.0, 0.5)
    order = [name for _, name in sorted(
        (run["t"], name) for name in ("base", "variant") for run in got["runs"][name])]
    assert order == ["base", "variant", "variant", "base", "base", "variant"]
    assert worktrees() == before
    assert "ratio = variant / base" in capsys.readouterr().out


def test_a_failing_run_or_a_bad_revision_exits_1(capsys):
    assert main(["--base", ".", "--rounds", "1", "--", "python", "-c",
                 "raise SystemExit(3)", "{json}"]) == 1
    assert "exited 3" in capsys.readouterr().err
    assert main(["--base", "no-such-revision", "--", "python", "-c", "pass", "{json}"]) == 2
    assert "git worktree add no-such-revision" in capsys.readouterr().err
