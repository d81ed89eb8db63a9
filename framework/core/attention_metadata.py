"""The attention metadata of one step: how the flat token batch splits into requests and
where each request's KV lives. The engine's runner builds it, attention backends read it
(through the forward context), and the pass verifier builds a one-request batch of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step metadata shared by every attention layer.

    Device tensors live in the runner's persistent buffers (static addresses for CUDA graphs);
    the ``*_cpu`` lists are host copies so the CPU path never synchronizes.
    """

    attention_backend: str
    """Name of the registered attention backend that runs this step."""
    num_actual_tokens: int
    """Real (unpadded) tokens; rows past this are padding."""
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    """int32 [num_reqs + 1]: cumulative query lengths."""
    seq_lens: torch.Tensor
    """int32 [num_reqs]: context length of each request after this step."""
    block_table: torch.Tensor
    """int32 [num_reqs, max_blocks_per_req]: KV blocks of each request."""
    slot_mapping: torch.Tensor
    """int64 [num_tokens]: flat cache slot of each token; -1 for padding."""
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
