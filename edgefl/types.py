"""Array type aliases shared by every module (defined once, per the house style)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]
U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
