"""An exported package served over HTTP (`tvmbert serve`): the layer over ``deploy``, never under
it. ``requests`` reads and checks a request's body, ``service`` computes each route's answer
(pooled as sentence-transformers pools, by ``deploy.sentences``), ``batcher`` merges concurrent requests
into runs of the package, ``metrics`` counts for Prometheus, ``openapi`` describes the API, ``app``
is the Starlette application (admission, clients that leave, errors as JSON 4xx), and ``run`` the
process (socket, uvicorn, signals). May import core and deploy; never torch."""
