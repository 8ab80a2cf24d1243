"""The API described: an OpenAPI 3 document (``/openapi.json``, for client generators) and a page
a person reads (``/docs``), written from the same table, so they cannot disagree. Self-contained:
the page loads nothing from elsewhere (a server may have no way out)."""

from __future__ import annotations

import html
import json

TEXTS = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]}
ERROR = {"type": "object", "required": ["error", "type"], "properties": {"error": {"type": "string"}, "type": {"type": "string"}}}
QUESTION = {"type": "object", "required": ["question", "context"],
            "properties": {"question": {"type": "string"}, "context": {"type": "string"}}}
ANSWER = {"type": "object", "nullable": True, "properties": {"answer": {"type": "string"}, "score": {"type": "number"},
                                                              "start": {"type": "integer"}, "end": {"type": "integer"}}}
VECTORS = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
# TEI's: a text, a pair [text, text_pair], or a batch of them as lists.
SEQUENCE = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2}
SEQUENCES = {"oneOf": [{"type": "string"}, SEQUENCE, {"type": "array", "items": SEQUENCE, "minItems": 1}]}
TRUNCATION = {"truncate": {"type": "boolean", "default": False, "nullable": True},
              "truncation_direction": {"enum": ["right", "left", "Right", "Left"], "default": "right"}}
DIMENSIONS = {"dimensions": {"type": "integer", "minimum": 1, "nullable": True,
                             "description": "the first N dimensions (a Matryoshka model's), normalized after the cut"}}
PROMPT = {"prompt_name": {"type": "string", "nullable": True,
                          "description": "a key of the model's config_sentence_transformers.json prompts (GET /info lists them)"}}
TOKEN = {"type": "object", "properties": {"id": {"type": "integer"}, "text": {"type": "string"}, "special": {"type": "boolean"},
                                          "start": {"type": "integer", "nullable": True}, "stop": {"type": "integer", "nullable": True}}}
IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
LABELS = {"type": "array", "items": {"type": "object", "properties": {"label": {"type": "string"}, "score": {"type": "number"}}}}

