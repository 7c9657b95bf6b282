"""dormouse: raw text corpus to a scored byte-level language model, one content-addressed stage at a time."""

__version__ = "0.1.0"
