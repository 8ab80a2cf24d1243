"""A request's body read and checked before any of it reaches the model: each mistake is a
``RequestError`` (an ``InputError`` of the project's one hierarchy) carrying the 4xx it is
answered with and what was wrong, so that a bad request never costs more than its own answer."""

from __future__ import annotations

import json

from tvmbert.core.errors import InputError
from tvmbert.deploy.package import TRUNCATION_DIRECTIONS


class RequestError(InputError):
    """A request the server refuses: its HTTP status, what was wrong, and its kind (the JSON
    error's ``type``, OpenAI's names where they have one)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def too_large(message: str) -> RequestError:
    return RequestError(413, message, "payload_too_large")


async def read_json(request, max_bytes: int) -> dict:
    """The JSON object a request carries; refused whole when over ``max_bytes`` (by its declared
    Content-Length before a byte is read, or by counting as it streams in), not UTF-8, not JSON,
    nested past what the parser takes, or not an object."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise too_large(f"the body is over {max_bytes} bytes (Content-Length: {declared[:40]})")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(f"the body is over {max_bytes} bytes")
        chunks.append(chunk)
    try:
        payload = json.loads(b"".join(chunks).decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"the body is not UTF-8 (byte {exc.start})") from None
    except RecursionError:
        raise RequestError(400, "the body is not JSON this server reads: nested too deep") from None
    except ValueError as exc:  # JSONDecodeError, and numbers past Python's digit limit
        raise RequestError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise RequestError(400, f"the body must be a JSON object, got {type(payload).__name__}")
    return payload


def _inputs(value, field: str, single: bool, expected: str, max_inputs: int) -> list:
    """A request's inputs as a list: ``[value]`` where it was ``single``, else ``value``, which
    must be a non-empty list of at most ``max_inputs``; ``expected`` says what the field takes."""
    items = [value] if single else value
    if not isinstance(items, list) or not items:
        got = "nothing" if value is None else "an empty list" if value == [] else type(value).__name__
        raise RequestError(422, f"'{field}' must be {expected}, got {got}")
    if len(items) > max_inputs:
        raise too_large(f"'{field}' holds {len(items)} inputs; this server takes at most {max_inputs} a request")
    return items


def texts(payload: dict, field: str, max_inputs: int) -> list[str]:
    """``payload[field]``: a string or a non-empty list of strings (Unicode text: no lone
    surrogate), at most ``max_inputs`` of them."""
    value = payload.get(field)
    value = _inputs(value, field, isinstance(value, str), "a string or a non-empty list of strings", max_inputs)
    for index, text in enumerate(value):
        if not isinstance(text, str):
            raise RequestError(422, f"'{field}'[{index}] is a {type(text).__name__}: every input must be a string "
                               "(token ids are not taken)")
        unicode(f"'{field}'[{index}]", text)
    return value


def sequences(payload: dict, max_inputs: int) -> tuple[list[str | tuple[str, str]], bool]:
    """``payload["inputs"]`` as TEI's ``/predict`` reads it: a text, a pair ``[text, text_pair]``
    (an NLI premise and hypothesis, a reranker's query and passage), or a non-empty batch of them
    as lists (``[["text"], ["text", "pair"]]``). The sequences, a pair as a tuple, and whether it
    was one (answered with its own answer, not a list of them). A list of three or more strings
    is refused, as TEI refuses it: read as a batch, a list of two would have been one pair."""
    value = payload.get("inputs")
    single = isinstance(value, str) or (isinstance(value, list) and bool(value) and isinstance(value[0], str))
    items = _inputs(value, "inputs", single, "a text, a pair [text, text_pair], or a batch of them as lists "
                    "([[\"text\"], [\"text\", \"pair\"]])", max_inputs)
    found = []
    for index, item in enumerate(items):
        where = "'inputs'" if single else f"'inputs'[{index}]"
        parts = [item] if isinstance(item, str) and single else item
        if not isinstance(parts, list):
            problem = f"is a {type(item).__name__}"
        elif not all(isinstance(part, str) for part in parts):
            problem = "holds something other than strings"
        else:
            problem = "" if 1 <= len(parts) <= 2 else f"holds {len(parts)} strings"
        if problem:
            raise RequestError(422, f"{where} {problem}: an input is a text or a pair [text, text_pair], and a batch "
                               "a list of them as lists ([[\"text\"], [\"text\", \"pair\"]])")
        for number, part in enumerate(parts):
            unicode(f"{where}" + (f"[{number}]" if len(parts) > 1 or not single else ""), part)
        found.append(parts[0] if len(parts) == 1 else (parts[0], parts[1]))
    return found, single


