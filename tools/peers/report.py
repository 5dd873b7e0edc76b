"""The comparison's report: jaxserve/peer ratios, the table, the serving metrics of a run,
and the memory-bandwidth bound line (tools/membw.py)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from typing import Any, Sequence

from tools.peers.common import BASELINE, METRICS, ROOT, SAME_FORMAT_PEERS, SPEC_PEERS


def ratio(jax_value: float | None, peer_value: float | None, higher_is_better: bool) -> float | None:
    """jaxserve/peer for a throughput, peer/jaxserve for a latency (so > 1 means jaxserve
    is better); None when a value is missing or a divisor is 0."""
    if jax_value is None or peer_value is None:
        return None
    num, den = (jax_value, peer_value) if higher_is_better else (peer_value, jax_value)
    if not den or any(map(math.isnan, (num, den))):
        return None
    return num / den


def fmt_value(v: float | None) -> str:
    """A metric for the table: "-" if missing, 3 significant-ish digits otherwise."""
    if v is None:
        return "-"
    if v != v:
        return "nan"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def ratio_rows(results: dict[str, dict[str, Any]], metrics=METRICS,
               baseline: str = BASELINE) -> list[list[str]]:
    """The table as rows of strings: a header row, then one row per metric present for
    some peer: label, baseline's value, then each other peer's value and ratio."""
    peers = [p for p in results if p != baseline]
    header = ["metric", baseline]
    for p in peers:
        header += [p, f"x vs {p}"]
    rows = [header]
    base = results.get(baseline, {})
    for key, label, higher in metrics:
        if not any(results[p].get(key) is not None for p in results):
            continue
        row = [label, fmt_value(base.get(key))]
        for p in peers:
            r = ratio(base.get(key), results[p].get(key), higher)
            row += [fmt_value(results[p].get(key)), "-" if r is None else f"{r:.2f}x"]
        rows.append(row)
    return rows


def format_ratio_table(results: dict[str, dict[str, Any]], metrics=METRICS,
                       baseline: str = BASELINE) -> str:
    """`results` ({peer: {metric: value}}) as an aligned text table with a header line
    explaining the ratio columns ("x vs P": jaxserve/P for throughputs, P/jaxserve for
    latencies, > 1 means jaxserve is better)."""
    return format_rows(ratio_rows(results, metrics, baseline),
                       f"'x vs P' = {baseline}/P for tok/s, P/{baseline} for ms: > 1 means "
                       f"{baseline} is better", names=1)


def pair_rows(results: dict[str, dict[str, Any]], pairs: dict[str, str],
              keys: Sequence[tuple[str, str, bool]], first: str) -> list[list[str]]:
    """Each peer of `pairs` ({peer: the peer it is measured against}) that ran in
    `results` with its partner: rows [peer, partner, then for each (key, label,
    higher_is_better) of `keys`: the peer's value, the partner's and the ratio (> 1: the
    peer is better)] as strings, after a header row (`first` heads the peer column); []
    when no pair ran."""
    header = [first, "vs"]
    for _, label, _ in keys:
        header += [label, "vs", "ratio"]
    rows = [header]
    for peer, other in pairs.items():
        if peer not in results or other not in results:
            continue
        row = [peer, other]
        for key, _, higher in keys:
            a, b = results[peer].get(key), results[other].get(key)
            r = ratio(a, b, higher)
            row += [fmt_value(a), fmt_value(b), "-" if r is None else f"{r:.2f}x"]
        rows.append(row)
    return rows if len(rows) > 1 else []


SPEC_KEYS = (("single_decode_tok_s", "1 stream decode tok/s", True),
             ("concurrent_output_tok_s", "N streams output tok/s", True))
SAME_FORMAT_KEYS = SPEC_KEYS + (("peak_rss_mib", "peak RSS MiB", False),)


def speculation_rows(results: dict[str, dict[str, Any]],
                     spec_peers: dict[str, str] = SPEC_PEERS) -> list[list[str]]:
    """Each speculative peer of `results` against its plain sibling measured in the same
    run (SPEC_PEERS): rows [peer, plain peer, single-stream decode tok/s of each and the
    ratio speculative/plain, then the same for the N-stream output tok/s] as strings, after
    a header row; [] when no speculative peer has its sibling."""
    return pair_rows(results, spec_peers, SPEC_KEYS, "speculative peer")


def same_format_rows(results: dict[str, dict[str, Any]],
                     pairs: dict[str, str] = SAME_FORMAT_PEERS) -> list[list[str]]:
    """Each jaxserve peer of `results` against the llama.cpp peer serving the same weight
    format in the same run (SAME_FORMAT_PEERS): single-stream decode tok/s, N-stream
    output tok/s and peak RSS of each, and the ratio (> 1: jaxserve is better; RSS is
    llama.cpp's / jaxserve's); [] when no pair ran."""
    return pair_rows(results, pairs, SAME_FORMAT_KEYS, "jaxserve peer")


def format_rows(rows: list[list[str]], title: str, names: int = 2) -> str:
    """`rows` (a header row, then rows whose first `names` columns are names, left-aligned;
    the others right-aligned) as an aligned text table under `title`; "" when there are
    no rows."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [title]
    for n, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i < names else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_speculation(results: dict[str, dict[str, Any]]) -> str:
    """speculation_rows as an aligned text table ("" when there is none)."""
    return format_rows(speculation_rows(results),
                       "speculative decoding: each speculative peer against its plain sibling in "
                       "this run (speedup > 1: speculation helps)")


