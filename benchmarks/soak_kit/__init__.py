"""The parts of benchmarks/soak.py, one job each: what a request's end means (outcomes), the
verdict, the engines and roles read from /health (engines), the kills (killer), what is
sampled while it runs (watch), the server's lives and restarts (server), the plain
`vllm serve` phase (plain_vllm) and the plot (plot). outcomes, verdict and engines are pure
and tested in tests/bench/test_soak_verdict.py; the rest drives real processes."""
