"""The repository format as data: ids and names, the chunk codec, manifest models, tree walks.

No I/O and no torch: everything here is a pure function of bytes or models.
"""
