"""Unit tests of tools/bench_peers.py's pure parts (command lines, ratio table, parsing).
Nothing is built, downloaded or started here."""

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from tools import bench_peers
from tools.peers import common, llamacpp, report

bp = bench_peers


def test_import_is_light():
    """The tool imports no heavy package at module level (the tests and --help stay fast)."""
    for path in [ROOT / "tools" / "bench_peers.py", *(ROOT / "tools" / "peers").glob("*.py")]:
        top = [l for l in path.read_text().splitlines() if l.startswith(("import ", "from "))]
        heavy = [l for l in top if any(m in l for m in ("torch", "transformers", "jax", "httpx", "gguf"))]
        assert not heavy, (path.name, heavy)


def test_llama_server_cmd():
    cmd = llamacpp.llama_server_cmd("/c/bin/llama-server", "/c/m.gguf", 8123, slots=32, ctx_per_slot=2048,
                              threads=2)
    assert cmd[0] == "/c/bin/llama-server"

    def val(flag):
        return cmd[cmd.index(flag) + 1]

    assert val("-m") == "/c/m.gguf"
    assert val("--host") == "127.0.0.1" and val("--port") == "8123"
    assert val("-t") == "2" and val("-tb") == "2"
    assert val("-np") == "32"
    assert val("-c") == str(32 * 2048)  # total context = slots x per-slot context
    assert val("-fa") == "on"
    assert val("--alias") == common.SERVED_MODEL
    assert "--no-webui" in cmd and "-cb" in cmd


def test_llama_server_flags_follow_help_text():
    new = "-fa,    --flash-attn [on|off|auto]   set Flash Attention use\n--ui, --webui, --no-ui, --no-webui"
    old = "-fa,    --flash-attn             enable Flash Attention (default: disabled)"
    assert llamacpp.llama_server_flags(new) == {"flash_attn": ["-fa", "on"], "no_webui": ["--no-webui"]}
    assert llamacpp.llama_server_flags(old) == {"flash_attn": ["-fa"], "no_webui": []}
    cmd = llamacpp.llama_server_cmd("s", "m", 1, 4, 512, 2, llamacpp.llama_server_flags(old))
    assert cmd[-1] == "-fa"  # old bare flag, no value
    assert "on" not in cmd and "--no-webui" not in cmd


def test_cmake_commands():
    cfg = llamacpp.cmake_configure_cmd(Path("/s"), Path("/b"), "0c1e57098")
    assert cfg[:5] == ["cmake", "-S", "/s", "-B", "/b"]
    for flag in ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_COMMIT=0c1e57098"):
        assert flag in cfg
    assert not any(a.startswith("-DLLAMA_BUILD_COMMIT") for a in llamacpp.cmake_configure_cmd(Path("/s"), Path("/b"), None))
    build = llamacpp.cmake_build_cmd(Path("/b"), ("llama-server", "llama-quantize"), jobs=2)
    assert build[:3] == ["cmake", "--build", "/b"]
    assert build[build.index("-j") + 1] == "2"
    assert build[build.index("--target") + 1:] == ["llama-server", "llama-quantize"]


def test_jaxserve_cmd():
    cmd = bp.jaxserve_cmd("/v/python", "configs/x.py", 9000)
    assert cmd[0] == "/v/python" and cmd[1].endswith("serve.py")
    assert cmd[cmd.index("--config") + 1] == "configs/x.py"
    assert cmd[cmd.index("--port") + 1] == "9000"
    assert "--cache-dir" not in cmd
    assert bp.jaxserve_cmd("p", "c", 1, "/cache")[-2:] == ["--cache-dir", "/cache"]
    assert "--quantization" not in cmd and "--model" not in cmd
    gguf = bp.jaxserve_cmd("p", "c", 1, gguf=Path("/m/x.Q8_0.gguf"))
    assert gguf[gguf.index("--model") + 1] == "/m/x.Q8_0.gguf"
    assert gguf[gguf.index("--quantization") + 1] == "gguf"
    more = bp.jaxserve_cmd("p", "c", 1, extra_args="--kv-cache-memory-bytes 1024 --max-num-seqs 8")
    assert more[-4:] == ["--kv-cache-memory-bytes", "1024", "--max-num-seqs", "8"]


