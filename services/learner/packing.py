"""Training sequences and padding-free packed micro-batches.

Why packing: a batch of multi-turn trajectories has very uneven lengths, and padding every row to
the longest one can spend most of the compute on pad tokens. Here sequences are concatenated into
one row per micro-batch with `position_ids` restarting at 0 for each sequence, and no attention
mask, so no sequence sees another and no pad token is computed. Which kernel keeps them apart
is chosen by `attention.choose_attention` (`learner.attention`, attention.py's doc):
  - flash-attn installed, a CUDA device and bf16/fp16 weights: transformers' `flash_attention_2`,
    called with the sequence boundaries (`MicroBatch.varlen_kwargs`: cu_seq_lens / max_length,
    the kwargs of transformers' DataCollatorWithFlattening that TRL's padding-free training
    uses), so attention runs in flash-attn's varlen kernel — no mask is ever built;
  - else, on CUDA with FlexAttention: transformers' `flex_attention` with a block-sparse mask
    (from the position-id restarts, or for a shared row from `MicroBatch.kv_reach`), so tiles
    across documents are skipped;
  - otherwise (CPU, or neither): SDPA, for which transformers turns the position-id restarts
    into a 4D block-diagonal causal mask (memory quadratic in the row length, which is why CPU
    configs keep `learner.micro_batch_tokens` small).
All give every sequence exactly the log-probs it gets alone (tests/learner/test_gpu_settings.py
checks the SDPA path, test_attention.py flex against SDPA; the flash path has not run on a GPU
in this project, docs/learner.md).

Why shared prefixes (SDPA and flex paths, `learner.shared_prompts`): the n samples of a GRPO group repeat
one prompt, and every prompt of a task starts with the same instruction; on the search tasks
that is most of each sequence (task (a) of bench/peer_trl.py: ~190 prompt tokens, ~13 answer
tokens; the demo's SFT rows: 112 instruction tokens common to all, ~178 in all). A row computes
each shared prefix once, as a tree: the prefix common to the row's sequences, then per distinct
continuation the prefix common to those, down to each sequence's own tokens (a branch), and
each segment attends to the segments above it and causally to itself. Every token that can
carry loss gets the log-prob it gets alone, and the gradient is the same (a shared prefix's
activations feed every branch below it, so their gradient is the sum over those branches, as
it is when each copy is computed separately), for a fraction of the tokens. Only tokens whose
logits no loss reads are shared: a sequence's prompt less its last token (that token's logits
predict the first response token, which differs per sample). An explicit boolean 4D mask says
who attends to whom (`attention_mask`, for SDPA); position ids are each token's index in its
sequence. The same mask in O(N) form is `kv_reach` (FlexAttention's block mask is built from it).
flash-attn's varlen kernel cannot express the mask, so the flash path never shares.

Why a plan shared by all ranks: every rank must run the same number of forward/backward passes
per optimizer step (ZeRO gathers and reduces collectively), so the split of a global batch into
ranks x micro-batches is computed identically on every rank from the sequence lengths alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from services.common.trajectory import ScoredTrajectory, Trajectory

# Per-token float fields a Sample may carry, all aligned with `input_ids` (the value at index p
# belongs to token p, i.e. to the prediction of token p from tokens < p).
TOKEN_FIELDS: tuple[str, ...] = (
    "advantages",
    "returns",
    "old_logprobs",
    "rollout_logprobs",
    "ref_logprobs",
    "values",
    "step_index",  # the turn (step) each response token belongs to; rllm's per-step loss rows
    "rollout_is_weights",  # rollout correction's importance weights (rl_batch.py)
    "sum_pi_squared",  # sum_v p(v)^2 per token, for the optimal token baselines
)


@dataclass
class Sample:
    """One training sequence: prompt + response tokens, and which tokens carry loss."""

    input_ids: np.ndarray  # int64 (L,)
    loss_mask: np.ndarray  # float32 (L,): 1 = a trained token (never a prompt/observation token)
    prompt_len: int = 0
    uid: str = ""  # group id (GRPO group = one prompt)
    fields: dict[str, np.ndarray] = field(default_factory=dict)  # TOKEN_FIELDS, float32 (L,)

    def __post_init__(self) -> None:
        self.input_ids = np.ascontiguousarray(np.asarray(self.input_ids, dtype=np.int64).ravel())
        self.loss_mask = np.ascontiguousarray(np.asarray(self.loss_mask, dtype=np.float32).ravel())
        if self.loss_mask.shape != self.input_ids.shape:
            raise ValueError("loss_mask must have one entry per input token")
        if len(self.input_ids) == 0:
            raise ValueError("a sample needs at least one token")
        # The first token has no prediction (nothing before it), so it can never carry loss.
        self.loss_mask[0] = 0.0
        for name, values in list(self.fields.items()):
            self.set_field(name, values)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def set_field(self, name: str, values: np.ndarray) -> None:
        if name not in TOKEN_FIELDS:
            raise KeyError(f"unknown token field {name!r}; known: {TOKEN_FIELDS}")
        arr = np.ascontiguousarray(np.asarray(values, dtype=np.float32).ravel())
        if arr.shape != self.input_ids.shape:
            raise ValueError(f"field {name} has {arr.shape[0]} values for {len(self)} tokens")
        self.fields[name] = arr

    def set_response_field(self, name: str, values: np.ndarray) -> None:
        """Set a field from response-aligned values (one per response token; prompt gets 0)."""
        values = np.asarray(values, dtype=np.float32).ravel()
        full = np.zeros(len(self), dtype=np.float32)
        full[self.prompt_len : self.prompt_len + len(values)] = values
        self.set_field(name, full)

    def response_field(self, name: str) -> np.ndarray:
        return self.fields[name][self.prompt_len :]

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def sample_from_trajectory(traj: Trajectory) -> Sample:
    """prompt_ids + response_ids; loss only on policy tokens (Trajectory.loss_mask == 1).

    Prompt tokens and observation tokens (loss_mask 0) are excluded; the behaviour log-probs the
    rollout recorded travel along as `rollout_logprobs` (truncated importance sampling).
    """
    prompt_len = len(traj.prompt_ids)
    ids = np.concatenate([traj.prompt_ids, traj.response_ids]).astype(np.int64)
    mask = np.concatenate(
        [np.zeros(prompt_len, dtype=np.float32), traj.loss_mask.astype(np.float32)]
    )
    sample = Sample(ids, mask, prompt_len=prompt_len, uid=traj.uid)
    if len(traj.rollout_logprobs) == len(traj.response_ids):
        sample.set_response_field("rollout_logprobs", traj.rollout_logprobs)
    return sample


def samples_from_scored(scored: Sequence[ScoredTrajectory]) -> list[Sample]:
    return [sample_from_trajectory(item.trajectory) for item in scored]


def response_tensors(
    samples: Sequence[Sample], rewards: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    """(batch, T) response-aligned tensors for the advantage estimators.

    `response_mask` is the loss mask of the response; the scalar reward goes on the last trained
    token of each response (verl's convention: token_level_rewards). Group ids are small ints,
    one per distinct uid, in order of first appearance.
    """
    width = max(len(s) - s.prompt_len for s in samples) if samples else 0
    mask = torch.zeros(len(samples), width)
    token_rewards = torch.zeros(len(samples), width)
    group_of: dict[str, int] = {}
    group_ids = torch.zeros(len(samples), dtype=torch.long)
    for row, sample in enumerate(samples):
        resp_mask = torch.from_numpy(sample.loss_mask[sample.prompt_len :].copy())
        mask[row, : len(resp_mask)] = resp_mask
        group_ids[row] = group_of.setdefault(sample.uid, len(group_of))
        if rewards is not None:
            trained = torch.nonzero(resp_mask).flatten()
            last = int(trained[-1]) if len(trained) else max(len(resp_mask) - 1, 0)
            if len(resp_mask):
                token_rewards[row, last] = float(rewards[row])
    return {"response_mask": mask, "token_level_rewards": token_rewards, "group_ids": group_ids}


def set_response_matrix(samples: Sequence[Sample], name: str, matrix: torch.Tensor) -> None:
    """Write a (batch, T) response-aligned tensor (e.g. advantages) back into the samples."""
    for row, sample in enumerate(samples):
        n = len(sample) - sample.prompt_len
        sample.set_response_field(name, matrix[row, :n].detach().float().cpu().numpy())


# ------------------------------------------------------------------------------------ planning


def plan_micro_batches(
    lengths: Sequence[int], world_size: int, max_tokens: int
) -> list[list[list[int]]]:
    """Split sequences into `world_size` x `n_micro` bins of at most `max_tokens` tokens.

    Returns plan[rank][micro] = sample indices. Longest-first greedy into the least-loaded bin
    that fits (a sequence longer than the budget gets a bin of its own); `n_micro` is the smallest
    count for which everything fits, the same for every rank. Bins may be empty when there are
    fewer sequences than bins (the trainer then runs a zero-loss dummy pass to keep ranks in step).
    """
    if world_size < 1 or max_tokens < 1:
        raise ValueError("world_size and max_tokens must be positive")
    if not lengths:
        return [[[]] for _ in range(world_size)]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    total = sum(lengths)
    n_micro = max(1, -(-total // (world_size * max_tokens)))
    while True:
        bins: list[list[int]] = [[] for _ in range(world_size * n_micro)]
        loads = [0] * len(bins)
        ok = True
        for index in order:
            length = lengths[index]
            candidates = [b for b in range(len(bins)) if loads[b] + length <= max_tokens]
            if not candidates:
                empty = [b for b in range(len(bins)) if loads[b] == 0]
                if length > max_tokens and empty:
                    candidates = empty
                else:
                    ok = False
                    break
            best = min(candidates, key=lambda b: (loads[b], b))
            bins[best].append(index)
            loads[best] += length
        if ok:
            break
        n_micro += 1
    # Bin b belongs to rank b % world_size, so every rank gets a similar share of the big ones.
    plan = [[bins[m * world_size + r] for m in range(n_micro)] for r in range(world_size)]
    return plan


def split_mini_batches(n_samples: int, mini_batch_size: int) -> list[list[int]]:
    """Consecutive index ranges of `mini_batch_size` sequences (0: one mini-batch of all)."""
    if mini_batch_size <= 0 or mini_batch_size >= n_samples:
        return [list(range(n_samples))]
    return [
        list(range(start, min(start + mini_batch_size, n_samples)))
        for start in range(0, n_samples, mini_batch_size)
    ]


# ------------------------------------------------------------------------------------- packing


@dataclass
class MicroBatch:
    """Sequences concatenated into one row; all tensors are (1, N)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    fields: dict[str, torch.Tensor]
    seq_starts: list[int]
    seq_lens: list[int]
    prompt_lens: list[int]
    sample_indices: list[int]  # into the list the batch was packed from; [] for a dummy
    num_padding: int = 0  # tokens computed that belong to no sample (dummy passes only)
    # Shared prefixes (module doc): per sequence, how many of its leading tokens live in
    # shared segments, and those segments' (start, length) in the row in token order; its own
    # tokens start at seq_starts. Empty lists: nothing shared (each sequence one contiguous run).
    shared_lens: list[int] = field(default_factory=list)
    prefix_runs: list[list[tuple[int, int]]] = field(default_factory=list)
    attention_mask: torch.Tensor | None = None  # (1, 1, N, N) bool, True = may attend
    # The same mask of a shared row in O(N) (None for a plain row): query q may attend to key
    # k iff k <= q < kv_reach[k], where kv_reach[k] is the end of the last segment that sees
    # k's segment. Exact because the tree is laid out depth first: a segment and everything
    # that sees it are one contiguous run starting at the segment (_PrefixTree.kv_reach).
    kv_reach: torch.Tensor | None = None  # (1, N) int32

    @property
    def is_shared(self) -> bool:
        return any(self.shared_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> MicroBatch:
        move = {
            name: tensor.to(device, non_blocking=True) for name, tensor in self.fields.items()
        }
        return MicroBatch(
            self.input_ids.to(device, non_blocking=True),
            self.position_ids.to(device, non_blocking=True),
            self.loss_mask.to(device, non_blocking=True),
            move,
            self.seq_starts,
            self.seq_lens,
            self.prompt_lens,
            self.sample_indices,
            self.num_padding,
            self.shared_lens,
            self.prefix_runs,
            None if self.attention_mask is None
            else self.attention_mask.to(device, non_blocking=True),
            None if self.kv_reach is None else self.kv_reach.to(device, non_blocking=True),
        )

    @cached_property
    def logit_positions(self) -> torch.Tensor:
        """(K,) the row positions whose logits predict a loss token (p where token p + 1 has
        loss mask 1), ascending: all a loss or log-prob pass reads (logprobs.KeptLogits).
        Computed once per row: the forward and its loss both ask."""
        return torch.nonzero(self.loss_mask[0, 1:] > 0).squeeze(-1)

    def mask_kwargs(self) -> dict[str, torch.Tensor]:
        """The forward's dense `attention_mask` (SDPA) for a row with shared prefixes; none
        otherwise (position-id restarts keep plain rows apart)."""
        if self.attention_mask is None and self.kv_reach is not None:
            raise ValueError("this shared row was packed without its dense mask "
                             "(pack(..., dense_mask=False) is for the flex path)")
        return {} if self.attention_mask is None else {"attention_mask": self.attention_mask}

    def _shared(self, row: int) -> int:
        return self.shared_lens[row] if self.shared_lens else 0

    def sample_values(self, flat: torch.Tensor, row: int) -> torch.Tensor:
        """The (n,) per-token values of the row-th packed sequence, in its own token order,
        from (1, N) values over the row (its shared prefix, then its own tokens)."""
        shared = self._shared(row)
        start, n = self.seq_starts[row], self.seq_lens[row]
        own = flat[0, start : start + n - shared]
        if not shared:
            return own
        runs = [flat[0, begin : begin + length] for begin, length in self.prefix_runs[row]]
        return torch.cat([*runs, own])

    def varlen_kwargs(self) -> dict[str, torch.Tensor | int]:
        """Sequence boundaries for flash-attn's varlen kernel: cumulative lengths (int32, on the
        batch's device) and the longest sequence, under the names transformers' flash path
        reads (`cu_seq_lens_q/k`, `max_length_q/k`). Given these, transformers does not have
        to infer the boundaries from `position_ids` in every layer."""
        if self.is_shared:
            raise ValueError("a row with shared prompts has no varlen boundaries: pack without "
                             "share_prompts for flash-attn")
        bounds = [0]
        for n in self.seq_lens:
            bounds.append(bounds[-1] + n)
        cu = torch.tensor(bounds, dtype=torch.int32, device=self.input_ids.device)
        longest = max(self.seq_lens)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                "max_length_q": longest, "max_length_k": longest}

    def response_matrix(self, flat: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """(1, N) per-token values -> (n_seq, T) response-aligned rows (zeros past the end).

        The loss functions aggregate per sequence (seq-mean modes), so they need rows; this is a
        gather over values already computed, not model compute.
        """
        resp_lens = [n - p for n, p in zip(self.seq_lens, self.prompt_lens, strict=True)]
        width = max(resp_lens, default=0) if width is None else width
        out = flat.new_zeros(len(self.seq_lens), width)
        for row, (start, n, p) in enumerate(
            zip(self.seq_starts, self.seq_lens, self.prompt_lens, strict=True)
        ):
            k = min(n - p, width)
            first = start + p - self._shared(row)  # responses are never in a shared prefix
            out[row, :k] = flat[0, first : first + k]
        return out


def shareable_len(sample: Sample) -> int:
    """How many leading tokens of `sample` a row may share with other sequences: those whose
    logits no loss reads, i.e. the prompt less its last token (module doc), and never past a
    token that carries loss."""
    trained = np.flatnonzero(sample.loss_mask)
    limit = sample.prompt_len if len(trained) == 0 else min(sample.prompt_len, int(trained[0]))
    return max(limit - 1, 0)


def prompt_key(sample: Sample) -> bytes | None:
    """The prompt a sample repeats with its GRPO group, for planning (prompt_units): its
    prompt's tokens, when the prompt has at least two tokens and carries no loss; None when it
    has nothing to share."""
    p = sample.prompt_len
    if p < 2 or p >= len(sample) or sample.loss_mask[:p].any():
        return None
    return sample.input_ids[:p].tobytes()


def shared_layout_tokens(lengths: Sequence[int], prompt_len: int) -> int:
    """Tokens of one group of sequences (`lengths`) with one prompt in the shared layout: the
    prompt less its last token once, then each sequence's own tokens from that last token on."""
    if len(lengths) < 2:
        return sum(lengths)
    return (prompt_len - 1) + sum(n - prompt_len + 1 for n in lengths)


def prompt_units(
    samples: Sequence[Sample], indices: Sequence[int], max_tokens: int
) -> list[list[int]]:
    """`indices` grouped by identical prompt (in order of first appearance), for planning rows
    in which each group's prompt is computed once. A group whose shared layout would pass
    `max_tokens` is cut into consecutive units that fit (each repeats the prompt); samples that
    share no prompt are units of one."""
    groups: dict[bytes | int, list[int]] = {}
    for index in indices:
        key = prompt_key(samples[index])
        groups.setdefault(index if key is None else key, []).append(index)
    units: list[list[int]] = []
    for members in groups.values():
        prompt_len = samples[members[0]].prompt_len
        unit: list[int] = []
        for index in members:
            lengths = [len(samples[i]) for i in unit + [index]]
            if unit and shared_layout_tokens(lengths, prompt_len) > max_tokens:
                units.append(unit)
                unit = []
            unit.append(index)
        units.append(unit)
    return units


def spread_units(units: list[list[int]], world_size: int) -> list[list[int]]:
    """`units` with the largest halved until there are at least `world_size` (or none has two
    members), so every rank gets real sequences: a batch of one GRPO group on 2 ranks would
    otherwise leave one rank idle on a dummy pass. Each half still computes its prompt once."""
    units = [list(unit) for unit in units]
    while len(units) < world_size:
        largest = max(range(len(units)), key=lambda j: len(units[j]), default=None)
        if largest is None or len(units[largest]) < 2:
            break
        unit = units.pop(largest)
        half = (len(unit) + 1) // 2
        units[largest:largest] = [unit[:half], unit[half:]]
    return units


def unit_tokens(samples: Sequence[Sample], unit: Sequence[int]) -> int:
    """Tokens `unit` (one of prompt_units) takes in a row of its own."""
    return shared_layout_tokens([len(samples[i]) for i in unit], samples[unit[0]].prompt_len)


def common_prefix_len(samples: Sequence[Sample], indices: Sequence[int]) -> int:
    """The shareable prefix common to all of `samples[indices]` (e.g. a task's instruction):
    a row of any of them computes it once, which the planner counts (plan_shared_rows)."""
    if len(indices) < 2:
        return 0
    return _shared_until(samples, indices, 0)


def _shared_until(samples: Sequence[Sample], indices: Sequence[int], depth: int) -> int:
    """Where the shareable tokens of `samples[indices]`, identical up to `depth`, stop being
    identical (at most the smallest shareable_len; `depth` when that is no further)."""
    cap = min(shareable_len(samples[i]) for i in indices)
    if cap <= depth:
        return depth
    block = np.stack([samples[i].input_ids[depth:cap] for i in indices])
    differs = np.flatnonzero((block != block[0]).any(axis=0))
    return depth + (int(differs[0]) if len(differs) else cap - depth)


def plan_shared_rows(
    samples: Sequence[Sample], indices: Sequence[int], world_size: int, max_tokens: int
) -> list[list[list[int]]]:
    """plan_micro_batches for rows that share prefixes: whole prompt groups per row
    (prompt_units), each costed at its tokens beyond the prefix common to the whole batch
    (that prefix is paid once per row), so a row's computed tokens stay within `max_tokens`
    (fewer where its sequences share more). Returns plan[rank][micro] = sample indices."""
    units = spread_units(prompt_units(samples, indices, max_tokens), world_size)
    common = common_prefix_len(samples, indices)
    costs = [unit_tokens(samples, unit) for unit in units]
    if common and common < max_tokens:
        costs = [max(cost - common, 1) for cost in costs]
        budget = max_tokens - common
    else:
        budget = max_tokens
    plan = plan_micro_batches(costs, world_size, budget)
    return [[[i for j in micro for i in units[j]] for micro in rank] for rank in plan]


def pack(
    samples: Sequence[Sample],
    indices: Sequence[int],
    pad_token_id: int = 0,
    share_prompts: bool = False,
    dense_mask: bool = True,
) -> MicroBatch:
    """Concatenate `samples[indices]` into one row; an empty index list gives a 1-token dummy.

    With `share_prompts`, prefixes the sequences have in common are computed once, as a tree
    with an explicit attention mask (module doc); the row's sequences are then in tree order
    (`sample_indices` says which is which). Without a common prefix the row is the plain one.
    A shared row always carries `kv_reach`; its dense (N, N) `attention_mask` only with
    `dense_mask` (SDPA needs it; the flex path does not, and at 16k tokens it is 256 MB).
    """
    if not indices:
        zero = torch.zeros(1, 1)
        names = {name for s in samples for name in s.fields}
        return MicroBatch(
            torch.full((1, 1), pad_token_id, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long),
            zero.clone(),
            {name: zero.clone() for name in names},
            [0],
            [1],
            [1],
            [],
            num_padding=1,
        )
    if share_prompts and len(indices) > 1:
        layout = _PrefixTree(samples)
        layout.place(list(indices), 0, [])
        if any(layout.shared_lens):
            return layout.micro_batch(dense_mask)
    return _pack_contiguous(samples, indices)


def _pack_contiguous(samples: Sequence[Sample], indices: Sequence[int]) -> MicroBatch:
    """Each sequence one contiguous run; position-id restarts keep them apart."""
    chosen = [samples[i] for i in indices]
    ids = np.concatenate([s.input_ids for s in chosen])
    mask = np.concatenate([s.loss_mask for s in chosen])
    positions = np.concatenate([np.arange(len(s), dtype=np.int64) for s in chosen])
    names = sorted({name for s in chosen for name in s.fields})
    fields = {
        name: torch.from_numpy(
            np.concatenate([s.fields.get(name, np.zeros(len(s), np.float32)) for s in chosen])
        ).unsqueeze(0)
        for name in names
    }
    starts = np.cumsum([0] + [len(s) for s in chosen[:-1]]).tolist()
    return MicroBatch(
        torch.from_numpy(ids).unsqueeze(0),
        torch.from_numpy(positions).unsqueeze(0),
        torch.from_numpy(mask).unsqueeze(0),
        fields,
        [int(x) for x in starts],
        [len(s) for s in chosen],
        [s.prompt_len for s in chosen],
        list(indices),
    )


class _PrefixTree:
    """A row with shared prefixes laid out as a tree (module doc): `place` writes the prefix
    common to a set of sequences once, splits them by the token that follows, and recurses; a
    sequence alone in its subtree gets its remaining tokens as a branch."""

    def __init__(self, samples: Sequence[Sample]) -> None:
        self.samples = samples
        self.names = sorted({name for s in samples for name in s.fields})
        self.pieces: list[tuple[Sample, int, int]] = []  # (sample, lo, hi) in row order
        # Attention: (rows start, rows length, ancestor segments it sees in full).
        self.blocks: list[tuple[int, int, list[tuple[int, int]]]] = []
        self.offset = 0
        self.order: list[int] = []
        self.starts: list[int] = []
        self.shared_lens: list[int] = []
        self.prefix_runs: list[list[tuple[int, int]]] = []

    def _segment(self, sample: Sample, lo: int, hi: int, above: list[tuple[int, int]]) -> int:
        start = self.offset
        self.pieces.append((sample, lo, hi))
        self.blocks.append((start, hi - lo, above))
        self.offset += hi - lo
        return start

    def _branch(self, index: int, depth: int, above: list[tuple[int, int]]) -> None:
        sample = self.samples[index]
        self.order.append(index)
        self.shared_lens.append(depth)
        self.prefix_runs.append(list(above))
        self.starts.append(self._segment(sample, depth, len(sample), above))

    def place(self, members: list[int], depth: int, above: list[tuple[int, int]]) -> None:
        """Lay out `members`, whose tokens [0, depth) are already in the segments `above`."""
        if len(members) == 1:
            self._branch(members[0], depth, above)
            return
        end = _shared_until(self.samples, members, depth)
        if end > depth:
            start = self._segment(self.samples[members[0]], depth, end, above)
            above = above + [(start, end - depth)]
        # Split by the next token; a sequence that may share no further is a branch here.
        subtrees: dict[int, list[int]] = {}
        for index in members:
            if shareable_len(self.samples[index]) <= end:
                self._branch(index, end, above)
            else:
                subtrees.setdefault(int(self.samples[index].input_ids[end]), []).append(index)
        for subtree in subtrees.values():
            self.place(subtree, end, above)

    def dense_mask(self) -> torch.Tensor:
        """(1, 1, N, N) bool: each segment attends causally to itself and fully to the
        segments above it (the reference form of the rule; SDPA takes it as it is)."""
        total = self.offset
        attention = torch.zeros(total, total, dtype=torch.bool)
        for start, n, above in self.blocks:
            attention[start : start + n, start : start + n] = torch.ones(
                n, n, dtype=torch.bool).tril_()
            for begin, length in above:
                attention[start : start + n, begin : begin + length] = True
        return attention[None, None]

    def kv_reach(self) -> torch.Tensor:
        """(1, N) int32: per key token, the end of the last segment that attends to it (its own
        segment, or one below it in the tree). Segments are written depth first, so those that
        see a segment follow it as one run, and `k <= q < kv_reach[k]` is the dense mask's rule
        (test_attention.py compares the two on many layouts)."""
        reach = np.zeros(self.offset, dtype=np.int32)
        for start, n, above in self.blocks:
            end = start + n
            reach[start:end] = np.maximum(reach[start:end], end)
            for begin, length in above:
                reach[begin : begin + length] = np.maximum(reach[begin : begin + length], end)
        return torch.from_numpy(reach).unsqueeze(0)

    def micro_batch(self, dense_mask: bool = True) -> MicroBatch:
        def cat(values: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(values)).unsqueeze(0)

        zeros = {id(s): np.zeros(len(s), np.float32) for s, _, _ in self.pieces}
        return MicroBatch(
            cat([s.input_ids[lo:hi] for s, lo, hi in self.pieces]),
            cat([np.arange(lo, hi, dtype=np.int64) for _, lo, hi in self.pieces]),
            cat([s.loss_mask[lo:hi] for s, lo, hi in self.pieces]),
            {name: cat([s.fields.get(name, zeros[id(s)])[lo:hi] for s, lo, hi in self.pieces])
             for name in self.names},
            self.starts,
            [len(self.samples[i]) for i in self.order],
            [self.samples[i].prompt_len for i in self.order],
            self.order,
            shared_lens=self.shared_lens,
            prefix_runs=self.prefix_runs,
            attention_mask=self.dense_mask() if dense_mask else None,
            kv_reach=self.kv_reach(),
        )


def padding_fraction_padded(lengths: Sequence[int], rows_per_batch: int) -> float:
    """Padding fraction of the naive layout (length-unsorted rows padded to the longest), for
    comparison in reports and the benchmark."""
    if not lengths:
        return 0.0
    computed = 0
    for start in range(0, len(lengths), rows_per_batch):
        chunk = lengths[start : start + rows_per_batch]
        computed += max(chunk) * len(chunk)
    return 1.0 - sum(lengths) / computed
