"""The library that every role shares: config, model, data, DHT, metrics, checkpoints, strategy."""
