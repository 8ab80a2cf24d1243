"""What serves a built model, with NumPy and TVM's runtime only (never torch): the library loader
(this CPU's instruction sets checked first), input checks, the weights' file format, token
packing, an exported package (``tvmbert.load``), its sentence-transformers layer (``sentences``: pooling,
Matryoshka sizes, quantized vectors) and a single build loaded. May import core."""
