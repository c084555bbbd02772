"""kvloom's Triton MLA attention backend (``TRITON_MLA``).

Importing the package does not import Triton; the kernels load with the ops that launch them.
"""
