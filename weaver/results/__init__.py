"""Run records and serving metrics, shared by the benchmarks (`weaver.bench`, which measure)
and the simulator (`weaver.sim`, which predicts): ``records`` is the JSON schema of a
results file, ``metrics`` the summaries computed from its per-request records."""
