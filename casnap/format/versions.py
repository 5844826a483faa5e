"""The one format version casnap writes and reads (docs/format.md, "Version").

Every manifest and config says ``FORMAT_VERSION``; a reader refuses any other
(:func:`casnap.format.parse.check_version`), whatever the document holds.
"""

from __future__ import annotations

from typing import Final, Literal

FORMAT_VERSION: Final = "1.0"
Version = Literal["1.0"]  # the type of a format_version field: FORMAT_VERSION only
