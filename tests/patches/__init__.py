"""A before/after test per change to hivemind (swarm/patches): each shows the failure on plain hivemind
and its absence with the change, on real DHTs and averager processes on 127.0.0.1."""
