"""Tokenizer wrapper: loading the HF files, special tokens, BOS handling, chat templates
rendered like HF transformers' apply_chat_template."""

import json

import pytest

from fake_engine import CHATML_TEMPLATE, tiny_tokenizer
from jaxserve.tokenization.tokenizer import ChatTemplateError, Tokenizer

SMOLLM2_CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def write_dir(tmp_path, config: dict, **files):
    tiny_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in files.items():
        (tmp_path / name.replace("__", ".")).write_text(text)
    return tmp_path


def test_real_smollm2(smollm2_checkpoint):
    tok = Tokenizer.from_dir(smollm2_checkpoint)
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (1, 2, (2,))
    assert tok.vocab_size == 49152
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == SMOLLM2_CHAT
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   add_generation_prompt=False) == SMOLLM2_CHAT[:-len("<|im_start|>assistant\n")]
    ids = tok.encode(SMOLLM2_CHAT, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2  # special tokens are single ids
    assert tok.decode(ids, skip_special_tokens=False) == SMOLLM2_CHAT
    assert tok.id_to_token(1) == "<|im_start|>"


def test_from_dir_special_token_dicts_and_template_in_config(tmp_path):
    d = write_dir(tmp_path, {"bos_token": {"content": "<|im_start|>", "lstrip": False},
                             "eos_token": "<|im_end|>", "pad_token": None,
                             "chat_template": CHATML_TEMPLATE})
    tok = Tokenizer.from_dir(d)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, None)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_from_dir_named_templates_jinja_file_and_generation_config(tmp_path):
    d = write_dir(tmp_path, {"eos_token": "<|im_end|>",
                             "chat_template": [{"name": "tool_use", "template": "T"},
                                               {"name": "default", "template": "D{{ eos_token }}"}]},
                  generation_config__json=json.dumps({"eos_token_id": [257, 10]}))
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template([]) == "D<|im_end|>"
    assert tok.eos_token_ids == (257, 10)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "a"}]) == "J1"


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_add_bos_token_prepends_once(tmp_path):
    d = write_dir(tmp_path, {"bos_token": "<|im_start|>", "add_bos_token": True})
    tok = Tokenizer.from_dir(d)
    assert tok.encode("ab") == [256, 97, 98]
    assert tok.encode("<|im_start|>ab") == [256, 97, 98]
    assert tok.encode("ab", add_special_tokens=False) == [97, 98]


def make(template):
    return Tokenizer(tiny_tokenizer().backend, chat_template=template, bos_token="<s>",
                     eos_token="<|im_end|>")


def test_template_environment_matches_hf():
    # trim_blocks / lstrip_blocks: block tags leave no newline or indentation behind
    tok = make("{% for m in messages %}\n  {% if m.role == 'user' %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"
    # tojson does not HTML-escape; special tokens are variables; None-valued keys are dropped
    tok = make("{{ bos_token }}{{ messages[0] | tojson }}{% if messages[0].name is defined %}N{% endif %}")
    assert tok.apply_chat_template([{"role": "user", "content": "<a&b>", "name": None}]) == \
        '<s>{"role": "user", "content": "<a&b>"}'
    # loop controls and {% generation %} blocks parse
    tok = make("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
               "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "1"}, {"role": "user", "content": "2"}]) == "1"


def test_template_errors():
    tok = make("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        make("{{ messages[0].content + 1 }}").apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        make(None).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        make("{% for %}")
    # the sandbox refuses attribute access to Python internals
    with pytest.raises(ChatTemplateError):
        make("{{ messages.__class__.__mro__[1].__subclasses__() }}").apply_chat_template([])


def test_placeholder_tokenizer_bytes_specials_and_every_id():
    from jaxserve.tokenization.tokenizer import placeholder_tokenizer
    tok = placeholder_tokenizer(1000, bos_token_id=998, eos_token_ids=(999, 997))
    text = "héllo, wörld ✓"
    ids = tok.encode(text)
    assert ids == list(text.encode()) and tok.decode(ids) == text  # byte by byte
    assert tok.vocab_size == 1000 and tok.bos_token_id == 998 and tok.eos_token_ids == (999, 997)
    assert tok.decode([300, 998, 999, 997, 301]) == " t300 t301"  # specials skipped
    assert tok.decode([999], skip_special_tokens=False) == "<|eos|>"
    assert [tok.id_to_token(i) is not None for i in range(1000)] == [True] * 1000
    with pytest.raises(ValueError, match="outside the vocabulary of 1000"):
        placeholder_tokenizer(1000, eos_token_ids=(1000,))
