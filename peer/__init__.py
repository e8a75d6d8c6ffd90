"""The training peers: the `swarm-peer` command line, the volunteer role and the local-cluster role."""
