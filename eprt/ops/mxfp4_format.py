"""The MXFP4 storage format (OCP microscaling): blocks of 32 e2m1 values sharing one e8m0 scale."""

from __future__ import annotations

import numpy as np

MXFP4_BLOCK = 32  # weights per e8m0 scale
# e2m1 code -> value (bit 3 the sign): the low nibble of a byte is the even element
FP4_VALUES = np.asarray(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
