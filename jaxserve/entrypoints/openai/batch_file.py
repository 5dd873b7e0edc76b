"""The OpenAI Batch file format: one request per input line, one result per output line.

    input   {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
    output  {"id": "batch_req_<hex>", "custom_id": "r1",
             "response": {"status_code": 200, "request_id": "chatcmpl-<hex>", "body": {...}},
             "error": null}

A request the API refuses has its error object as the response body (status_code 400, 404,
500 ...), as the HTTP server would answer it. A line that is not a request at all (not JSON,
no custom_id, an unsupported url or method, a custom_id used before) gets `"response": null`
and `"error": {"code", "message", "line"}` (`line`: its 1-based line number in the input).
Output lines are written in completion order, not input order; `custom_id` matches them.

Source: OpenAI API reference, Batch (the input and output file objects); vLLM's
`vllm.entrypoints.openai.run_batch`, which reads and writes the same lines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from array import array
from pathlib import Path
from typing import Any, Literal

import pydantic

# Error codes of lines that are not requests ("error" objects), as OpenAI's batch errors.
INVALID_JSON = "invalid_json_line"
INVALID_REQUEST = "invalid_request"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
UNSUPPORTED_URL = "invalid_url"


class BatchFileError(ValueError):
    """The input or output file cannot be used (missing, unreadable, not UTF-8 JSON
    lines where results are expected). The message names the file."""


class _RequestLine(pydantic.BaseModel):
    """One input line (OpenAI's batch request input object)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    custom_id: str = pydantic.Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


@dataclasses.dataclass
class BatchLine:
    """One non-blank input line, read. line: its 1-based line number; custom_id: None if
    the line has none; url and body (the request body as JSON bytes) when it is a request;
    error: why it is not one (code, message), else None. `parsed` is filled in later by
    whoever validates the body (jaxserve.entrypoints.openai.run_batch)."""

    line: int
    custom_id: str | None
    url: str | None = None
    body: bytes | None = None
    error: tuple[str, str] | None = None
    parsed: Any = None


def read_line(line: int, raw: bytes) -> BatchLine:
    """`raw` (one input line's bytes) as a BatchLine; never raises. An invalid line keeps
    its custom_id when one can be read, so that its error line can name it."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return BatchLine(line, None, error=(INVALID_JSON, f"line {line} is not JSON: {e}"[:400]))
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) and custom_id else None
    try:
        req = _RequestLine.model_validate(obj)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "line"
        return BatchLine(line, custom_id, error=(
            INVALID_REQUEST, f"line {line}: {where}: {first['msg']}"[:400]))
    return BatchLine(line, req.custom_id, req.url, json.dumps(req.body).encode())


class JsonlLines:
    """A JSON-lines file as a random-access data source (`grain.MapDataset.source`): item i
    is (line number, bytes) of the file's i-th non-blank line. Only the lines' offsets are
    held (16 bytes per line), never the file; reads are `os.pread`, safe from any thread.
    Raises BatchFileError if the file cannot be read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._starts, self._ends, self._lines = array("q"), array("q"), array("q")
        self._fd = None
        try:
            with self.path.open("rb") as f:
                pos = 0
                for number, raw in enumerate(f, 1):
                    if raw.strip():
                        self._starts.append(pos)
                        self._ends.append(pos + len(raw))
                        self._lines.append(number)
                    pos += len(raw)
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise BatchFileError(f"{path}: cannot read the input file: {e.strerror}") from None

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i: int) -> tuple[int, bytes]:
        start = self._starts[i]
        return self._lines[i], os.pread(self._fd, self._ends[i] - start, start)

    def close(self) -> None:
        """Close the file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:  # grain logs its sources
        return f"JsonlLines({str(self.path)!r}, {len(self)} lines)"


def result_line(custom_id: str, status_code: int, body: dict[str, Any]) -> str:
    """The output line (with its newline) of a request the API answered: `body` is the
    response (status 200) or the error object (any other status)."""
    request_id = body.get("id") if status_code == 200 else None
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                       "response": {"status_code": status_code,
                                    "request_id": request_id or f"req_{uuid.uuid4().hex}",
                                    "body": body},
                       "error": None}, ensure_ascii=False) + "\n"


def error_line(custom_id: str | None, line: int, code: str, message: str) -> str:
    """The output line (with its newline) of an input line that is not a request."""
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                       "response": None,
                       "error": {"code": code, "message": message, "line": line}},
                      ensure_ascii=False) + "\n"


@dataclasses.dataclass
class Finished:
    """What an earlier run of the same batch already wrote: the custom_ids with a result,
    and the line numbers of lines answered by an error line."""

    custom_ids: set[str] = dataclasses.field(default_factory=set)
    lines: set[int] = dataclasses.field(default_factory=set)

    def __len__(self) -> int:
        return len(self.custom_ids) + len(self.lines)


def scan_results(path: str | Path) -> Finished:
    """The results already in the output file `path` (none if it does not exist). A last
    line cut short by an interrupt (no newline, or not JSON) is removed from the file, so
    that the request is run again and the file stays JSON lines. Raises BatchFileError if
    the file cannot be read or an earlier line is not a result line (the wrong file)."""
    done = Finished()
    path = Path(path)
    if not path.exists():
        return done
    try:
        with path.open("r+b") as f:
            good = 0
            for number, raw in enumerate(f, 1):
                try:
                    obj = json.loads(raw) if raw.endswith(b"\n") else None
                except ValueError:
                    obj = None
                if not isinstance(obj, dict) or "custom_id" not in obj:
                    if f.read(1):  # not the last line: this is not our output file
                        raise BatchFileError(
                            f"{path}: line {number} is not a batch result line; give a new "
                            "output file, or the one an earlier run of this batch wrote")
                    break
                error = obj.get("error")
                if isinstance(error, dict) and isinstance(error.get("line"), int):
                    done.lines.add(error["line"])
                elif isinstance(obj["custom_id"], str):
                    done.custom_ids.add(obj["custom_id"])
                good += len(raw)
            f.truncate(good)
    except OSError as e:
        raise BatchFileError(f"{path}: cannot read the output file: {e.strerror}") from None
    return done
