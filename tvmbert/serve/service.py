"""What each route computes, apart from HTTP: a request's texts tokenized, merged into a batch
with other requests', pooled as the model's sentence-transformers config pools them (export
records it), and shaped as OpenAI's or TEI's answer."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import asdict, dataclass

import numpy as np

from tvmbert.core.errors import InputError
from tvmbert.deploy import sentences
from tvmbert.deploy.sentences import MODES
from tvmbert.serve import heads, requests
from tvmbert.serve.batcher import Batcher
from tvmbert.serve.metrics import Metrics
from tvmbert.serve.requests import RequestError


@dataclass(frozen=True)
class Limits:
    max_batch_tokens: int = 16384  # rows x longest row merged into one run (TEI's default)
    max_wait_ms: float = 0.0  # how long a request may wait for others to join its batch
    max_concurrent_requests: int = 512  # in flight at once; beyond, 429
    max_inputs_per_request: int = 256  # texts in one request; beyond, 413
    max_body_bytes: int = 2 * 2**20  # a request's body; beyond, 413


class Service:
    """The model, its batcher, the limits and the metrics the routes share."""

    def __init__(self, model, limits: Limits, pooling: str | None = None, served_name: str | None = None):
        if limits.max_batch_tokens < model.max_seq_len:
            raise InputError(f"--max-batch-tokens {limits.max_batch_tokens} is below the package's longest input "
                             f"({model.max_seq_len} tokens): one such text could never run")
        tokenizer = model.tokenizer()  # a package without one (or without the tokenizers package) is refused at start, not per request
        unknown = getattr(tokenizer.model, "unk_token", None)
        self._unknown_id = tokenizer.token_to_id(unknown) if unknown else None  # entities say the text for it
        self._join_tokens = tokenizer.decoder.decode if tokenizer.decoder is not None else " ".join  # an entity's word
        self.model, self.limits, self.metrics = model, limits, Metrics()
        packaged_pooling, self.normalize_default = sentences.recorded_pooling(model.manifest)
        self.pooling = pooling or packaged_pooling
        if self.pooling not in MODES:
            raise InputError(f"--pooling must be one of {', '.join(MODES)}, got '{self.pooling}'")
        self.prompts, _ = sentences.recorded_prompts(model.manifest)  # TEI applies no default one unasked
        self.labels = model.manifest.get("labels")
        self.served_name = served_name or model.path.resolve().name
        self.task = model.task
        # The vectors' size, what 'dimensions' may not pass: one short run at start (it warms up too).
        self.hidden_size = sentences.vector_size(model) if self.task == "feature-extraction" else None
        self.batcher: Batcher | None = None

    def start(self) -> None:
        """On the event loop that serves: the batcher's task lives there."""
        self.batcher = Batcher(self.model.run_encodings, self.limits.max_batch_tokens, self.limits.max_wait_ms / 1000, self.metrics)
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()

    async def _tokenized(self, texts: list, truncation: tuple[bool, str]) -> list:
        """The texts' encodings, off the event loop. A text over the largest bucket is a 413,
        unless ``truncation`` (``requests.truncation``: whether to cut, and from which end) cuts it."""
        try:
            return await asyncio.to_thread(self.model.tokenize, texts, *truncation)
        except InputError as exc:
            raise requests.too_large(f"{exc} (or send \"truncate\": true)") from None

    async def outputs(self, texts: list, truncation: tuple[bool, str]) -> tuple[dict, int]:
        """The package's outputs for ``texts`` (strings, or pairs as tuples), run in a batch with
        other requests', and their token count."""
        encodings = await self._tokenized(texts, truncation)
        return await self.batcher.submit(encodings), sum(len(e.ids) for e in encodings)

    async def vectors(self, payload: dict, field: str, normalize: bool, truncation: tuple[bool, str]) -> tuple[np.ndarray, int]:
        """One pooled vector per text of ``payload[field]`` (after the request's ``prompt_name``'s
        prompt), cut to its ``dimensions`` (a Matryoshka model's smaller sizes) before
        ``normalize``, as TEI and sentence-transformers cut; and their token count."""
        self._needs("feature-extraction", "gives no last_hidden_state, so no embeddings: export the encoder")
        texts = requests.texts(payload, field, self.limits.max_inputs_per_request)
        prompt = self._prompt(payload)
        dimensions = payload.get("dimensions")
        if dimensions is not None:
            dimensions = requests.integer(payload, "dimensions", None, 1, self.hidden_size)
        outputs, tokens = await self.outputs([prompt + text for text in texts], truncation)
        return sentences.sentence_vectors(outputs["last_hidden_state"], self.pooling, normalize, dimensions), tokens

    def _prompt(self, payload: dict) -> str:
        """TEI's ``prompt_name``: a key of the model's config_sentence_transformers.json prompts,
        whose text goes before every input; none by default."""
        name = requests.optional_string(payload, "prompt_name")
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise RequestError(422, f"'prompt_name' {name!r} is not one of this model's prompts ({known})")
        return self.prompts[name]

    # ---- the routes' bodies in, their answers out ---------------------------------------------

    async def openai_embeddings(self, payload: dict) -> dict:
        """OpenAI's ``POST /v1/embeddings``: float32 vectors as numbers, or as base64 of their
        little-endian bytes (what the OpenAI client asks for by default)."""
        encoding = requests.choice(payload, "encoding_format", ("float", "base64"))
        model = requests.optional_string(payload, "model")
        vectors, tokens = await self.vectors(payload, "input", self.normalize_default, (False, "right"))
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64" else v.tolist()}
                for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": model or self.served_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def embed(self, payload: dict) -> list:
        """TEI's ``POST /embed``."""
        normalize = requests.flag(payload, "normalize", True)
        vectors, _ = await self.vectors(payload, "inputs", normalize, requests.truncation(payload))
        return [v.tolist() for v in vectors]

    async def tokenize(self, payload: dict) -> list:
        """TEI's ``POST /tokenize``: per input, its tokens as the model's tokenizer cuts them
        (``add_special_tokens``, default true; ``prompt_name``'s prompt first), each
        ``{"id", "text", "special", "start", "stop"}``: a special token's text is the token and its
        offsets null; another's are byte offsets into the input, as TEI gives them (equal to
        character offsets in ASCII), its text those bytes."""
        texts = requests.texts(payload, "inputs", self.limits.max_inputs_per_request)
        special = requests.flag(payload, "add_special_tokens", True)
        prompt = self._prompt(payload)
        tokenizer = self.model.tokenizer()
        encodings = await asyncio.to_thread(tokenizer.encode_batch, [prompt + text for text in texts], add_special_tokens=special)
        return [_tokens(prompt + text, encoding) for text, encoding in zip(texts, encodings)]

    async def decode(self, payload: dict) -> list[str]:
        """TEI's ``POST /decode``: token ids (a list, or a list of lists) back to text, special
        tokens left out unless ``skip_special_tokens`` is false."""
        ids = payload.get("ids")
        batch = ids if isinstance(ids, list) and ids and all(isinstance(row, list) for row in ids) else [ids]
        vocab = self.model.tokenizer().get_vocab_size()
        for index, row in enumerate(batch):
            if not isinstance(row, list) or not row or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
                                                                for i in row):
                raise RequestError(422, f"'ids'{'' if len(batch) == 1 else f'[{index}]'} must be a non-empty list of token ids "
                                   f"from 0 to {vocab - 1} (or a list of such lists)")
        if len(batch) > self.limits.max_inputs_per_request:
            raise requests.too_large(f"'ids' holds {len(batch)} inputs; this server takes at most "
                                     f"{self.limits.max_inputs_per_request} a request")
        skip = requests.flag(payload, "skip_special_tokens", True)
        return await asyncio.to_thread(self.model.tokenizer().decode_batch, batch, skip_special_tokens=skip)

    async def predict(self, payload: dict) -> list:
        """TEI's ``POST /predict`` for a sequence classifier: per input (a text, or a pair such as
        an NLI premise and hypothesis), every label with its score (``heads.label_scores``), most
        likely first; one input's answer is that list, a batch's a list of them, as TEI's."""
        self._needs("text-classification", "is not a sequence classifier: export one whose config names a "
                    "...ForSequenceClassification")
        truncation = requests.truncation(payload)
        raw = requests.flag(payload, "raw_scores", False)
        sequences, single = requests.sequences(payload, self.limits.max_inputs_per_request)
        outputs, _ = await self.outputs(sequences, truncation)
        scores = heads.label_scores(outputs["logits"], raw)
        names = self._label_names(scores.shape[1])
        answers = [[{"label": names[i], "score": float(row[i])} for i in heads.best_first(row)] for row in scores]
        return answers[0] if single else answers

    async def rerank(self, payload: dict) -> list:
        """TEI's ``POST /rerank`` for a cross-encoder (a sequence classifier of one label): each
        text scored as the pair (query, text), the sigmoid of its logit (``raw_scores``: the
        logit), best first: ``[{"index", "score"}]``, with ``"text"`` where ``return_text``."""
        self._needs("text-classification", "is not a sequence classifier: export a cross-encoder, one whose config "
                    "names a ...ForSequenceClassification of one label")
        if self.labels and len(self.labels) != 1:
            raise self._not_a_reranker(len(self.labels))
        query = requests.string(payload, "query")
        texts = requests.texts(payload, "texts", self.limits.max_inputs_per_request)
        truncation = requests.truncation(payload)
        raw = requests.flag(payload, "raw_scores", False)
        return_text = requests.flag(payload, "return_text", False)
        outputs, _ = await self.outputs([(query, text) for text in texts], truncation)
        if outputs["logits"].shape[1] != 1:  # a package whose config named no labels: known once it ran
            raise self._not_a_reranker(outputs["logits"].shape[1])
        scores = heads.label_scores(outputs["logits"], raw)[:, 0]
        return [{"index": int(i), "score": float(scores[i]), **({"text": texts[i]} if return_text else {})}
                for i in heads.best_first(scores)]

    def _not_a_reranker(self, labels: int) -> RequestError:
        return RequestError(400, f"this package's classifier has {labels} labels; /rerank scores with a cross-encoder's "
                            "one (use /predict with [text, text_pair] inputs)", "unsupported")

    async def classify_tokens(self, payload: dict) -> list:
        """Per text, its entities as transformers' token-classification pipeline finds them
        (``aggregation_strategy`` simple: B-/I- tags grouped; none: each token), character
        offsets into the text."""
        self._needs("token-classification", "is not a token classifier: export one whose config names a "
                    "...ForTokenClassification")
        aggregation = requests.choice(payload, "aggregation_strategy", heads.AGGREGATIONS)
        truncate = requests.flag(payload, "truncate", False)
        texts = requests.texts(payload, "inputs", self.limits.max_inputs_per_request)
        encodings = await self._tokenized(texts, (truncate, "right"))
        outputs = await self.batcher.submit(encodings)
        names = self._label_names(outputs["logits"][0].shape[-1])
        return [heads.token_entities(text, encoding, logits, names, aggregation, self._join_tokens, self._unknown_id)
                for text, encoding, logits in zip(texts, encodings, outputs["logits"])]

    async def answer(self, payload: dict):
        """Extractive question answering as transformers' pipeline does it: the likeliest spans
        of the context (one, or a list of ``top_k``), a long context read in overlapping windows
        (``doc_stride`` tokens shared). ``inputs`` one {question, context} object, or a list."""
        self._needs("question-answering", "is not a question-answering model: export one whose config names a "
                    "...ForQuestionAnswering")
        pairs, single = requests.question_contexts(payload, self.limits.max_inputs_per_request)
        top_k = requests.integer(payload, "top_k", 1, 1, 100)
        max_answer_len = requests.integer(payload, "max_answer_len", 15, 1, 1 << 20)
        stride = requests.integer(payload, "doc_stride", 128, 0, 1 << 20)  # at most half a window, whatever is asked
        align_to_words = requests.flag(payload, "align_to_words", True)
        try:
            windows = await asyncio.to_thread(lambda: [self.model.tokenize_windows(q, c, stride) for q, c in pairs])
        except InputError as exc:
            raise requests.too_large(str(exc)) from None
        count = sum(map(len, windows))
        if count > self.limits.max_inputs_per_request:
            raise requests.too_large(f"the contexts make {count} windows of {self.model.max_seq_len} tokens; this server runs "
                                     f"at most {self.limits.max_inputs_per_request} a request")
        outputs = await self.batcher.submit([encoding for window in windows for encoding in window])
        found, first = [], 0
        for (_, context), window in zip(pairs, windows):
            rows = slice(first, first + len(window))
            best = heads.answers(context, window, outputs["start_logits"][rows], outputs["end_logits"][rows], top_k, max_answer_len,
                                 align_to_words)
            found.append(best if top_k > 1 else best[0] if best else None)
            first += len(window)
        return found[0] if single else found

    def _needs(self, task: str, what: str) -> None:
        if self.task != task:
            raise RequestError(400, f"this package's model ({self.task}) {what} (--task {task})", "unsupported")

    def _label_names(self, count: int) -> list[str]:
        """config.json's id2label where the package recorded as many; LABEL_i otherwise, as transformers names them."""
        return self.labels if self.labels and len(self.labels) == count else [f"LABEL_{i}" for i in range(count)]

    def info(self) -> dict:
        model = self.model
        return {"model": self.served_name, "source": model.manifest["model"]["name"], "dtype": model.manifest.get("dtype"),
                "target": model.variant["target_key"], "task": self.task, "outputs": list(model.output_names),
                "buckets": [{"batch": b.batch, "seq_len": b.seq_len, **({"tokens": b.tokens} if b.tokens else {})} for b in model.buckets],
                "max_input_tokens": model.max_seq_len, "pooling": self.pooling, "normalize": self.normalize_default,
                "prompts": self.prompts,
                "labels": self.labels, "limits": asdict(self.limits)}


def _tokens(text: str, encoding) -> list[dict]:
    """An encoding's tokens as TEI's /tokenize gives them (``tokenization.rs``' into_tokens)."""
    data = text.encode("utf-8")
    byte_at = np.cumsum([0, *(len(c.encode("utf-8")) for c in text)])  # a character offset's byte offset
    found = []
    for token_id, token, special, (start, end) in zip(encoding.ids, encoding.tokens, encoding.special_tokens_mask, encoding.offsets):
        if special:
            found.append({"id": token_id, "text": token, "special": True, "start": None, "stop": None})
        else:
            first, last = int(byte_at[start]), int(byte_at[end])
            found.append({"id": token_id, "text": data[first:last].decode("utf-8", "replace"), "special": False, "start": first,
                          "stop": last})
    return found
