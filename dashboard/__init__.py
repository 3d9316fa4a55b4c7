"""edgefl dashboard: one aiohttp app serving an HTML page, JSON, SSE and Prometheus metrics."""
