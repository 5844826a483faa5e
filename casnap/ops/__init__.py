"""Operations over a repository that never load a tensor.

History (log, diff, du), verify and retention.
"""
