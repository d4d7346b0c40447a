"""The TPOT each finished hot sequence saw, rebuilt from the hot steps' times, for
`offload_ratio: auto` (weaver/weaving/placement.py): the tail that the woven steps' mean
does not show.

A running sequence takes part in every step of its engine, so one that finished with n
output tokens decoded over the last n - 1 steps, and its TPOT is their mean. The policy
holds the woven steps' mean to its target; that mean leaves room for the spread of long
sequences (a burst of prompt chunks is a few of their many steps), not of short ones.
Measured in the simulator (regime map, Llama-2-13B on A100-40GB, Azure code: prompts of
~840 tokens, a median of 14 output tokens, loose SLO 143 ms): the lent KV let a burst of
arrivals be prefilled at once instead of queueing, and a short sequence decoding through
it ran at the prompt steps' 240 ms; the woven steps' mean stayed at 93-118 ms, under the
121 ms target, while 20 % of the requests missed the SLO's TPOT (dedicated: 2.5 %).
"""

from __future__ import annotations

from collections import deque

import numpy as np

STEP_HISTORY = 2048  # hot steps kept; a longer decode is judged on these
MIN_SEQUENCES = 20  # sequences judged before their share over a TPOT is trusted


class TpotTail:
    """Finished sequences' TPOTs: those that decoded beside remote sequences (a woven step
    among theirs), wholly since the last `restart`."""

    def __init__(self) -> None:
        self._steps: deque[tuple[float, bool]] = deque(maxlen=STEP_HISTORY)  # (s, woven)
        self._num_steps = 0
        self._first_step = 0  # sequences that decoded from here on are judged
        self.tpots_s: list[float] = []

    def add_step(self, step_s: float, is_woven: bool) -> None:
        self._steps.append((step_s, is_woven))
        self._num_steps += 1

    def restart(self) -> None:
        """Judge only sequences that start decoding from the next step (the remote cap or
        the policy's state changed: the ones before it saw another batch)."""
        self._first_step = self._num_steps
        self.tpots_s.clear()

    def add_finished(self, num_output_tokens: int) -> None:
        """A sequence finished with the last step: it decoded over that many steps less
        one (its first token came with its prompt's last chunk)."""
        num_decode = num_output_tokens - 1
        if num_decode < 1 or self._num_steps - num_decode < self._first_step:
            return
        steps = list(self._steps)[-num_decode:]
        if any(is_woven for _, is_woven in steps):
            self.tpots_s.append(float(np.mean([step_s for step_s, _ in steps])))

    def share_over(self, tpot_s: float) -> float | None:
        """The share of the judged sequences whose TPOT ran over `tpot_s`; None until
        MIN_SEQUENCES of them."""
        if len(self.tpots_s) < MIN_SEQUENCES:
            return None
        return sum(t > tpot_s for t in self.tpots_s) / len(self.tpots_s)
