"""llguidance.torch stand-in: every name is the package's Missing type (see the package docstring)."""

from llguidance import __getattr__ as __getattr__
