"""The OpenAPI 3.1 document of the server (`GET /openapi.json`), built from the declared
request and response models of `jaxserve.entrypoints.openai.protocol`.

Source: OpenAPI 3.1.0 specification; OpenAI API reference.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from jaxserve.entrypoints.openai.protocol import (ChatCompletionChunk, ChatCompletionRequest,
                                                  ChatCompletionResponse, CompletionChunk,
                                                  CompletionRequest, CompletionResponse,
                                                  DetokenizeRequest, EmbeddingRequest,
                                                  EmbeddingResponse, TokenizeRequest,
                                                  ErrorResponse, HealthResponse, ModelList)

_REF = "#/components/schemas/{model}"
_ERRORS = {"400": "Invalid request (the error's `param` names the field)",
           "401": "Missing or wrong API key (when the server requires one)",
           "404": "Unknown model (`model_not_found`) or route",
           "413": "Request body too large", "503": "Engine not running, or the queue is full"}


def openapi_schema(served_model_name: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the server serving `served_model_name`: POST
    /v1/completions and /v1/chat/completions (request bodies: the request models' JSON
    schema; 200: the response models, or `text/event-stream` of chunks ending in `data:
    [DONE]`; errors: ErrorResponse), GET /v1/models, /health, /ready, /metrics (text/plain).
    Every `$ref` points into `components/schemas`. Raises nothing.
    Source: OpenAPI 3.1.0 specification; OpenAI API reference.
    """
    models = [(m, "validation") for m in (CompletionRequest, ChatCompletionRequest,
                                          TokenizeRequest, DetokenizeRequest,
                                          EmbeddingRequest)] + \
        [(m, "serialization") for m in (CompletionResponse, CompletionChunk, ChatCompletionResponse,
                                        ChatCompletionChunk, ErrorResponse, ModelList,
                                        HealthResponse, EmbeddingResponse)]
    refs, defs = models_json_schema(models, ref_template=_REF)
    ref = {m: refs[(m, mode)] for m, mode in models}

    def json_content(model) -> dict:
        return {"application/json": {"schema": ref[model]}}

    errors = {code: {"description": text, "content": json_content(ErrorResponse)}
              for code, text in _ERRORS.items()}

    def post(summary: str, request, response, chunk, example: dict) -> dict:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": ref[request], "example": example}}},
            "responses": {"200": {"description": "The completion; with \"stream\": true, "
                                                 "server-sent events `data: <chunk>` ending "
                                                 "with `data: [DONE]`",
                                  "content": {**json_content(response), "text/event-stream": {
                                      "schema": {"type": "string"},
                                      "x-sse-data": ref[chunk]}}},
                          **errors}}}

    def get(summary: str, content: dict, *codes: str) -> dict:
        return {"get": {"summary": summary, "responses": {
            "200": {"description": "OK", "content": content},
            **{c: errors[c] for c in codes}}}}

    def tokens(summary: str, request, fields: dict) -> dict:
        body = {"type": "object", "properties": {k: {"type": t} for k, t in fields.items()}}
        return {"post": {"summary": summary, "requestBody": {
            "required": True, "content": {"application/json": {"schema": ref[request]}}},
            "responses": {"200": {"description": "OK", "content": {
                "application/json": {"schema": body}}}, **{c: errors[c] for c in ("400", "404")}}}}

    model = served_model_name
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve", "version": "1",
                 "description": f"OpenAI-compatible API serving `{model}`."},
        "paths": {
            "/v1/completions": post("Complete a prompt", CompletionRequest, CompletionResponse,
                                    CompletionChunk, {"model": model, "prompt": "Hello",
                                                      "max_tokens": 16}),
            "/v1/chat/completions": post(
                "Answer a chat", ChatCompletionRequest, ChatCompletionResponse,
                ChatCompletionChunk, {"model": model, "max_completion_tokens": 64,
                                      "messages": [{"role": "user", "content": "Hello"}]}),
            "/v1/embeddings": {"post": {
                "summary": "Embed inputs (with --pooling)",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": ref[EmbeddingRequest],
                    "example": {"model": model, "input": ["Hello", "Bonjour"]}}}},
                "responses": {"200": {"description": "OK",
                                      "content": json_content(EmbeddingResponse)},
                              **errors}}},
            "/v1/models": get("The served model", json_content(ModelList), "401"),
            "/health": get("Liveness and engine counters", json_content(HealthResponse), "503"),
            "/ready": get("Ready to serve", json_content(HealthResponse), "503"),
            "/metrics": get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
            "/tokenize": tokens("Token ids of a prompt or chat messages (vLLM's)",
                                TokenizeRequest, {"count": "integer", "max_model_len": "integer",
                                                  "tokens": "array", "token_strs": "array"}),
            "/detokenize": tokens("Text of token ids (vLLM's)", DetokenizeRequest,
                                  {"prompt": "string"}),
        },
        "components": {"schemas": defs.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{}, {"bearer": []}],
    }
