"""edgefl dashboard: one aiohttp app serving an HTML page, JSON, SSE and Prometheus metrics."""

if __name__ != "edgefl.dashboard":  # the checkout's folder is not a second module
    raise ImportError(f"{__name__}: import edgefl.dashboard (setup.cfg maps dashboard/ under edgefl)")

from edgefl.dashboard.aiohttp_server import defer_client

# before anything imports aiohttp: the dashboard serves, so aiohttp's client stays unloaded unless
# someone uses it (edgefl.dashboard.aiohttp_server)
defer_client()
