"""Request workloads: trace loaders (Azure 2023 conv/code, BurstGPT), the papers' filters,
arrival processes, length scaling and multi-model popularity. Pure Python + numpy."""
