"""The run's data: files, records, each stage's stream and the token cache.

  shards       sharded dataset files (JSONL, compressed JSONL, Parquet, ArrayRecord; local
               or gs://) read by position as one random-access source of raw rows
  readers      format adapters to the canonical records, whole and streamed readers, the
               resumable batch loader (`FORMATS`, `load`, `Records`, `Stream`, `Loader`)
  released     the released Nemotron-Cascade 1 and 2 datasets, read as they are downloaded
  stage_data   the held-out and validation sets in memory, each training stage's stream
  token_cache  a stage's data tokenized once, kept as ArrayRecord shards runs reuse

`python -m cascade.prepare` fills the token cache before a run (docs/data.md).
"""
