"""OpenAI-style error bodies, the same shape vLLM's own ErrorResponse has."""

from __future__ import annotations

import json
from http import HTTPStatus

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    error = {
        "message": message,
        "type": _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error"),
        "param": param,
        "code": status,
    }
    return json.dumps({"error": error}).encode()
