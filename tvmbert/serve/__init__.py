"""An exported package served over HTTP (`tvmbert serve`): the layer over ``deploy``, never under
it. Concurrent requests are merged into batches (``batcher``), embeddings pooled as
sentence-transformers pools them (``pooling``), and the HTTP API (``app``: OpenAI's and TEI's
embedding routes, a classifier's predictions, health, info, Prometheus metrics) turns every
error into a 4xx with a JSON body. May import core and deploy; never torch."""
