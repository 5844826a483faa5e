"""Reading snapshots back: restore and read_object, resharding of sharded entries, numeric drift."""
