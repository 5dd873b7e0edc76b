"""`jaxserve bench generate` (jaxserve/bench/generate.py): the device-busy fraction of a
trace, the case syntax, and one run end to end on dummy weights of the default config's
shape, with the HF transformers comparison and a trace."""

import json

import pytest

from jaxserve.bench import generate as bg


def test_busy_fraction_is_the_union_of_kernel_intervals_over_their_span():
    gpu, host = 7, 1
    events = [{"ph": "M", "name": "process_name", "pid": gpu, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": host, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": gpu, "ts": 0, "dur": 10},
              {"ph": "X", "pid": gpu, "ts": 5, "dur": 10},    # overlaps: 0..15 busy
              {"ph": "X", "pid": gpu, "ts": 40, "dur": 10},   # gap 15..40
              {"ph": "X", "pid": host, "ts": 15, "dur": 25},  # host work: not the device's
              {"ph": "i", "pid": gpu, "ts": 100}]             # an instant: no kernel
    pids = bg.device_pids(events)
    assert pids == {gpu}
    assert bg.busy_fraction(events, pids) == pytest.approx(25 / 50)
    assert bg.busy_fraction(events, {host}) == 1.0
    assert bg.busy_fraction(events, set()) is None


def test_cases_and_flags_are_checked(capsys):
    assert bg.parse_case("64x512x256") == (64, 512, 256)
    for bad in ("64x512", "0x1x1", "ax1x1", "1x1x1x1"):
        with pytest.raises(ValueError, match="STREAMSxPROMPTxOUTPUT"):
            bg.parse_case(bad)
    assert bg.main(["--cases", "1x2"]) == 2
    assert bg.main(["--cases", "1x2x2", "--decode-steps", "0"]) == 2
    assert bg.parse_compiler_options("{}") is None
    assert bg.parse_compiler_options('{"xla_gpu_enable_command_buffer": ""}') == (
        ("xla_gpu_enable_command_buffer", ""),)
    assert bg.main(["--cases", "1x2x2", "--xla-compiler-options", "{}", "[1]"]) == 2
    assert bg.main(["--cases", "1x2x2", "--xla-compiler-options", '{"xla_a": 1}']) == 2
    assert bg.main(["--cases", "1x2x2", "--branches", "host,gpu"]) == 2
    assert bg.main(["--cases", "1x2x2", "--fuse-projections", "on,yes"]) == 2
    assert bg.main(["--cases", "1x2x2", "--weight-quant", "int8,int4"]) == 2
    assert bg.main(["--cases", "1x2x2", "--matmul-impl", "xla,triton"]) == 2
    assert bg.main(["--cases", "1x2x2", "--fused-decode", "on,1"]) == 2
    assert bg.main(["--cases", "1x2x2", "--bandwidth-gb-s", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("jaxserve bench generate: error: --cases: '1x2'")
    assert "--decode-steps: '0'" in err[1]
    assert "--xla-compiler-options: '[1]' is not a JSON object" in err[2]
    assert "--xla-compiler-options: '{\"xla_a\": 1}' is not a JSON object" in err[3]
    assert "--branches: 'gpu' is not one of auto, device, host" in err[4]
    assert "--fuse-projections: 'yes' is not one of auto, on, off" in err[5]
    assert "--weight-quant: 'int4' is not one of auto, none, int8, fp8_e4m3" in err[6]
    assert "--matmul-impl: 'triton' is not one of auto, xla, pallas, pallas_mosaic" in err[7]
    assert "--fused-decode: '1' is not one of auto, on, off" in err[8]
    assert "--bandwidth-gb-s: must be a positive number of GB/s, got 0.0" in err[9]


@pytest.mark.full  # fast tier: the parts above; its engine path is LLM.generate's
def test_a_run_on_dummy_weights_reports_every_figure(tmp_path, cache_dir):
    out = tmp_path / "r.json"
    # two of the 30 layers: the figures and the tool's paths are the same, at a tenth of
    # the compile and run time
    assert bg.main(["--config", "smollm2_135m", "--num-layers", "2", "--cases", "2x8x6,1x4x3",
                    "--decode-steps", "1,auto", "--branches", "host", "--hf",
                    "--fuse-projections", "on", "--fused-decode", "on",
                    "--trace", str(tmp_path / "trace"),
                    "--cache-dir", str(cache_dir), "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["read_bandwidth"] > 1e9
    # one engine per decode_steps value (the config's: 8), each case on it
    assert [(r["decode_steps"], r["case"]) for r in got["results"]] == [
        (1, "2x8x6"), (1, "1x4x3"), (8, "2x8x6"), (8, "1x4x3")]
    for r in got["results"]:
        assert r["branches"] == "host"  # (GPUs' default) its sampler plans compile unseen
        assert r["fuse_projections"] is True  # (GPUs' default)
        assert r["fused_decode"] is True  # (GPUs' default)
        assert r["weight_quant"] is None  # the config's
        assert r["compile_events_timed"] == 0
        # the bound as the module docstring defines it, from the figures the run reports
        # (the read bandwidth itself moves with the other xdist worker's load)
        streams, prompt, out_len = bg.parse_case(r["case"])
        step_bytes = r["weight_bytes"] + streams * (prompt + out_len / 2) * r["kv_bytes_per_token"]
        assert r["bound_tok_s"] == pytest.approx(streams * got["read_bandwidth"] / step_bytes)
        assert r["output_tok_s"] > 0
        assert r["ratio_to_bound"] == pytest.approx(r["output_tok_s"] / r["bound_tok_s"])
        assert r["num_steps"] > 0 and r["host_us_per_step"] > 0 and 0 < r["host_share"] < 1
        assert r["device_busy"] is None  # XLA:CPU: no device stream in the trace
        assert isinstance(r["hf_tok_s"], float) and r["hf_tok_s"] > 0
    assert list((tmp_path / "trace").rglob("perfetto_trace.json.gz"))
