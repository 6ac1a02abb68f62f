"""The packed forward: packed batches, the one model engine and its heads, attention backends, stateful
layers, ranks in lockstep and sequence parallelism."""
