"""The read-only FUSE mount of published versions (``wagent mount``)."""
