"""The policy model: config presets, the NNX transformer, sharding, HF interop."""
