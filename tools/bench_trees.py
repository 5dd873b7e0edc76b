"""One benchmark command run from two trees of this repository, in turns, each run in a
process of its own: for a change that no in-process comparison covers (a kernel's source,
the scheduler), or effects of a few percent, which one run on a VM does not show (two
trees alike: per-round ratios 0.77-1.06 on a slow VM; PERFORMANCE.md, "Session 50").

    python -m tools.bench_trees --base REV [--variant REV] [--rounds 3] [--keys REGEX]
        -- COMMAND ... {json} ...

    # the bf16 config's steps, the last commit against the working tree
    python -m tools.bench_trees --base HEAD --rounds 3 --keys 'bf16x_ms' -- \\
        jaxserve bench step --config smollm2_135m_bf16 --compare round_x \\
        --shapes decode:32x16,mixed:31x16x225,prefill:1x512 --json {json}
    # a served workload: output tok/s of 32 concurrent streams
    python -m tools.bench_trees --base main~1 --variant main --keys output_throughput -- \\
        jaxserve bench serve --launch --num-prompts 64 --max-concurrency 32 \\
        --output-len 128 --no-progress --result-json {json}
    # the check of the check: a tree against itself (ratios should straddle 1.00)
    python -m tools.bench_trees --base HEAD --variant HEAD -- ...

--base / --variant: a git revision, checked out in a temporary worktree (removed at the
end), or the working tree as it is, uncommitted changes included (`--variant` default:
"."). COMMAND runs with the tree as its working directory and first on PYTHONPATH (the tool
checks that `import jaxserve` resolves inside the tree), under this Python: a leading
`jaxserve` becomes `python -m jaxserve`, a leading `python` this interpreter. `{json}` is
replaced by a fresh file's path, which the command must write as JSON. Round i runs base
then variant for even i, variant then base for odd i, so that neither always runs first
on a machine that warms or cools over a run. The compiled C++ kernels and the XLA
compilation cache are shared (both keyed by what goes into them), so each tree builds its
own kernels once.

Printed per number in the JSON (its scalar leaves; a list of objects that have a "shape"
or "name" is keyed by it; lists of numbers, e.g. per-request latencies, are left out;
--keys keeps the keys that match a regular expression): the median of the base's runs,
of the variant's, the variant / base ratio of the medians, and the range of the
per-round ratios (each round's two runs are adjacent in time). A benchmark, not a test:
run it alone on an idle machine. Exit status 1 when a run fails (its output is printed), 2
when a revision cannot be checked out or its tree does not import its own jaxserve.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def flatten(value, prefix: str = "") -> dict[str, float]:
    """The numeric scalar leaves of a JSON value as {dotted key: float}. Objects' keys are
    joined with "."; a list of objects is keyed by each one's "shape" or "name" where it
    has one (else its index); lists of numbers are left out (per-request lists); booleans
    are not numbers here."""
    out: dict[str, float] = {}
    join = lambda k: f"{prefix}.{k}" if prefix else str(k)  # noqa: E731
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flatten(v, join(k)))
    elif isinstance(value, list):
        if all(isinstance(v, dict) for v in value):
            for i, v in enumerate(value):
                label = v.get("shape", v.get("name", i))
                out.update(flatten({k: x for k, x in v.items() if k not in ("shape", "name")},
                                   f"{prefix}[{label}]"))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[prefix] = float(value)
    return out


def command_for(words: list[str], json_path: Path) -> list[str]:
    """COMMAND as run: `{json}` replaced, a leading `jaxserve` or `python` under this
    interpreter. Raises ValueError without a command or without `{json}` in it."""
    if not words:
        raise ValueError("no COMMAND after --")
    if not any("{json}" in w for w in words):
        raise ValueError("COMMAND must write its results to {json} (e.g. --json {json})")
    words = [w.replace("{json}", str(json_path)) for w in words]
    if words[0] == "jaxserve":
        return [sys.executable, "-m", "jaxserve", *words[1:]]
    if words[0] in ("python", "python3"):
        return [sys.executable, *words[1:]]
    return words


def tree_env(tree: Path) -> dict[str, str]:
    """The environment a tree's runs get: the tree first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    return env


def check_imports_from(tree: Path) -> None:
    """Raises RuntimeError unless `import jaxserve` in a process run as the tree's are
    resolves inside `tree` (an editable install elsewhere would run the wrong code)."""
    got = subprocess.run([sys.executable, "-c", "import jaxserve; print(jaxserve.__file__)"],
                         cwd=tree, env=tree_env(tree), capture_output=True, text=True)
    path = Path(got.stdout.strip() or "?").resolve()
    if got.returncode != 0 or not path.is_relative_to(tree.resolve()):
        raise RuntimeError(f"in {tree}, `import jaxserve` gives {path} "
                           f"(rc {got.returncode}): {got.stderr[-500:]}")


