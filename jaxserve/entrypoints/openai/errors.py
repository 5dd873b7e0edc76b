"""The error a request gets: ApiError, OpenAI's error object with an HTTP status.

Source: the OpenAI API reference (error objects).
"""

from __future__ import annotations

from typing import Any

MAX_MESSAGE_CHARS = 400  # an error message never echoes more of the request than this


class ApiError(Exception):
    """A request the server refuses. `status`: HTTP status; `param`: the offending field
    (a dotted path such as "messages.0.content"), or None.

    `body()` is OpenAI's error object: {"error": {"message", "type", "param", "code"}}
    (`protocol.ErrorResponse`).
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type

    def body(self) -> dict[str, Any]:
        """The JSON error object OpenAI returns (HTTP body of the error response)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
