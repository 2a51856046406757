"""deepinfer-spec."""

__version__ = "0.1.0"
