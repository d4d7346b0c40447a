"""Benchmarks against running OpenAI-compatible servers: load generator, metrics (TTFT,
TPOT, ITL, E2E, SLO attainment, goodput), JSON results and plots drawn from them."""
