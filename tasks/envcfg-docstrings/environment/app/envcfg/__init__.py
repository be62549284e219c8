"""envcfg: layered INI-style configuration with ${VAR} interpolation."""
from .loader import load
from .settings import Settings

__all__ = ["load", "Settings"]
