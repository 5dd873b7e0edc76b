"""The tokenizer rebuilt from a GGUF vocabulary against transformers' GGUF tokenizer: the
real SmolLM2 file (checkpoint's tokenizer.json), and the same vocabulary under the other
pre-tokenizer names llama.cpp writes (llama-bpe, qwen2)."""

import json

import gguf
import pytest
from tokenizers import Tokenizer

from hf_reference import load_gguf_tokenizer
from jaxserve.checkpoint import CheckpointError, build_gguf_tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "  two leading spaces, three trailing   ",
    "naïve café résumé Ångström façade crème brûlée",
    "cafe\u0301 (decomposed accent) and \u00c5 vs A\u030a",
    "日本語のテキストと中文字符，还有한국어",
    "emoji 😀 ZWJ family 👨‍👩‍👧‍👦 flag 🇫🇷 skin tone 👍🏽 keycap 1️⃣",
    "tabs\tand\nnewlines\r\n\n\n  mixed \t \n\t\tend",
    "def f(x):\n    return x**2  # square\n\nclass A:\n\tpass\n",
    "numbers 12345 3.14159 1,000,000 0x1F 2024-01-01 -7e10",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <repo_name>x<|im_end|>",
    "I'm sure you're right; they'll say we've been DON'T IT'S",
    "", " ", "\n", "a" * 60, "Ω≈ç√∫˜µ≤≥÷ ∀x∈ℝ", "\u200bzero\u200dwidth", "Привет, мир!",
    "مرحبا بالعالم", "🤖🤖🤖", "    indented\n        more", "http://example.com/a?b=c&d=e#f",
]


@pytest.fixture(scope="module")
def ours(smollm2_checkpoint):
    return Tokenizer.from_file(str(smollm2_checkpoint / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, hf_smollm2_tokenizer, text):
    hf = hf_smollm2_tokenizer
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level is lossless
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens_whole_and_digits_split(ours):
    assert ours.encode("<|im_start|>x<|im_end|>", add_special_tokens=False).ids[::2] == [1, 2]
    assert ours.get_vocab_size() == 49152
    for number in ("12345", "2024", " 987654321"):
        pieces = [ours.decode([i]) for i in ours.encode(number, add_special_tokens=False).ids]
        assert [p for p in pieces if p.strip()] == list(number.strip()), pieces


def test_tokenizer_config_matches_transformers(smollm2_checkpoint, hf_smollm2_tokenizer):
    cfg = json.loads((smollm2_checkpoint / "tokenizer_config.json").read_text())
    hf = hf_smollm2_tokenizer
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["unk_token"]) == \
        (hf.bos_token, hf.eos_token, hf.pad_token, hf.unk_token) == \
        ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert cfg["add_bos_token"] is False and cfg["chat_template"] == hf.chat_template
    assert "You are a helpful AI assistant named SmolLM" in cfg["chat_template"]


def _with_pre(src, dst, pre):
    """A tokenizer-only GGUF: `src`'s metadata with tokenizer.ggml.pre = `pre`, no tensors."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    md = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        md[key] = pre if key == "tokenizer.ggml.pre" else field.contents()
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, md[key], field.types[0], sub_type=field.types[-1] if array else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return md


@pytest.mark.full  # fast tier: the real model's own tokenizer against transformers'
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_other_pre_tokenizers_match_transformers(smollm2_gguf, tmp_path, pre):
    md = _with_pre(smollm2_gguf, tmp_path / "t.gguf", pre)
    ours, hf = build_gguf_tokenizer(md), load_gguf_tokenizer(tmp_path / "t.gguf")
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_sentencepiece_vocab_is_refused_by_name():
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"]}
    with pytest.raises(CheckpointError, match="x.gguf: unsupported GGUF tokenizer model 'llama'"):
        build_gguf_tokenizer(md, "x.gguf")


def test_control_and_user_defined_tokens_from_types():
    tokens = ["a", "b", "ab", "<ctl>", "<user>", "Ġ", "Ġa"]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": [1, 1, 1, 3, 4, 1, 1], "tokenizer.ggml.merges": ["a b", "Ġ a"]}
    tok = build_gguf_tokenizer(md)
    assert tok.encode("ab<ctl> a<user>").ids == [2, 3, 6, 4]
    assert tok.decode([2, 3, 6, 4]) == "ab a<user>"  # control tokens are special, user-defined not
