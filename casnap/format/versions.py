"""The format versions casnap writes and reads (docs/format.md).

A manifest is written in the oldest version that can hold it
(:func:`casnap.format.manifest.format_version_for`), so a repository stays
readable by older readers until it uses what they cannot read.
"""

from __future__ import annotations

FORMAT_MAJOR = 1
FORMAT_VERSION = "1.1"  # 1.1 added the "sharded" entry kind; 1.0 is still read
# 1.2 added a tensor's ``quantized`` field. Only a manifest that uses it says 1.2
# (:func:`casnap.format.manifest.format_version_for`), so every other manifest
# stays readable by 1.1 readers.
QUANTIZED_FORMAT_VERSION = "1.2"
# 2.0 added delta chunks (a chunk reference's ``base``). A reader of major 1
# must refuse such a manifest rather than read a delta frame as damage, so only
# a manifest that holds a delta says 2.0; every other manifest is written as before.
DELTA_FORMAT_VERSION = "2.0"
MANIFEST_MAJORS = (1, 2)  # what this casnap reads; the config stays major 1
# 1.3 added ``rank_groups``: entries that several ranks hold as one value are written
# once, with the ranks holding them (a distributed take of 1,024 ranks otherwise writes
# its sharded entries 1,024 times). Only distributed takes write 1.3 (docs/format.md).
GROUPED_FORMAT_VERSION = "1.3"
# 1.4 added a shard record's ``quantized`` field (the shards of a sharded tensor that
# ``_custom_tensor_prepare_func`` quantized). Only a manifest that uses it says 1.4.
QUANTIZED_SHARDS_FORMAT_VERSION = "1.4"


def version_at_least(version: str, than: str) -> bool:
    """Whether ``version`` is ``than`` or later; False for a malformed version.

    Example::

        >>> version_at_least("1.3", GROUPED_FORMAT_VERSION)
        True
    """
    try:
        return tuple(map(int, version.split("."))) >= tuple(map(int, than.split(".")))
    except ValueError:
        return False
