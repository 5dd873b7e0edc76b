"""The HTTP server's group (ServerConfig): its per-request limits."""

from __future__ import annotations

import dataclasses

from jaxserve.config.validation import ConfigError

# The parsers jaxserve.entrypoints.openai.tool_parsers / reasoning_parsers implement (they
# take these names from here: the config imports nothing from the server).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's limits: what one client may ask of it, so that no request can
    starve or break the others. Each is a `jaxserve serve` flag (jaxserve.config.args)."""

    max_request_body_bytes: int = 8 * 2**20
    """Largest request body accepted (bytes); larger -> HTTP 413."""
    max_queued_requests: int = 1024
    """Most requests waiting for the engine (admitted, not yet running: SGLang's
    `--max-queued-requests`); beyond it -> HTTP 503 with `Retry-After`."""
    request_timeout_s: float | None = 600.0
    """A request still unfinished this many seconds after it arrived is aborted (its pages
    freed); None = no limit."""
    max_stream_buffer_bytes: int = 256 * 2**10
    """Output produced for a client but not yet taken by it (UTF-8 bytes of text, plus 128
    per queued output: an SSE chunk's JSON envelope); past this the client is not reading
    its stream, and the request is aborted."""
    max_stop_strings: int = 16
    """Most `stop` strings one request may give."""
    max_stop_string_len: int = 1024
    """Most characters in one `stop` string (the stop matcher holds back that much text per
    token)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM / SIGINT, seconds in-flight requests get to finish before they are
    aborted (new requests get 503 meanwhile)."""
    retry_after_s: int = 1
    """The `Retry-After` (seconds) sent with a 503 for a full queue."""
    allowed_origins: tuple[str, ...] = ()
    """CORS origins allowed to call the API from a browser; () = CORS off."""
    enable_auto_tool_choice: bool = False
    """Let the model decide whether to call the request's tools (`tool_choice` "auto", the
    default with tools): its reply is read by --tool-call-parser (vLLM's flag)."""
    tool_call_parser: str | None = dataclasses.field(default=None, metadata={
        "choices": TOOL_CALL_PARSERS})
    """How the model writes tool calls in its text: the format its chat template teaches
    (hermes: Hermes / Qwen2.5 / SmolLM2; llama3_json; mistral; pythonic). Needed by
    --enable-auto-tool-choice."""
    reasoning_parser: str | None = dataclasses.field(default=None, metadata={
        "choices": REASONING_PARSERS})
    """Split a reasoning model's `<think>...</think>` text into the chat message's
    `reasoning_content` (deepseek_r1, qwen3); structured output and tool calls then apply
    to the answer after it."""

    def __post_init__(self):
        for name in ("max_request_body_bytes", "max_queued_requests", "max_stream_buffer_bytes",
                     "max_stop_strings", "max_stop_string_len", "retry_after_s"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ConfigError(f"ServerConfig.{name} must be an integer > 0, "
                                  f"got {getattr(self, name)!r}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ConfigError(f"ServerConfig.request_timeout_s must be None or > 0, "
                              f"got {self.request_timeout_s!r}")
        if not self.shutdown_timeout_s >= 0:
            raise ConfigError(f"ServerConfig.shutdown_timeout_s must be >= 0, "
                              f"got {self.shutdown_timeout_s!r}")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        for name, known in (("tool_call_parser", TOOL_CALL_PARSERS),
                            ("reasoning_parser", REASONING_PARSERS)):
            if getattr(self, name) is not None and getattr(self, name) not in known:
                raise ConfigError(f"ServerConfig.{name}: unknown parser "
                                  f"{getattr(self, name)!r}; one of {list(known)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("ServerConfig.enable_auto_tool_choice needs tool_call_parser "
                              f"(--tool-call-parser, one of {list(TOOL_CALL_PARSERS)})")