# (method, path, summary, request body schema or None, answer schema)
ROUTES = (
    ("post", "/v1/embeddings", "OpenAI's embeddings: unit-length vectors where the model's config normalizes; base64 is "
     "little-endian float32",
     {"type": "object", "required": ["input"], "properties": {
         "input": TEXTS, "model": {"type": "string"}, "encoding_format": {"enum": ["float", "base64"], "default": "float"},
         **DIMENSIONS}},
     {"type": "object", "properties": {
         "object": {"enum": ["list"]}, "model": {"type": "string"},
         "data": {"type": "array", "items": {"type": "object", "properties": {
             "object": {"enum": ["embedding"]}, "index": {"type": "integer"},
             "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}},
         "usage": {"type": "object", "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}}),
    ("post", "/embed", "TEI's embed: one vector per input; truncate cuts a text to the package's longest input",
     {"type": "object", "required": ["inputs"], "properties": {
         "inputs": TEXTS, "normalize": {"type": "boolean", "default": True}, **TRUNCATION, **PROMPT, **DIMENSIONS}},
     VECTORS),
    ("post", "/tokenize", "TEI's tokenize: per input, its tokens; a special token's offsets null, another's byte offsets into "
     "the input (with the prompt)",
     {"type": "object", "required": ["inputs"], "properties": {
         "inputs": TEXTS, "add_special_tokens": {"type": "boolean", "default": True}, **PROMPT}},
     {"type": "array", "items": {"type": "array", "items": TOKEN}}),
    ("post", "/decode", "TEI's decode: token ids back to text, one string per list of ids",
     {"type": "object", "required": ["ids"], "properties": {
         "ids": {"oneOf": [IDS, {"type": "array", "items": IDS, "minItems": 1}]},
         "skip_special_tokens": {"type": "boolean", "default": True}}},
     {"type": "array", "items": {"type": "string"}}),
    ("post", "/predict", "TEI's predict, for a sequence classifier: per input (a text or a pair), every label with its "
     "score, most likely first: a softmax over the labels, a lone label's sigmoid, or the logits with raw_scores; one "
     "input's list, or a batch's list of them",
     {"type": "object", "required": ["inputs"], "properties": {
         "inputs": SEQUENCES, **TRUNCATION, "raw_scores": {"type": "boolean", "default": False}}},
     {"oneOf": [LABELS, {"type": "array", "items": LABELS}]}),
    ("post", "/rerank", "TEI's rerank, for a cross-encoder (a sequence classifier of one label): each text scored as the "
     "pair (query, text), the sigmoid of its logit (raw_scores: the logit), best first",
     {"type": "object", "required": ["query", "texts"], "properties": {
         "query": {"type": "string"}, "texts": TEXTS, **TRUNCATION,
         "raw_scores": {"type": "boolean", "default": False}, "return_text": {"type": "boolean", "default": False}}},
     {"type": "array", "items": {"type": "object", "properties": {
         "index": {"type": "integer"}, "score": {"type": "number"}, "text": {"type": "string"}}}}),
    ("post", "/classify_tokens", "For a token classifier: per input, its entities as transformers' token-classification "
     "pipeline finds them; simple groups B-/I- tags into entities, none gives each token not labelled O",
     {"type": "object", "required": ["inputs"], "properties": {
         "inputs": TEXTS, "aggregation_strategy": {"enum": ["simple", "none"], "default": "simple"},
         "truncate": {"type": "boolean", "default": False}}},
     {"type": "array", "items": {"type": "array", "items": {"type": "object", "properties": {
         "entity_group": {"type": "string"}, "entity": {"type": "string"}, "score": {"type": "number"},
         "index": {"type": "integer"}, "word": {"type": "string"}, "start": {"type": "integer"}, "end": {"type": "integer"}}}}}),
    ("post", "/answer", "For a question-answering model: the likeliest span of each context, as transformers' pipeline "
     "finds it, a long context read in windows sharing doc_stride tokens; one answer per input, a list where top_k > 1, "
     "null where no span qualifies",
     {"type": "object", "required": ["inputs"], "properties": {
         "inputs": {"oneOf": [QUESTION, {"type": "array", "items": QUESTION, "minItems": 1}]},
         "top_k": {"type": "integer", "default": 1, "minimum": 1, "maximum": 100},
         "max_answer_len": {"type": "integer", "default": 15, "minimum": 1},
         "doc_stride": {"type": "integer", "default": 128, "minimum": 0},
         "align_to_words": {"type": "boolean", "default": True}}},
     {"oneOf": [ANSWER, {"type": "array", "items": {"oneOf": [ANSWER, {"type": "array", "items": ANSWER}]}}]}),
    ("get", "/health", "200 once the package is loaded and the batcher runs", None, {"type": "object"}),
    ("get", "/info", "The model, dtype, target key, buckets, pooling, labels and limits", None, {"type": "object"}),
    ("get", "/metrics", "Prometheus text: requests by route and status, queue and compute time, batch sizes and tokens",
     None, {"type": "string"}),
)
REFUSALS = {"400": "a body that is not UTF-8 JSON of an object, or a route this package's model has no output for",
            "413": "over a limit: the body, the inputs a request, or a text's tokens (unless truncate)",
            "422": "a field of the wrong type or value", "429": "more requests in flight than --max-concurrent-requests"}


UNAUTHORIZED = "a missing or wrong API key, where the server has one (--api-key): every route but /health wants it"


def _operation(path: str, summary: str, body: dict | None, answer: dict) -> dict:
    responses = {"200": {"description": "OK", "content": {"application/json": {"schema": answer}}}}
    if body is not None:
        responses |= {code: {"description": why, "content": {"application/json": {"schema": ERROR}}} for code, why in REFUSALS.items()}
    if path != "/health":
        responses["401"] = {"description": UNAUTHORIZED, "content": {"application/json": {"schema": ERROR}}}
    operation = {"summary": summary, "responses": responses}
    if path == "/health":
        operation["security"] = []  # no key, whatever the server's
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return operation


def document() -> dict:
    paths: dict = {}
    for method, path, summary, body, answer in ROUTES:
        paths.setdefault(path, {})[method] = _operation(path, summary, body, answer)
    return {"openapi": "3.0.3", "info": {"title": "tvmbert serve", "version": "1"}, "paths": paths,
            "components": {"securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": UNAUTHORIZED}}},
            "security": [{}, {"apiKey": []}]}  # a key where the server has one


def page(model: str) -> str:
    rows = "".join(f"<h2><code>{method.upper()} {path}</code></h2><p>{html.escape(summary)}</p>"
                   + (f"<pre>{html.escape(json.dumps(body, indent=1))}</pre>" if body else "")
                   for method, path, summary, body, _ in ROUTES)
    refusals = "".join(f"<li>{code}: {html.escape(why)}</li>" for code, why in REFUSALS.items())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>tvmbert serve: {html.escape(model)}</title></head><body>"
            f"<h1>tvmbert serve: {html.escape(model)}</h1>{rows}<h2>Refusals</h2><p>Each is one JSON object "
            f"<code>{{\"error\": ..., \"type\": ...}}</code>:</p><ul>{refusals}</ul>"
            "<p><a href='/openapi.json'>openapi.json</a></p></body></html>")
