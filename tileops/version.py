"""The package version, importable without pulling in torch or TileLang."""

__version__ = "0.1.0"
