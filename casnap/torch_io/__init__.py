"""The torch layers: tensor bytes, state flattening, stateful helpers."""