def add_worktree(rev: str, where: Path) -> Path:
    """A detached worktree of `rev` at `where`; "." is the working tree itself. Raises
    RuntimeError for a revision git does not know."""
    if rev == ".":
        return REPO
    got = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where),
                          rev], capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"git worktree add {rev}: {got.stderr.strip()}")
    return where


def remove_worktree(tree: Path) -> None:
    """Remove a worktree add_worktree made (the working tree itself stays)."""
    if tree != REPO:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                       capture_output=True)


def summarise(runs: dict[str, list[dict[str, float]]], keys: str | None) -> list[dict]:
    """Rows {key, base, variant, ratio, lo, hi} for every key both trees reported in every
    round (matching `keys`, a regular expression searched for, if given): medians over
    the rounds, their ratio variant / base, and the smallest and largest ratio of one
    round's pair."""
    base, var = runs["base"], runs["variant"]
    common = set.intersection(*(set(r) for r in base + var)) if base and var else set()
    pattern = re.compile(keys) if keys else None
    rows = []
    for key in sorted(common):
        if pattern is not None and not pattern.search(key):
            continue
        b = [r[key] for r in base]
        v = [r[key] for r in var]
        pairs = [y / x for x, y in zip(b, v) if x]
        mb = statistics.median(b)
        rows.append({"key": key, "base": mb, "variant": statistics.median(v),
                     "ratio": statistics.median(v) / mb if mb else float("nan"),
                     "lo": min(pairs, default=float("nan")),
                     "hi": max(pairs, default=float("nan"))})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (the module docstring); returns the exit status: 0, 1 when
    a run fails or no number is common to every run, 2 for a revision that cannot be
    checked out or a tree that imports another jaxserve (argparse's 2 for bad flags)."""
    argv = sys.argv[1:] if argv is None else argv
    words = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m tools.bench_trees",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="a git revision, or . for the working tree")
    ap.add_argument("--variant", default=".", help="a git revision, or . (default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--keys", help="report only the keys matching this regular expression")
    ap.add_argument("--json", help="write the rows and every run's numbers here")
    args = ap.parse_args(own)
    if args.rounds < 1:
        ap.error(f"--rounds: at least 1, got {args.rounds}")
    try:
        command_for(words, Path("x"))
    except ValueError as e:
        ap.error(str(e))
    tmp = Path(tempfile.mkdtemp(prefix="bench_trees_"))
    trees: dict[str, Path] = {}
    try:
        try:
            for name in ("base", "variant"):
                trees[name] = add_worktree(getattr(args, name), tmp / name)
                check_imports_from(trees[name])
        except RuntimeError as e:
            print(f"--{name}: {e}", file=sys.stderr)
            return 2
        runs: dict[str, list[dict[str, float]]] = {"base": [], "variant": []}
        for i in range(args.rounds):
            for name in (("base", "variant") if i % 2 == 0 else ("variant", "base")):
                out = tmp / f"{name}-{i}.json"
                cmd = command_for(words, out)
                print(f"round {i + 1}/{args.rounds}: {name} ({getattr(args, name)})", flush=True)
                got = subprocess.run(cmd, cwd=trees[name], env=tree_env(trees[name]),
                                     capture_output=True, text=True)
                if got.returncode != 0 or not out.exists():
                    print(got.stdout[-3000:], got.stderr[-3000:], sep="\n", file=sys.stderr)
                    print(f"{name}: {' '.join(cmd)} exited {got.returncode}"
                          + ("" if out.exists() else f", wrote no {out.name}"), file=sys.stderr)
                    return 1
                runs[name].append(flatten(json.loads(out.read_text())))
        rows = summarise(runs, args.keys)
        if not rows:
            print("no numeric key common to every run" + (f" matches {args.keys!r}"
                                                          if args.keys else ""), file=sys.stderr)
            return 1
        width = max(len(r["key"]) for r in rows)
        print(f"{'key':<{width}} {'base':>12} {'variant':>12} {'ratio':>7} {'per round':>13}")
        for r in rows:
            print(f"{r['key']:<{width}} {r['base']:12.4g} {r['variant']:12.4g} "
                  f"{r['ratio']:7.3f} {r['lo']:6.3f}-{r['hi']:.3f}")
        print(f"base {args.base}, variant {args.variant}; {args.rounds} rounds, medians; "
              "ratio = variant / base")
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
        return 0
    finally:
        for tree in trees.values():
            remove_worktree(tree)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
