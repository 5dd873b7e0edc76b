"""The tokenizer: a Hugging Face `tokenizers.Tokenizer` plus what `tokenizer.json` leaves out.

`tokenizer.json` holds the vocabulary, merges, normaliser, pre-tokeniser, decoder and
post-processor; `tokenizer_config.json` holds the special-token names, `add_bos_token` and
the chat template (transformers 5 writes the template to `chat_template.jinja` instead);
`generation_config.json`, when present, may list extra end-of-sequence ids (Llama 3).

Streaming text pieces live in `jaxserve.tokenization.detokenizer` and are re-exported here:
`IncrementalDetokenizer` (vLLM's prefix/read-offset algorithm) and `StopChecker`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import tokenizers

from jaxserve.tokenization.chat_template import ChatTemplate, ChatTemplateError
from jaxserve.tokenization.detokenizer import IncrementalDetokenizer, StopChecker

__all__ = ["Tokenizer", "IncrementalDetokenizer", "StopChecker", "ChatTemplateError"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: tokenizer_config.json's `chat_template` (a string, or a list
    of {"name", "template"} with one named "default"), else chat_template.jinja, else
    chat_template.json's `chat_template` (HF's three places, newest last)."""
    tpl = config.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
        tpl = named.get("default", next(iter(named.values()), None))
    if isinstance(tpl, str):
        return tpl
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    if (path / "chat_template.json").is_file():
        tpl = json.loads((path / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
        return tpl if isinstance(tpl, str) else None
    return None


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    """generation_config.json's `eos_token_id` (int or list), or ()."""
    f = path / "generation_config.json"
    if not f.is_file():
        return ()
    eos = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id")
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(e) for e in eos) if isinstance(eos, list) else ()


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model.

    backend: the `tokenizers.Tokenizer` (from tokenizer.json).
    chat_template: Jinja2 source, or None when the model has none.
    bos_token / eos_token / pad_token / unk_token: special token strings, or None.
    add_bos_token: prepend BOS in `encode(add_special_tokens=True)` when the post-processor
        did not already (HF `add_bos_token`; Llama tokenizers whose tokenizer.json lacks a
        TemplateProcessing step).
    extra_eos_token_ids: further ids that end generation (generation_config.json).
    Raises ChatTemplateError if the chat template does not compile.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None,
                 add_bos_token: bool = False, extra_eos_token_ids: Sequence[int] = ()):
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        self.add_bos_token = bool(add_bos_token)
        specials = {k: getattr(self, k) for k in _SPECIAL_TOKEN_KEYS if getattr(self, k) is not None}
        self.chat_template = ChatTemplate(chat_template, specials) if chat_template else None
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        eos += [int(t) for t in extra_eos_token_ids if int(t) not in eos]
        self._eos_token_ids = tuple(eos)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load `path/tokenizer.json` and, if present, `tokenizer_config.json`,
        `chat_template.jinja` / `chat_template.json` and `generation_config.json`.

        Raises FileNotFoundError if tokenizer.json is missing; ChatTemplateError if the chat
        template does not compile. Source: the files HF `save_pretrained` writes.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} does not exist (a model directory needs tokenizer.json)")
        cfg_file = path / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        return cls(tokenizers.Tokenizer.from_file(str(tok_file)),
                   chat_template=_read_chat_template(path, config),
                   bos_token=_token_str(config.get("bos_token")),
                   eos_token=_token_str(config.get("eos_token")),
                   pad_token=_token_str(config.get("pad_token")),
                   unk_token=_token_str(config.get("unk_token")),
                   add_bos_token=bool(config.get("add_bos_token", False)),
                   extra_eos_token_ids=_generation_eos_ids(path))

    # -- special tokens -------------------------------------------------------------------

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        """Id of the beginning-of-sequence token, or None."""
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """Id of the tokenizer's end-of-sequence token, or None."""
        return self._id(self.eos_token)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All ids that end generation: eos_token_id first, then generation_config's."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        """Id of the padding token, or None."""
        return self._id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be below the model's padded vocab)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of `token_id` (byte-level form, e.g. "Ġhello"), None if unknown."""
        return self.backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of token string `token`, None if it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    # -- text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. `add_special_tokens` runs the post-processor (and adds BOS
        if `add_bos_token`); use False for text that already holds them (a rendered chat
        template), as HF `apply_chat_template(tokenize=True)` and vLLM do.

        Runs through `encode_batch`, which releases the GIL while the Rust tokenizer works
        (`encode` holds it: a 4 MB prompt stalled every other thread, the server's event
        loop included, for ~7 s); same ids."""
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; an incomplete UTF-8 sequence decodes to U+FFFD (byte-level BPE)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render chat `messages` ([{"role", "content"}, ...]) to prompt text (not ids:
        encode it with add_special_tokens=False). `kwargs` become template variables.

        Raises ChatTemplateError when the model has no chat template or the template
        rejects the messages. Source: HF `PreTrainedTokenizerBase.apply_chat_template`.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def byte_chars() -> list[str]:
    """The byte-level alphabet: the printable character standing for each byte 0..255
    (GPT-2's `bytes_to_unicode`, which `tokenizers`' ByteLevel decoder inverts)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def placeholder_tokenizer(vocab_size: int, bos_token_id: int | None = None,
                          eos_token_ids: Sequence[int] = ()) -> Tokenizer:
    """A tokenizer over `vocab_size` ids for a model served without one (dummy weights of
    a config that names no tokenizer: `--load-format dummy`): text encodes byte by byte
    (ids 0..255 are the bytes), every other id decodes to " t<id>"; `bos_token_id` is
    "<|bos|>", eos_token_ids[0] "<|eos|>" and the rest "<|eos_<id>|>" (special tokens).
    No chat template. Raises ValueError for vocab_size < 256 or a special id outside it."""
    if vocab_size < 256:
        raise ValueError(f"a placeholder tokenizer needs vocab_size >= 256, got {vocab_size}")
    specials = {}
    if bos_token_id is not None:
        specials[int(bos_token_id)] = "<|bos|>"
    for k, i in enumerate(eos_token_ids):
        specials[int(i)] = "<|eos|>" if k == 0 else f"<|eos_{int(i)}|>"
    bad = [i for i in specials if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"special token ids {bad} are outside the vocabulary of {vocab_size}")
    space = byte_chars()[ord(" ")]
    vocab = {c: b for b, c in enumerate(byte_chars())}
    vocab.update({specials.get(i, f"{space}t{i}"): i for i in range(256, vocab_size)})
    vocab.update({name: i for i, name in specials.items()})
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(list(specials.values()))
    eos = [int(i) for i in eos_token_ids]
    return Tokenizer(backend, bos_token="<|bos|>" if bos_token_id is not None else None,
                     eos_token="<|eos|>" if eos else None, extra_eos_token_ids=eos[1:])
