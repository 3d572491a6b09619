"""The one place that turns a pass's rows into batched tensors and runs the model."""

import torch

from specdec.engine.attention import ATTENTION, Group, Plan
from specdec.engine.block_manager import KVPool
from specdec.engine.scheduler import Row
from specdec.quantize import attention_dtype


class ModelRunner:
    def __init__(self, model, pool: KVPool, short: int):
        """short: rows of at most this many tokens attend together (a pass's rounds and
        steps); longer ones (prefill chunks) attend in a group of their own."""
        model.set_attn_implementation(ATTENTION)
        self.model, self.device, self.pool, self.short = model, model.device, pool, short
        self.attention_dtype = attention_dtype(model, model.dtype)

    def run(self, batch: list[Row]) -> torch.Tensor:
        """One forward over every row's next tokens; -> logits of the wanted positions
        [sum of the rows' wanted, vocab]."""
        device, block_size = self.device, self.pool.block_size
        ids, positions, keep, placed = [], [], [], []
        for row in batch:
            seq, start, end = row.work.seq, row.start, row.start + row.n
            placed.append((row, len(ids), seq.slots(end, block_size, device)))  # the slots it reads, its own last
            keep += range(len(ids) + row.n - row.wanted, len(ids) + row.n)
            ids += seq.tokens[start:end]
            positions += range(start, end)
        writes = [slots[row.start:] for row, _, slots in placed]
        short = [p for p in placed if p[0].n <= self.short]
        groups = [self._group(g) for g in ([short] if short else []) + [[p] for p in placed if p[0].n > self.short]]
        plan = Plan(self.pool, writes[0] if len(writes) == 1 else torch.cat(writes), groups, self.attention_dtype,
                    [row.work for row in batch])
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids], device=device),
                             position_ids=torch.tensor([positions], device=device),
                             logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
                             use_cache=False, specdec_plan=plan)
            logits = out.logits[0].float()
        if device.type == "cuda":  # the pass's time is read right after: let it end first
            torch.cuda.synchronize(device)
        return logits

    def _group(self, placed: list[tuple[Row, int, torch.Tensor]]) -> Group:
        """The attention layout of rows (each with its offset in the packed tokens and the
        slots it reads)."""
        device = self.device
        width = max(row.n for row, _, _ in placed)
        length = max(row.start + row.n for row, _, _ in placed)
        # Each row's slots, padded to the longest with slot 0 (zeros, never attended).
        read_slots = torch.nn.utils.rnn.pad_sequence([slots for _, _, slots in placed], batch_first=True)
        q_index, q_pos, packed, flat = [], [], [], []
        for b, (row, offset, _) in enumerate(placed):
            end = row.start + row.n
            pad = width - row.n
            q_index.append(list(range(offset, offset + row.n)) + [0] * pad)
            q_pos.append(list(range(row.start, end)) + [0] * pad)  # padding attends slot 0 only
            packed += range(offset, offset + row.n)
            flat += range(b * width, b * width + row.n)
        mask = None
        if len(placed) > 1 or width > 1:  # one row of one token attends all it reads: no mask to build or apply
            mask = (torch.arange(length, device=device)[None, None, :]
                    <= torch.tensor(q_pos, device=device)[:, :, None]).unsqueeze(1)
        return Group(read_slots, torch.tensor(q_index, device=device), mask,
                     torch.tensor(packed, device=device), torch.tensor(flat, device=device))