def test_commit_from_changelog():
    text = ("# Changelog\n\n## [Unreleased]\n\n## [0.3.36]\n\n- feat: update llama.cpp to "
            "ggml-org/llama.cpp@0c1e57098\n\n## [0.3.35]\n\n- feat: update llama.cpp to "
            "ggml-org/llama.cpp@4df29be4f\n")
    assert llamacpp.llama_cpp_commit_from_changelog(text, "0.3.36") == "0c1e57098"
    assert llamacpp.llama_cpp_commit_from_changelog(text, "0.3.35") == "4df29be4f"
    assert llamacpp.llama_cpp_commit_from_changelog(text, "0.3.1") is None
    assert llamacpp.llama_cpp_commit_from_changelog("## [0.3.2]\n\n- fix: x\n\n## [0.3.1]\n- llama.cpp@abcdef0\n",
                                              "0.3.2") is None


def test_ratio_direction():
    assert report.ratio(200.0, 100.0, higher_is_better=True) == 2.0   # tok/s: jaxserve/peer
    assert report.ratio(50.0, 100.0, higher_is_better=False) == 2.0   # ms: peer/jaxserve
    assert report.ratio(None, 1.0, True) is None and report.ratio(1.0, None, False) is None
    assert report.ratio(1.0, 0.0, True) is None
    assert report.ratio(float("nan"), 1.0, True) is None


def test_ratio_table():
    results = {
        "jaxserve": {"single_decode_tok_s": 100.0, "ttft_512_ms": 50.0, "concurrent_output_tok_s": 900.0},
        "llamacpp-bf16": {"single_decode_tok_s": 200.0, "ttft_512_ms": 100.0, "concurrent_output_tok_s": None},
        "hf-bf16": {"single_decode_tok_s": 25.0, "ttft_512_ms": 25.0, "concurrent_output_tok_s": 300.0},
    }
    rows = report.ratio_rows(results)
    assert rows[0] == ["metric", "jaxserve", "llamacpp-bf16", "x vs llamacpp-bf16", "hf-bf16", "x vs hf-bf16"]
    by_label = {r[0]: r[1:] for r in rows[1:]}
    # only metrics that some peer has, in METRICS order
    assert [r[0] for r in rows[1:]] == [label for key, label, _ in common.METRICS
                                        if key in ("single_decode_tok_s", "ttft_512_ms", "concurrent_output_tok_s")]
    label = dict((k, l) for k, l, _ in common.METRICS)
    assert by_label[label["single_decode_tok_s"]] == ["100", "200", "0.50x", "25.0", "4.00x"]
    assert by_label[label["ttft_512_ms"]] == ["50.0", "100", "2.00x", "25.0", "0.50x"]
    assert by_label[label["concurrent_output_tok_s"]] == ["900", "-", "-", "300", "3.00x"]
    text = report.format_ratio_table(results)
    lines = text.splitlines()
    assert "> 1 means jaxserve is better" in lines[0]
    assert lines[1].split()[:2] == ["metric", "jaxserve"]
    assert set(lines[2].replace(" ", "")) == {"-"}
    assert len(lines) == 3 + 3
    assert "4.00x" in text and "0.50x" in text


def test_rounds_give_medians_and_each_rounds_own_ratio():
    """--rounds: a peer's metrics are medians over its rounds (of the rounds with a value);
    the per-round table pairs the baseline and a peer of the same round, so a round where
    the VM ran slower for both keeps its ratio, and its median is over those ratios."""
    rounds = [
        {"jaxserve": {"concurrent_output_tok_s": 400.0, "ttft_512_ms": 40.0},
         "llamacpp-bf16": {"concurrent_output_tok_s": 200.0, "ttft_512_ms": 80.0}},
        {"llamacpp-bf16": {"concurrent_output_tok_s": 150.0, "ttft_512_ms": None},
         "jaxserve": {"concurrent_output_tok_s": 330.0, "ttft_512_ms": 50.0}},
        {"jaxserve": {"concurrent_output_tok_s": 420.0, "ttft_512_ms": 45.0},
         "llamacpp-bf16": {"concurrent_output_tok_s": 240.0, "ttft_512_ms": 45.0}},
    ]
    med = report.median_metrics([r["llamacpp-bf16"] for r in rounds])
    assert med == {"concurrent_output_tok_s": 200.0, "ttft_512_ms": 62.5}
    assert report.median_metrics([{"a": None}, {"a": None}]) == {"a": None}
    metrics = [m for m in common.METRICS if m[0] in ("ttft_512_ms", "concurrent_output_tok_s")]
    rows = report.round_ratio_rows(rounds, metrics)
    assert rows[0] == ["peer", "metric", "round 1", "round 2", "round 3", "median"]
    label = dict((k, l) for k, l, _ in common.METRICS)
    by_metric = {r[1]: r[2:] for r in rows[1:]}
    # 400/200, 330/150, 420/240; ms: peer/jaxserve, a round without a value shows "-"
    assert by_metric[label["concurrent_output_tok_s"]] == ["2.00x", "2.20x", "1.75x", "2.00x"]
    assert by_metric[label["ttft_512_ms"]] == ["2.00x", "-", "1.00x", "1.50x"]
    assert [r[0] for r in rows[1:]] == ["llamacpp-bf16"] * 2
    assert report.round_ratio_rows([{"hf-bf16": {"ttft_512_ms": 1.0}}], metrics) == []
    assert "each round's ratio" in report.format_round_ratios(rounds, metrics).splitlines()[0]


