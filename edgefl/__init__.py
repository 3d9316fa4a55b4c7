"""edgefl: federated last-layer training for small ARM gateways.

The installed distribution claims this one import name. ``edgefl.wire`` is the wire format,
``edgefl.agent`` the device, ``edgefl.coordinator`` rounds and aggregation, ``edgefl.dashboard`` the
pages; the modules beside them are shared by device and coordinator (errors, transport, records,
runtime, head...), and ``edgefl.cli`` is the composition root above them all (with ``evaluation``,
``launcher`` and ``demo``). ``agent/``, ``coordinator/`` and ``dashboard/`` are top-level folders
that setup.cfg's ``package_dir`` maps under ``edgefl``, in the wheel and the editable install alike.
"""

__version__ = "0.1.0"