def format_same_format(results: dict[str, dict[str, Any]]) -> str:
    """same_format_rows as an aligned text table ("" when there is none)."""
    return format_rows(same_format_rows(results),
                       "same weight format: each jaxserve peer against llama.cpp serving that "
                       "format in this run (ratio > 1: jaxserve is better)")


def median_metrics(rounds: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    """Each metric's median over `rounds` (one {metric: value} per round of a peer), of
    the rounds that have a value; None where none has."""
    keys = dict.fromkeys(k for r in rounds for k in r)
    out = {}
    for k in keys:
        values = [r[k] for r in rounds if r.get(k) is not None]
        out[k] = statistics.median(values) if values else None
    return out


def round_ratio_rows(rounds: Sequence[dict[str, dict[str, Any]]], metrics=METRICS,
                     baseline: str = BASELINE) -> list[list[str]]:
    """Per round, the ratio of the baseline to each peer measured in that same round
    (`rounds`: one {peer: {metric: value}} per round), for each metric of `metrics`: a
    header row, then one row per (peer, metric) with each round's ratio and their median.
    [] without the baseline or another peer. The VM's speed moves between rounds, so the
    ratio within a round is the comparison; the median of those is the summary."""
    peers = [p for p in dict.fromkeys(p for r in rounds for p in r) if p != baseline]
    if not peers or not any(baseline in r for r in rounds):
        return []
    rows = [["peer", "metric"] + [f"round {i + 1}" for i in range(len(rounds))] + ["median"]]
    for p in peers:
        for key, label, higher in metrics:
            rs = [ratio(r.get(baseline, {}).get(key), r.get(p, {}).get(key), higher)
                  for r in rounds]
            if all(x is None for x in rs):
                continue
            known = [x for x in rs if x is not None]
            rows.append([p, label] + ["-" if x is None else f"{x:.2f}x" for x in rs]
                        + [f"{statistics.median(known):.2f}x"])
    return rows


def format_round_ratios(rounds: Sequence[dict[str, dict[str, Any]]], metrics=METRICS,
                        baseline: str = BASELINE) -> str:
    """round_ratio_rows as an aligned text table ("" when there are none)."""
    return format_rows(round_ratio_rows(rounds, metrics, baseline),
                       f"each round's ratio ({baseline}/P for tok/s, P/{baseline} for ms; the "
                       "peers alternate their order from round to round)")


def summarise_serving(single: dict | None, concurrent: dict | None, ttft_512_ms: float | None,
                      peak_rss_bytes: int | None = None) -> dict[str, float | None]:
    """The table's metrics of a server peer from run_benchmark() results of the single
    stream and concurrent runs (dicts with output_throughput, mean_tpot_ms, median_ttft_ms,
    ...), the median 512-token TTFT in ms and the server's peak RSS in bytes."""
    single, concurrent = single or {}, concurrent or {}
    tpot = single.get("mean_tpot_ms")
    return {
        "single_decode_tok_s": 1000.0 / tpot if tpot else None,
        "single_output_tok_s": single.get("output_throughput"),
        "single_ttft_ms": single.get("median_ttft_ms"),
        "ttft_512_ms": ttft_512_ms,
        "concurrent_output_tok_s": concurrent.get("output_throughput"),
        "concurrent_mean_tpot_ms": concurrent.get("mean_tpot_ms"),
        "concurrent_median_ttft_ms": concurrent.get("median_ttft_ms"),
        "peak_rss_mib": None if peak_rss_bytes is None else peak_rss_bytes / 2**20,
    }


def measure_bandwidth_bound(config: str, samples: int = 5, interval_s: float = 1.0) -> dict | None:
    """tools/membw.py's bound for `config` (read bandwidth: the median of `samples` samples
    `interval_s` apart; weight bytes per token; bound tok/s), run in a subprocess while no
    peer runs; None (with a message) if it fails."""
    proc = subprocess.run([sys.executable, "-m", "tools.membw", "--config", config,
                           "--samples", str(samples), "--interval", str(interval_s)],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        print(f"[bandwidth] membw.py failed: {proc.stderr.strip()[-500:]}", file=sys.stderr)
        return None
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"[bandwidth] read {res['read_gb_s']} GB/s (samples {res['samples_gb_s']}), "
          f"{res['bytes_per_token'] / 1e6:.0f} MB of weights per token: bound "
          f"{res['bound_tok_s']} tok/s", flush=True)
    return res


def combine_bandwidth(*measured: dict | None) -> dict | None:
    """One bound from several `measure_bandwidth_bound` results (before and after
    jaxserve's run): the median of all their samples. None if none was measured."""
    from tools.membw import bound_from_samples

    got = [m for m in measured if m is not None]
    if not got:
        return None
    return bound_from_samples([x for m in got for x in m["samples_gb_s"]], got[0]["weight_bytes"])


def describe_bandwidth(bw: dict | None, decode_tok_s: float | None) -> str:
    """The single-stream line under the table: jaxserve's decode rate against the bound."""
    if bw is None:
        return "memory-bandwidth bound: not measured"
    samples = bw.get("samples_gb_s", [bw["read_gb_s"]])
    spread = (f" (median of {len(samples)} samples, {min(samples)}-{max(samples)})"
              if len(samples) > 1 else "")
    line = (f"memory-bandwidth bound (tools/membw.py): {bw['read_gb_s']} GB/s read{spread} / "
            f"{bw['bytes_per_token'] / 1e6:.0f} MB of weights per token = {bw['bound_tok_s']} tok/s")
    if decode_tok_s:
        line += f"; jaxserve single-stream decode {decode_tok_s:.1f} tok/s = " \
                f"{100 * decode_tok_s / bw['bound_tok_s']:.0f}% of it"
    return line
