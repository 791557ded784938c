"""Turn a `StepPlan` into the tensors of one forward pass: token ids, positions, attention metadata.

Rows are ordered batched-group first (requests with few query tokens: decodes, speculative
verification, short chunks), then long prefill chunks. Everything per step is built with a few
vectorized tensor ops, never per token in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.runner.attention import MAX_BATCHED_QUERY, AttentionMetadata, BatchedGroup, PrefillSeq
from tandem.types import ScheduledSeq, StepPlan


@dataclass
class StepInputs:
    input_ids: torch.Tensor             # [N]
    positions: torch.Tensor             # [N]
    meta: AttentionMetadata
    seqs: list[ScheduledSeq]            # in row order
    row_starts: list[int]               # first row of each seq


def build_inputs(plan: StepPlan, block_size: int, device: torch.device, paged_kernel: bool = False) -> StepInputs:
    batched = [s for s in plan.seqs if s.num_tokens <= MAX_BATCHED_QUERY]
    long = [s for s in plan.seqs if s.num_tokens > MAX_BATCHED_QUERY]
    seqs = batched + long
    ids: list[int] = []
    positions: list[int] = []
    row_starts: list[int] = []
    slots: list[int] = []
    for s in seqs:
        row_starts.append(len(ids))
        ids.extend(s.token_ids)
        positions.extend(range(s.start, s.start + s.num_tokens))
        slots.extend(_slots(s.block_ids, block_size, s.start, s.start + s.num_tokens))
    nb = sum(s.num_tokens for s in batched)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_batched_tokens=nb,
        batched=(_kernel_group if paged_kernel else _batched_group)(batched, block_size, device) if batched else None,
        prefills=[_prefill_seq(s, r, block_size, device) for s, r in zip(long, row_starts[len(batched):])],
    )
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta, seqs=seqs, row_starts=row_starts,
    )


def _slots(block_ids: list[int], block_size: int, begin: int, end: int) -> list[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(begin, end)]


def _kernel_group(seqs: list[ScheduledSeq], block_size: int, device: torch.device) -> BatchedGroup:
    b = len(seqs)
    t = max(s.start + s.num_tokens for s in seqs)
    nblk = -(-t // block_size)
    table = torch.zeros(b, nblk, dtype=torch.int32)
    qseq: list[int] = []
    qpos: list[int] = []
    for i, s in enumerate(seqs):
        used = -(-(s.start + s.num_tokens) // block_size)
        table[i, :used] = torch.tensor(s.block_ids[:used], dtype=torch.int32)
        qseq.extend([i] * s.num_tokens)
        qpos.extend(range(s.start, s.start + s.num_tokens))
    return BatchedGroup(num_seqs=b, max_query=max(s.num_tokens for s in seqs), max_context=t,
                        table=table.to(device), query_seq=torch.tensor(qseq, dtype=torch.int32, device=device),
                        query_pos=torch.tensor(qpos, dtype=torch.int32, device=device))


def _batched_group(seqs: list[ScheduledSeq], block_size: int, device: torch.device) -> BatchedGroup:
    b = len(seqs)
    lq = max(s.num_tokens for s in seqs)
    t = max(s.start + s.num_tokens for s in seqs)
    nblk = -(-t // block_size)
    table = torch.zeros(b, nblk, dtype=torch.long)
    for i, s in enumerate(seqs):
        used = -(-(s.start + s.num_tokens) // block_size)
        table[i, :used] = torch.tensor(s.block_ids[:used], dtype=torch.long)
    gather = (table.unsqueeze(-1) * block_size + torch.arange(block_size)).view(b, -1)[:, :t]
    # Query i of request r sits at position start_r + i and sees context positions <= it.
    starts = torch.tensor([s.start for s in seqs], dtype=torch.long)
    lens = torch.tensor([s.num_tokens for s in seqs], dtype=torch.long)
    qi = torch.arange(lq)
    pos = starts[:, None] + qi[None, :]                                   # [B, Lq]
    valid = qi[None, :] < lens[:, None]
    pos = torch.where(valid, pos, torch.zeros_like(pos))                  # padded rows see slot 0 only
    allowed = torch.arange(t)[None, None, :] <= pos[:, :, None]           # [B, Lq, T]
    mask = torch.zeros(b, lq, t).masked_fill_(~allowed, float("-inf")).view(1, b, lq, 1, t)
    pad_index = unpad_index = None
    if not bool(valid.all()):
        row_of = torch.cumsum(lens, 0) - lens                             # first flat row of each request
        flat = row_of[:, None] + qi[None, :]                              # [B, Lq]
        pad_index = torch.where(valid, flat, torch.zeros_like(flat)).reshape(-1)
        unpad_index = (torch.arange(b)[:, None] * lq + qi[None, :])[valid]
    return BatchedGroup(
        num_seqs=b, max_query=lq, max_context=t,
        gather_slots=gather.reshape(-1).to(device),
        mask=mask.to(device),
        pad_index=None if pad_index is None else pad_index.to(device),
        unpad_index=None if unpad_index is None else unpad_index.to(device),
    )


def _prefill_seq(s: ScheduledSeq, row: int, block_size: int, device: torch.device) -> PrefillSeq:
    end = s.start + s.num_tokens
    ctx = torch.tensor(_slots(s.block_ids, block_size, 0, end), dtype=torch.long)
    mask = None
    if s.start > 0:
        q_pos = torch.arange(s.start, end)
        mask = (torch.arange(end)[None, :] <= q_pos[:, None]).to(device)
    used = -(-end // block_size)
    blocks = torch.tensor(s.block_ids[:used], dtype=torch.int32, device=device)
    return PrefillSeq(q_start=row, q_end=row + s.num_tokens, ctx_slots=ctx.to(device), mask=mask, start=s.start,
                      blocks=blocks)
