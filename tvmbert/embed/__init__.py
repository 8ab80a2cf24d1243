"""A corpus embedded into Parquet (`tvmbert embed`): ``corpus`` reads texts from JSONL, CSV/TSV,
Parquet or text files (every bad row named by file and line), ``shards`` keeps the output in
shards written atomically and resumes from them, ``pipeline`` embeds a shard (sorted by length,
tokenized ahead in a thread, pooled as the package's sentence-transformers layer says) and runs
the job on this machine, ``on_ray`` runs the same shards on Ray Data actors. May import core and
deploy; never torch."""
