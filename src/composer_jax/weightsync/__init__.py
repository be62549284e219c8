"""Weight transfer from the trainer to the samplers. The versioned tensorstore weight store (base
snapshots plus XOR deltas): store.py, its format (layout, manifest, version naming, the
`WeightSyncError`) and the publishing contract; publisher.py, its writers for one process
(`WeightPublisher`) and the learner (`open_publisher`, `store_publisher`); sharded.py, the writer of
every process of a multi-host trainer (its own shards); subscriber.py, its reader
(`WeightSubscriber`, `read_shard`, `StoreWeights` for the serve side). nccl.py: NCCL transport to
running vLLM replicas."""
