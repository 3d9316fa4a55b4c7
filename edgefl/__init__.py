"""edgefl: federated last-layer training for small ARM gateways.

``edgefl.wire`` is the wire format, ``edgefl.agent`` the device, ``edgefl.coordinator`` rounds and
aggregation, ``edgefl.dashboard`` the pages (top-level folders mapped here by setup.cfg's
``package_dir``); the modules beside them are shared, and ``edgefl.cli`` composes them all.
"""

__version__ = "0.1.0"
