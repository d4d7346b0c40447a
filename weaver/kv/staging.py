"""KV staging segments: one request's prompt KV on its way from a prompt engine to a token
engine (Splitwise's phase split, docs/architecture.md part 12).

A segment is one file under /dev/shm, named by the gateway for one request. The prompt
engine's worker creates it and writes the request's KV blocks into it layer by layer, as
each attention layer of the prefill finishes (Splitwise §4.2); the token engine's worker
copies the blocks into its own KV cache before the step that continues the request; the
gateway reads the header (what moved, how long it took) and unlinks the file once the
request is over. So no process but the gateway decides a segment's lifetime, and a
segment whose engines died is still removed.

Layout: a header of int64 words, then the blocks at DATA_OFFSET, layer-major:
``[num_layers][num_blocks][block_bytes]``. A block is whatever one logical KV block of one
layer holds in the engine's cache (vLLM's per-layer views keep blocks at dim 0), so the
copy is the same for every attention backend whose two engines agree on the block's shape
(checked: both are the same model, same dtype and block size). Opening the file with
os.open + mmap rather than ``multiprocessing.shared_memory`` keeps Python's resource
tracker from unlinking it when a reader exits (weaver/offload/shm.py says why).

Ordering: the writer stores a layer's blocks, then, after the step's last layer, the
``saved_tokens`` word; a reader checks ``saved_tokens`` first. The gateway forwards the
request to a token engine only after the prompt engine answered, which is after that step,
so the reader never races the writer.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

SHM_DIR = "/dev/shm"
MAGIC = 0x5756_4B56_5354_4731  # "WVKVSTG1"
DATA_OFFSET = 4096  # the blocks start page-aligned
_WORD = struct.Struct("<q")

# Header words, by index.
W_MAGIC = 0
W_NUM_LAYERS = 1
W_NUM_BLOCKS = 2
W_BLOCK_BYTES = 3
W_BLOCK_SIZE = 4
W_PROMPT_TOKENS = 5
W_PROMPT_HASH = 6
W_SAVED_TOKENS = 7  # prompt tokens whose KV is in the segment (written after each step)
W_SAVE_NS = 8  # time the prompt engine spent copying blocks in, summed over layers
W_LOADED_TOKENS = 9  # tokens the token engine took from the segment (its last load)
W_LOAD_NS = 10  # time of the token engine's last load
W_NUM_LOADS = 11  # loads (more than one: the request was preempted or re-run)
W_CACHED_TOKENS = 12  # prompt tokens the token engine found in its own prefix cache
NUM_WORDS = 13


def prompt_hash(token_ids: Sequence[int]) -> int:
    """A 63-bit digest of the prompt's token ids: the token engine takes the KV only for
    the very prompt it was computed from (both engines tokenize the same request body,
    but a tokenizer or template that differs would otherwise go unnoticed)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(token_ids)}q", *token_ids), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def segment_path(name: str, shm_dir: str = SHM_DIR) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"KV staging segment name {name!r} is not a plain file name")
    return os.path.join(shm_dir, name)


@dataclass(frozen=True)
class StagingReport:
    """What a segment's header says once its request is over (the gateway's metrics)."""

    prompt_tokens: int
    saved_tokens: int
    bytes_staged: int
    save_s: float
    loaded_tokens: int
    load_s: float
    num_loads: int
    cached_tokens: int  # the token engine's own prefix-cache hit

    @property
    def is_recomputed(self) -> bool:
        """The token engine computed the prompt instead of taking it (neither loaded nor
        found all but its last token in its own prefix cache)."""
        return self.num_loads == 0 and self.cached_tokens < self.prompt_tokens - 1


