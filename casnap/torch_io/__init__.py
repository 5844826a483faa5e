"""The torch layer below the pipelines: tensor bytes, state flattening, sharded values,
stateful helpers and the staging pool."""