def test_ratio_table_without_baseline():
    text = report.format_ratio_table({"hf-bf16": {"ttft_512_ms": 10.0}})
    assert text.splitlines()[-1].split()[-2:] == ["10.0", "-"]


def test_summarise_serving():
    single = {"mean_tpot_ms": 20.0, "output_throughput": 45.0, "median_ttft_ms": 30.0}
    conc = {"output_throughput": 500.0, "mean_tpot_ms": 60.0, "median_ttft_ms": 300.0}
    m = report.summarise_serving(single, conc, 80.0)
    assert m["single_decode_tok_s"] == 50.0
    assert m["single_output_tok_s"] == 45.0 and m["ttft_512_ms"] == 80.0
    assert m["concurrent_output_tok_s"] == 500.0 and m["concurrent_mean_tpot_ms"] == 60.0
    assert set(m) == {k for k, _, _ in common.METRICS} and m["peak_rss_mib"] is None
    assert report.summarise_serving(single, conc, 80.0, 3 * 2**20)["peak_rss_mib"] == 3.0
    assert report.summarise_serving({"mean_tpot_ms": 0.0}, None, None)["single_decode_tok_s"] is None


def test_parse_peers():
    assert bp.parse_peers("hf-bf16,jaxserve") == ["jaxserve", "hf-bf16"]
    assert bp.parse_peers(" llamacpp-q4_1 , ") == ["llamacpp-q4_1"]
    with pytest.raises(ValueError, match="vllm"):
        bp.parse_peers("jaxserve,vllm")
    args = bp.parse_args(["--peers", "jaxserve,llamacpp-bf16", "--concurrency", "4", "--output-len", "32"])
    assert args.peers == ["jaxserve", "llamacpp-bf16"] and args.concurrency == 4 and args.output_len == 32
    with pytest.raises(SystemExit):
        bp.parse_args(["--peers", "nope"])


def test_ttft_prompt_variants():
    ids = list(range(100, 700))
    v = bp.ttft_prompt_variants(ids, [[1, 2], [3]], n_tokens=512)
    assert [len(x) for x in v] == [512, 512]
    assert v[0][:3] == [1, 2, 100] and v[1][:2] == [3, 100]
    with pytest.raises(ValueError):
        bp.ttft_prompt_variants(ids[:10], [[1]], n_tokens=512)


def test_log_tail(tmp_path):
    p = tmp_path / "build.log"
    p.write_text("".join(f"line {i}\n" for i in range(100)))
    assert common.log_tail(p, 3) == "line 97\nline 98\nline 99"
    assert common.log_tail(tmp_path / "missing.log") == ""


def test_run_logged_failure_names_log(tmp_path):
    log = tmp_path / "x.log"
    with pytest.raises(common.SetupError) as e:
        common.run_logged("step X", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], log, nice=False)
    msg = str(e.value)
    assert "step X" in msg and "exit code 3" in msg and str(log) in msg and "boom" in msg
    with pytest.raises(common.SetupError, match="not found"):
        common.run_logged("step Y", ["/nonexistent/binary"], log, nice=False)


def test_request_prompt():
    class R:
        prompt = "a"
    assert bp.request_prompt(R()) == "a"
    assert bp.request_prompt({"prompt": "b"}) == "b"


def test_jsonable():
    assert bp._jsonable({"a": math.inf, 1: (1, Path("/x"))}) == {"a": None, "1": [1, repr(Path("/x"))]}


