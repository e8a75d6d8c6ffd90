"""Training that knows nothing of the swarm: the model (the only caller of timm), the data, checkpoints, the
batch-size search, GPU and CPU figures, and the TensorBoard logbook. Imports only the base modules of
``swarm``."""
