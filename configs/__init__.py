"""Run configs: one `get_config(arg=None)` per file (ml_collections), loaded by path."""