def test_bandwidth_line_reports_the_fraction_of_the_bound():
    bw = {"read_gb_s": 25.0, "bytes_per_token": 250e6, "bound_tok_s": 100.0}
    line = report.describe_bandwidth(bw, 42.0)
    assert "25.0 GB/s" in line and "250 MB" in line and "42.0 tok/s = 42% of it" in line
    assert report.describe_bandwidth(None, 42.0) == "memory-bandwidth bound: not measured"


def test_bandwidth_bound_is_the_median_of_the_samples_before_and_after():
    """A burst caught by one sample (the VMs jump from ~31 to ~50 GB/s for seconds) does not
    set the bound: the median of all samples, before and after jaxserve's run, does."""
    parts = {"layers": 200_000_000, "lm_head": 50_000_000}
    before = {"samples_gb_s": [50.0, 30.0, 31.0], "weight_bytes": parts}
    after = {"samples_gb_s": [29.0, 32.0], "weight_bytes": parts}
    bw = report.combine_bandwidth(before, None, after)
    assert bw["read_gb_s"] == 31.0 and bw["bytes_per_token"] == 250_000_000
    assert bw["bound_tok_s"] == 124.0 and bw["samples_gb_s"] == [50.0, 30.0, 31.0, 29.0, 32.0]
    assert "31.0 GB/s read (median of 5 samples, 29.0-50.0)" in report.describe_bandwidth(bw, 99.2)
    assert "99.2 tok/s = 80% of it" in report.describe_bandwidth(bw, 99.2)
    assert report.combine_bandwidth(None, None) is None


def test_weight_bytes_per_token_follow_the_served_format():
    from tools import membw
    from jaxserve.config import EngineConfig, ModelConfig
    m = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=4)
    layer = 8 * (8 + 2 * 4) + 8 * 8 + 3 * 8 * 16  # qkv, wo, mlp
    f32 = membw.weight_bytes_per_token(m, EngineConfig())
    assert f32 == {"layers": 2 * layer * 4, "lm_head": 100 * 8 * 4}
    bf16 = membw.weight_bytes_per_token(m, EngineConfig().override(bf16_matmul_min_rows=1))
    assert bf16 == {"layers": 2 * layer * 2, "lm_head": 100 * 8 * 2}
    int8 = membw.weight_bytes_per_token(m, EngineConfig().override(weight_quant="int8"))
    assert int8 == {"layers": 2 * layer, "lm_head": 100 * 8 * 4}


