"""The monitor peer: reads the swarm's metrics from the DHT, writes TensorBoard, keeps the best checkpoint."""
