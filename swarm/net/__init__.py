"""Networking and trust: this process's node in the swarm (its DHT and p2p daemon), the dial-back check,
invites and their revocation, the fence around the averagers, the settings every peer must share, and the
signed records in the DHT. Imports the base modules of ``swarm``, ``swarm.patches`` and ``swarm.training``."""