def unicode(where: str, text: str) -> None:
    """Refuses a string that is not Unicode text (a lone surrogate, which JSON's \\u escapes allow)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(422, f"{where} holds a lone surrogate (\\u{ord(text[exc.start]):04x}) at {exc.start}: "
                           "not Unicode text") from None


def flag(payload: dict, field: str, default: bool) -> bool:
    value = payload.get(field, default)
    if not isinstance(value, bool):
        raise RequestError(422, f"'{field}' must be true or false, got {json.dumps(value)[:40]}")
    return value


def truncation(payload: dict) -> tuple[bool, str]:
    """TEI's ``truncate`` (false, or null, by default: a text over the largest bucket is a 413,
    never cut unasked) and ``truncation_direction`` (the end a cut text loses tokens from:
    "right", the default, or "left"; TEI's capitalized spellings too)."""
    truncate = False if payload.get("truncate") is None else flag(payload, "truncate", False)
    direction = payload.get("truncation_direction", "right")
    if not isinstance(direction, str) or direction.lower() not in TRUNCATION_DIRECTIONS:
        raise RequestError(422, f"'truncation_direction' must be {' or '.join(repr(d) for d in TRUNCATION_DIRECTIONS)}, "
                           f"got {json.dumps(direction)[:40]}")
    return truncate, direction.lower()


def choice(payload: dict, field: str, allowed: tuple[str, ...]) -> str:
    """``payload[field]``, one of ``allowed`` (the first when absent)."""
    value = payload.get(field, allowed[0])
    if value not in allowed or not isinstance(value, str):
        raise RequestError(422, f"'{field}' must be {' or '.join(repr(a) for a in allowed)}, got {json.dumps(value)[:40]}")
    return value


def optional_string(payload: dict, field: str) -> str | None:
    value = payload.get(field)
    if value is not None and not isinstance(value, str):
        raise RequestError(422, f"'{field}' must be a string, got {type(value).__name__}")
    return value


def string(payload: dict, field: str) -> str:
    """``payload[field]``, a string of Unicode text."""
    value = payload.get(field)
    if not isinstance(value, str):
        raise RequestError(422, f"'{field}' must be a string, got {'nothing' if value is None else type(value).__name__}")
    unicode(f"'{field}'", value)
    return value


def integer(payload: dict, field: str, default: int, low: int, high: int) -> int:
    """``payload[field]``, an integer in [low, high] (``default`` when absent)."""
    value = payload.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(422, f"'{field}' must be an integer from {low} to {high}, got {json.dumps(value)[:40]}")
    return value


def question_contexts(payload: dict, max_inputs: int) -> tuple[list[tuple[str, str]], bool]:
    """``payload["inputs"]``: one {"question", "context"} object or a non-empty list of them, as
    (question, context) pairs; and whether it was one object (answered with one answer)."""
    value = payload.get("inputs")
    single = isinstance(value, dict)
    items = _inputs(value, "inputs", single, "an object {\"question\": ..., \"context\": ...} or a non-empty list of them",
                    max_inputs)
    pairs = []
    for index, item in enumerate(items):
        where = "'inputs'" if single else f"'inputs'[{index}]"
        if not isinstance(item, dict):
            raise RequestError(422, f"{where} must be an object with a question and a context, got {type(item).__name__}")
        for key in ("question", "context"):
            if not isinstance(item.get(key), str):
                raise RequestError(422, f"{where}.{key} must be a string, got {type(item.get(key)).__name__}")
            unicode(f"{where}.{key}", item[key])
        if not item["question"].strip():
            raise RequestError(422, f"{where}.question is empty")
        pairs.append((item["question"], item["context"]))
    return pairs, single
