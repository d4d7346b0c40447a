"""A two-process decode without vLLM: the weaving runtime (weaver/weaving/hot.py, cold.py)
end to end over either offload transport (benchmarks/two_process_decode.py drives it).

- ``tiny_llama``: a Llama-shaped decoder with seeded random weights in plain torch, its
  attention a callable so a run decides where each sequence's KV lives;
- ``paged_batch``: sequences, their blocks and one step's batch: slots, and the rows of
  each placement as the attention backend hands them to ``HotWeaving`` (``StepRows``);
- ``reference_ops``: hot.py's ``AttentionOps`` over the pure-torch oracle
  (weaver/offload/reference_attention.py, the region's "pages" KV format);
- ``decoder``: greedy decoding of a batch, all local or woven through ``HotWeaving``;
- ``cold_side``: the cold process (its own model, poll points, ``ColdWeaving``).

Imports no vLLM, pydantic or yaml: the GPU machine that proves the CUDA path has none.
"""
