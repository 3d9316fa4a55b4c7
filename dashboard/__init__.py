"""edgefl dashboard: one aiohttp app serving an HTML page, JSON, SSE and Prometheus metrics."""

from edgefl.dashboard.aiohttp_server import defer_client

# before anything imports aiohttp: the dashboard serves, so aiohttp's client stays unloaded unless
# someone uses it (edgefl.dashboard.aiohttp_server)
defer_client()
