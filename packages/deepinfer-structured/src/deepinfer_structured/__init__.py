"""deepinfer-structured."""

__version__ = "0.1.0"
