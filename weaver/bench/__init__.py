"""Benchmarks against running OpenAI-compatible servers: a `weaver serve` process of one's
own (server_process), the load generator, runs and comparisons, plots drawn from saved
results. The results' schema and metrics are `weaver.results`, shared with the simulator."""
