"""The in-memory peer tier under the durable checkpoints (docs/recovery.md): every PEER_EVERY
steps each rank's state goes into host memory on another node of the run (store.py, a small
process beside the node's agent), and after a loss the new world restores the newest step every
rank can get from a peer, its disk or the bucket (tier.py)."""
