"""The request record every workload produces and every consumer (load generator,
simulator) reads. Times are seconds from the start of the workload; lengths are tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # when the request is sent, seconds after the workload starts
    input_tokens: int  # prompt length in tokens
    output_tokens: int  # tokens to generate (sent as max_tokens with ignore_eos)
    model: str = ""  # API model name; "" until a workload assigns models
    request_id: int = 0  # position in the workload, stable across runs of one seed
