"""The public face: Snapshot, Checkpointer and Repository, built on every layer below."""
