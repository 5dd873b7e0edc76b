"""Chat templates: render a list of messages into one prompt string with Jinja2.

Rendered the way Hugging Face transformers' `apply_chat_template(tokenize=False)` does
(transformers `utils/chat_template_utils.py`: `_compile_jinja_template` and
`render_jinja_template`): an `ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)` with the `loopcontrols` extension, a `tojson` filter that does not
escape HTML, the globals `raise_exception` and `strftime_now`, and the tokenizer's special
tokens (`bos_token`, `eos_token`, ...) as template variables. Message keys whose value is
None are dropped first, as transformers does (OpenAI clients send `"content": null`).

Not reproduced: assistant-token masks (`{% generation %}` blocks render their body only),
`continue_final_message`, and transformers' control-token sanitising of user content.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, the template is invalid, or it rejected the
    messages (its `raise_exception(...)`, e.g. "roles must alternate"). HTTP 400 at the edge."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers' AssistantTracker
    marks assistant tokens there; serving has no use for the mask)."""

    tags = {"generation"}

    def parse(self, parser):
        """Parse `{% generation %} body {% endgeneration %}` into a call that renders body."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template.

    `source`: the Jinja2 text (tokenizer_config.json's `chat_template` or chat_template.jinja).
    `special_tokens`: template variables such as {"bos_token": "<s>", "eos_token": "</s>"}.
    Raises ChatTemplateError if the template does not parse.
    Source: HF transformers `_compile_jinja_template`.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        """The template variables it reads ("messages", "tools", "bos_token", ...)."""

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """Render `messages` ([{"role": str, "content": str, ...}, ...]) to the prompt text.

        `add_generation_prompt`: append the header that opens the assistant's turn.
        `kwargs`: extra template variables (they override the special tokens, as in HF).
        Raises ChatTemplateError when a message is not a dict or the template raises.
        Source: HF transformers `render_jinja_template` / `apply_chat_template`.
        """
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise ChatTemplateError(f"chat messages must be objects, got {m!r}")
            chat.append({k: v for k, v in m.items() if v is not None})
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=chat, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            # A template indexing a missing key or concatenating a non-string raises these.
            raise ChatTemplateError(f"chat template failed on these messages: {e}") from e
