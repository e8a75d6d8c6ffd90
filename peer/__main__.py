"""`python -m peer ...` is the same as `swarm-peer ...` (useful under torchrun and in tests)."""

from peer.cli import main

main()