class StagingSegment:
    """One mapped segment: its header words and its blocks as a byte tensor."""

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path = path
        self._mmap = mmap.mmap(fd, size)
        os.close(fd)
        self._view = memoryview(self._mmap)
        self._bytes: torch.Tensor | None = None

    # --- opening ----------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, num_layers: int, num_blocks: int, block_bytes: int,
               block_size: int, prompt_tokens: int, prompt_digest: int,
               shm_dir: str = SHM_DIR) -> StagingSegment:
        """A new segment; FileExistsError when the name is taken (a request is staged once:
        a preempted prefill that runs again opens the one it made)."""
        path = segment_path(name, shm_dir)
        size = DATA_OFFSET + num_layers * num_blocks * block_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        segment = cls(path, fd, size)
        for index, value in ((W_NUM_LAYERS, num_layers), (W_NUM_BLOCKS, num_blocks),
                             (W_BLOCK_BYTES, block_bytes), (W_BLOCK_SIZE, block_size),
                             (W_PROMPT_TOKENS, prompt_tokens), (W_PROMPT_HASH, prompt_digest)):
            segment.write(index, value)
        segment.write(W_MAGIC, MAGIC)  # last: a reader that sees it sees the geometry
        return segment

    @classmethod
    def open(cls, name: str, shm_dir: str = SHM_DIR) -> StagingSegment:
        """An existing segment; FileNotFoundError when there is none, ValueError when the
        file is not a staging segment."""
        path = segment_path(name, shm_dir)
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        if size < DATA_OFFSET:
            os.close(fd)
            raise ValueError(f"{path} is too short to be a KV staging segment")
        segment = cls(path, fd, size)
        if segment.read(W_MAGIC) != MAGIC:
            segment.close()
            raise ValueError(f"{path} is not a KV staging segment")
        return segment

    # --- header -----------------------------------------------------------------------
    def read(self, index: int) -> int:
        return _WORD.unpack_from(self._view, index * _WORD.size)[0]

    def write(self, index: int, value: int) -> None:
        _WORD.pack_into(self._view, index * _WORD.size, value)

    def add(self, index: int, value: int) -> None:
        self.write(index, self.read(index) + value)

    @property
    def num_layers(self) -> int:
        return self.read(W_NUM_LAYERS)

    @property
    def num_blocks(self) -> int:
        return self.read(W_NUM_BLOCKS)

    @property
    def block_bytes(self) -> int:
        return self.read(W_BLOCK_BYTES)

    def report(self) -> StagingReport:
        blocks_saved = -(-self.read(W_SAVED_TOKENS) // max(self.read(W_BLOCK_SIZE), 1))
        return StagingReport(
            prompt_tokens=self.read(W_PROMPT_TOKENS),
            saved_tokens=self.read(W_SAVED_TOKENS),
            bytes_staged=blocks_saved * self.num_layers * self.block_bytes,
            save_s=self.read(W_SAVE_NS) / 1e9,
            loaded_tokens=self.read(W_LOADED_TOKENS),
            load_s=self.read(W_LOAD_NS) / 1e9,
            num_loads=self.read(W_NUM_LOADS),
            cached_tokens=self.read(W_CACHED_TOKENS))

    # --- blocks -----------------------------------------------------------------------
    def blocks(self, layer: int) -> torch.Tensor:
        """The layer's blocks, ``[num_blocks, block_bytes]`` uint8, backed by the segment."""
        if self._bytes is None:
            data = torch.frombuffer(self._mmap, dtype=torch.uint8, offset=DATA_OFFSET)
            self._bytes = data.view(self.num_layers, self.num_blocks, self.block_bytes)
        return self._bytes[layer]

    def close(self) -> None:
        self._bytes = None
        self._view.release()
        with contextlib.suppress(BufferError):  # a tensor view still alive: unmapped at GC
            self._mmap.close()


def save_blocks(segment: StagingSegment, layer: int, kv_layer: torch.Tensor,
                block_ids: Sequence[int], first_block: int) -> None:
    """Copy the engine's blocks `block_ids` of one layer into the segment, from the
    request's logical block `first_block` on."""
    if not block_ids:
        return
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_layer.device)
    picked = kv_layer.index_select(0, index).contiguous()
    raw = picked.view(torch.uint8).reshape(len(block_ids), -1)
    segment.blocks(layer)[first_block:first_block + len(block_ids)].copy_(raw)


def load_blocks(segment: StagingSegment, layer: int, kv_layer: torch.Tensor,
                block_ids: Sequence[int], first_block: int) -> None:
    """Copy the segment's blocks from logical block `first_block` on into the engine's
    blocks `block_ids` of one layer."""
    if not block_ids:
        return
    staged = segment.blocks(layer)[first_block:first_block + len(block_ids)]
    shape = (len(block_ids), *kv_layer.shape[1:])
    values = staged.to(kv_layer.device).view(kv_layer.dtype).view(shape)
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_layer.device)
    kv_layer.index_copy_(0, index, values)


def read_report(name: str, shm_dir: str = SHM_DIR) -> StagingReport | None:
    """The segment's report, or None when no prompt engine made it."""
    try:
        segment = StagingSegment.open(name, shm_dir)
    except (FileNotFoundError, ValueError):
        return None
    try:
        return segment.report()
    finally:
        segment.close()


def remove_segment(name: str, shm_dir: str = SHM_DIR) -> bool:
    """Unlink the segment; True when there was one."""
    try:
        os.unlink(segment_path(name, shm_dir))
    except FileNotFoundError:
        return False
    return True


def remove_segments(prefix: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every segment whose name starts with `prefix` (what a stopped gateway's
    requests left); the names removed."""
    removed = []
    for path in Path(shm_dir).glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    return removed