def test_membw_counts_the_default_configs_gguf_blocks(smollm2_config, cache_dir):
    """tools/membw.py's bytes per token for the default config (the Q4_1 file served in its
    blocks) are its blocks': 20 bytes per 32 weights of every projection, 34 per 32 of the
    Q8_0 embedding the head is tied to; the bf16 config's, the same weights in bf16."""
    from tools import membw
    from jaxserve.checkpoint import load_model_config
    from jaxserve.checkpoint.sources import resolve_checkpoint
    from jaxserve.kernels.ggml_blocks import BLOCK, FORMATS
    from jaxserve.model.params import PROJECTIONS, param_specs

    root = Path(__file__).resolve().parent.parent
    model = load_model_config(resolve_checkpoint(smollm2_config.source, cache_dir))
    spec = param_specs(model).layers[0]
    weights = model.num_layers * sum(math.prod(getattr(spec, n).shape) for n in PROJECTIONS)
    head = model.vocab_size * model.hidden_size
    blocks = membw.weight_parts(str(root / "configs" / "smollm2_135m.py"), cache_dir)
    assert blocks == {"layers": weights // BLOCK * FORMATS["q4_1"][0],
                      "lm_head": head // BLOCK * FORMATS["q8_0"][0]}
    bf16 = membw.weight_parts(str(root / "configs" / "smollm2_135m_bf16.py"), cache_dir)
    assert bf16 == {"layers": weights * 2, "lm_head": head * 2}


def test_ggml_weight_bytes_are_the_served_blocks():
    """A GGUF-served model's bytes per token are its blocks' (per tensor format, fused or
    not, stacked or not; the head tied to a Q8_0 embedding), and None where a projection
    or the head is not GGML blocks (the config's formula then decides)."""
    import numpy as np
    from jaxserve.bench.bandwidth import ggml_weight_bytes_per_token
    from jaxserve.model.ggml_weight import GGMLWeight
    from jaxserve.model.layer_loop import StackedLayers
    from jaxserve.model.params import LayerParams, Params
    from jaxserve.model.weight_layouts import FusedWeight

    def blocks(n_bytes, fmt="q4_1"):
        return GGMLWeight(qs=np.zeros((n_bytes,), np.uint8), d=None, m=None, fmt=fmt)

    def layer(wo):
        return LayerParams(attn_norm=np.zeros(8, np.float32),
                           wq=FusedWeight(blocks(300), ((4,), (2,), (2,))), wk=None, wv=None,
                           wo=wo, mlp_norm=np.zeros(8, np.float32),
                           w_gate=blocks(500), w_up=blocks(500), w_down=blocks(700))

    embed = blocks(1000, "q8_0")
    two = Params(embed=embed, layers=(layer(blocks(100)), layer(blocks(100))),
                 final_norm=np.zeros(8, np.float32))
    assert ggml_weight_bytes_per_token(two) == {"layers": 2 * 2100, "lm_head": 1000}
    stacked = Params(embed=embed, layers=StackedLayers(layer(blocks(200)), 2),
                     final_norm=np.zeros(8, np.float32), lm_head=blocks(40))
    assert ggml_weight_bytes_per_token(stacked) == {"layers": 2200, "lm_head": 40}
    mixed = Params(embed=embed, layers=(layer(np.zeros((4, 8), np.float32)),),
                   final_norm=np.zeros(8, np.float32))
    assert ggml_weight_bytes_per_token(mixed) is None
    float_head = Params(embed=np.zeros((10, 8), np.float32), layers=(layer(blocks(100)),),
                        final_norm=np.zeros(8, np.float32))
    assert ggml_weight_bytes_per_token(float_head) is None


def test_llama_ngram_flags_follow_help_text():
    help_text = ("--spec-type none,draft-simple,ngram-simple,ngram-cache\n"
                 "--spec-ngram-simple-size-n N   ngram size N\n"
                 "--spec-draft-n-max N   number of tokens to draft")
    flags = llamacpp.llama_ngram_flags(help_text, lookup=3, draft=4)

    def val(flag):
        return flags[flags.index(flag) + 1]

    assert val("--spec-type") == "ngram-simple"
    assert val("--spec-ngram-simple-size-n") == "3" and val("--spec-ngram-simple-size-m") == "4"
    assert val("--spec-draft-n-max") == "4"
    old = "--draft-max N   number of tokens to draft\n-md, --model-draft FNAME"
    with pytest.raises(common.SetupError, match="ngram-simple"):
        llamacpp.llama_ngram_flags(old, 3, 4)


def test_speculation_rows_pair_each_speculative_peer_with_its_plain_sibling():
    results = {
        "jaxserve": {"single_decode_tok_s": 100.0, "concurrent_output_tok_s": 300.0},
        "jaxserve-eagle": {"single_decode_tok_s": 130.0, "concurrent_output_tok_s": 297.0},
        "llamacpp-bf16-ngram": {"single_decode_tok_s": 90.0},  # its sibling did not run
    }
    rows = report.speculation_rows(results)
    assert len(rows) == 2  # header + jaxserve-eagle only
    assert rows[1] == ["jaxserve-eagle", "jaxserve", "130", "100", "1.30x", "297", "300", "0.99x"]
    assert report.speculation_rows({"jaxserve": results["jaxserve"]}) == []
    text = report.format_speculation(results)
    assert "1.30x" in text and "llamacpp-bf16-ngram" not in text
    assert report.format_speculation({}) == ""


def test_every_speculative_peer_is_a_peer_with_a_plain_sibling():
    for peer, plain in common.SPEC_PEERS.items():
        assert peer in common.ALL_PEERS and plain in common.ALL_PEERS
    for peer, config in common.SPEC_CONFIGS.items():
        assert peer in common.SPEC_PEERS and (common.ROOT / config).is_file()
    assert bp.parse_peers("jaxserve-eagle,jaxserve") == ["jaxserve", "jaxserve-eagle"]


def test_same_format_rows_pair_each_jaxserve_peer_with_llama_cpp_in_its_format():
    results = {
        "jaxserve": {"single_decode_tok_s": 100.0, "concurrent_output_tok_s": 800.0,
                     "peak_rss_mib": 900.0},
        "jaxserve-q4_1": {"single_decode_tok_s": 180.0, "concurrent_output_tok_s": 1000.0,
                          "peak_rss_mib": 400.0},
        "llamacpp-q4_1": {"single_decode_tok_s": 120.0, "concurrent_output_tok_s": 400.0,
                          "peak_rss_mib": 200.0},
        "jaxserve-q8_0": {"single_decode_tok_s": 150.0},  # llamacpp-q8_0 did not run
    }
    rows = report.same_format_rows(results)
    assert len(rows) == 2  # header + jaxserve-q4_1 only
    # throughput ratios jaxserve / llama.cpp; the RSS ratio llama.cpp / jaxserve (< 1: more memory)
    assert rows[1] == ["jaxserve-q4_1", "llamacpp-q4_1", "180", "120", "1.50x", "1000", "400",
                       "2.50x", "400", "200", "0.50x"]
    assert report.format_same_format({"jaxserve": results["jaxserve"]}) == ""
    assert "jaxserve-q4_1" in report.format_same_format(results)


def test_every_peer_has_its_format_and_gguf_peers_run_their_file():
    for peer, other in common.SAME_FORMAT_PEERS.items():
        assert peer in common.ALL_PEERS and other in common.ALL_PEERS
        assert other.startswith("llamacpp-")
        assert bp.peer_format(other) == common.GGUF_PEERS.get(peer, "BF16")
    assert bp.peer_format("llamacpp-bf16-ngram") == "BF16"
    assert bp.peer_format("jaxserve") is None and bp.peer_format("hf-bf16") is None
    st = bp.Setup(None, Path("/m/q4.gguf"), {"Q8_0": (Path("/m/q8.gguf"), "how")}, [])
    assert st.gguf("Q4_1") == Path("/m/q4.gguf") and st.gguf("Q8_0") == Path("/m/q8.gguf")
    assert llamacpp.requantized_gguf_name("Q8_0") == common.Q4_1_GGUF.replace("Q4_1", "Q8_0")


def test_session_peak_rss_sums_the_processes_of_the_session(tmp_path):
    def proc(pid, comm, session, hwm_kb):
        d = tmp_path / str(pid)
        d.mkdir()
        # comm in parentheses may hold spaces and ')' (the parser reads after the last one)
        (d / "stat").write_text(f"{pid} ({comm}) S 1 {session} {session} 0 -1 4194560 0\n")
        (d / "status").write_text(f"Name:\t{comm}\nVmHWM:\t  {hwm_kb} kB\nVmRSS:\t 1 kB\n")
    proc(100, "python3", 100, 1000)
    proc(101, "a (b) c", 100, 24)
    proc(200, "other", 200, 5000)
    (tmp_path / "self").mkdir()
    assert common.session_peak_rss_bytes(100, tmp_path) == 1024 * 1024
    assert common.session_peak_rss_bytes(300, tmp_path) is None


@pytest.mark.parametrize("fmt", ["BF16", "Q8_0"])
def test_requantized_gguf_keeps_the_tensors_in_the_new_format(tmp_path, fmt):
    import gguf  # a dependency of jaxserve (GGUF loading): a missing one fails here
    import numpy as np
    rng = np.random.default_rng(0)
    src = tmp_path / "m.Q4_1.gguf"
    w = gguf.GGUFWriter(src, "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    q41 = gguf.GGMLQuantizationType.Q4_1
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(x, q41), raw_dtype=q41)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / f"m.{fmt}.gguf"
    llamacpp.write_requantized_gguf_python(src, out, fmt)
    llamacpp.check_requantized_gguf(src, out, fmt)
    with pytest.raises(common.SetupError, match="not in Q8_0" if fmt == "BF16" else "not in BF16"):
        llamacpp.check_requantized_gguf(src, out, "Q8_0" if fmt == "BF16" else "BF16")
    got = {t.name: t for t in gguf.GGUFReader(out).tensors}
    t = got["blk.0.ffn_up.weight"]
    want = gguf.quants.dequantize(gguf.quants.quantize(x, q41), q41)
    back = gguf.quants.dequantize(t.data, t.tensor_type).reshape(4, 64)
    # BF16: half an ulp, |x| 2^-8; Q8_0: half a step d = (block max) / 127, plus the f16
    # rounding of d (2^-11 relative) times up to 127 steps (the tensor's max bounds a block's)
    d = np.abs(want).max() / 127
    bound = np.abs(want) / 256 if fmt == "BF16" else d * (0.5 + 127 * 2.0**-11) + 1e-7
    assert np.all(np.abs(back - want) <= bound)
    with pytest.raises(ValueError, match="Q5_0"):
        llamacpp.setup_requantized_gguf(tmp_path, src, None, "Q5_0")
