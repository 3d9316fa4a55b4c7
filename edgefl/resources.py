"""Files the package ships (models, profiles, data sets), found the same way in a checkout and a wheel.

A source checkout reaches them through ``edgefl/models`` etc. (symlinks to the top-level folders); an
installed wheel carries them as package data (setup.cfg ``package_data``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["shipped"]

_ROOT = Path(__file__).resolve().parent


def shipped(relative: str) -> Path:
    """The path of a file the package ships, e.g. ``shipped("models/digits_cnn_int8_rawin.tflite")``.

    Parameters
    ----------
    relative : str
        Path under the package, with ``/`` separators: ``models/...``, ``firmware_configs/...``,
        ``data/...``.

    Returns
    -------
    Path
        Absolute path (it may not exist when the wheel was built without that file).
    """
    return _ROOT / relative
