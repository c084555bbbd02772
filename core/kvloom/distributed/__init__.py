"""Tensor-parallel state and collectives (``parallel_state``)."""
