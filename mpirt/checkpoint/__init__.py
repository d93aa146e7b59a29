"""State on disk: versioned checkpoints (store), each rank writing its own shards (sharded), the
tensor file format (tensorfile) and ``python -m mpirt.checkpoint`` (cli)."""
