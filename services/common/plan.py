"""`forage plan`'s estimates: GPU and host memory of each service of a run, from model shapes
and the config, before a GPU is rented (docs/deploy.md, "Sizing"). Pure arithmetic: no torch,
no weights, no GPU.

What is counted, and the rules (bytes; P parameters, T trained parameters, n learner ranks):

Learner (DeepSpeed, services/learner/engine.py; bf16 on CUDA, so ZeRO 0 runs as stage 1):
- model states. Stage 1 (DeepSpeed's BF16_Optimizer): bf16 weights 2T and fp32 gradient
  accumulation 4T on every rank, fp32 master weights 4T/n and Adam's m and v 8T/n. Stage 2:
  the fp32 gradients are partitioned too (4T/n), plus one bf16 reduce bucket (DeepSpeed's
  default 5e8 elements, at most 2T). Stage 3: everything partitioned, 18T/n, plus the
  parameters gathered for the layer being computed (2 x the largest tensor, bf16) and the
  reduce bucket. Without bf16 (a CPU learner) weights, gradients, m and v are fp32: 16T.
  With LoRA the frozen base is 2P (bf16; partitioned under stage 3 only) and T is the
  adapter: rank x (in + out) for every targeted linear layer ("all-linear": q, k, v, o, gate,
  up, down of every layer; peft leaves the LM head out).
- a reference model (learner.algorithm use_kl_loss or use_kl_in_reward): a plain bf16 copy,
  2P on every rank (services/learner/trainer.py loads it outside DeepSpeed, so ZeRO does
  not partition it). A critic (adv_estimator gae): a second set of model states.
- activations of the largest micro-batch, N computed tokens: N is learner.micro_batch_tokens,
  or the longest trajectory when that is longer (packing gives a longer sequence a micro-batch
  of its own). Per token and layer, what autograd keeps for a Qwen2/Llama decoder layer in
  bf16 (counted tensor by tensor from transformers' modules, the usual Korthikanti et al.
  method without dropout): two RMSNorms 8h each (fp32 input, bf16 normalised, output), attention
  10h (q and k after RoPE, k and v repeated to every head, SDPA's output and o_proj's input),
  the SwiGLU MLP 8f (gate, up, SiLU, product): **26h + 8f bytes**. Gradient checkpointing
  keeps each layer's input (2h a layer) and recomputes one layer at a time (+ 26h + 8f once).
  The `sdpa` kernel adds its (N, N) mask converted to a bf16 bias, kept by every layer
  (2 N^2 a layer); flash-attn and FlexAttention (learner.attention auto on CUDA) keep none.
  fp32 (CPU) doubles every figure.
- the log-prob tensors: the learner computes logits only at positions that predict a loss
  token (services/learner/logprobs.py), at most N of them, and the vocabulary's (K, V) float32
  log-softmax by logsumexp + gather. At the peak of one micro-batch's forward and backward
  there are 4.5 tensors of K x V x 4 bytes alive (bf16 logits, their fp32 copy, and the
  backward's fp32 temporaries), 6.5 with an entropy bonus (algorithm.entropy_coeff != 0: a
  second fp32 copy and a softmax), for fp32 logits (CPU) 4 and 5: counted with the learner's
  own token_logprobs / token_entropy on the CPU (the peak resident memory of a run over a
  2000 x 100,000 logits tensor). The plan takes K = N, the case of a micro-batch that is all
  loss tokens; a search trajectory's prompt and retrieved passages are not loss tokens, so a
  real micro-batch holds fewer.

vLLM (the rollout on a GPU): it takes gpu_memory_utilization x the GPU for itself whatever
else runs there (and refuses to start when less is free); inside that budget the weights
(P x 2 bytes / tensor parallel), the activation peak of its profiling run (max_num_batched_tokens
x (6f + 8h) bytes, plus the sampler's max_num_seqs x V float32 logits, 4 copies), CUDA graphs
and the CUDA context (1.5 GiB; 0.5 GiB with enforce_eager). The rest is KV cache:
2 x layers x kv_heads x head_dim x 2 bytes a token (`kv_cache_dtype: fp8` halves it). vLLM
refuses to start when the cache cannot hold one max_model_len sequence; it runs fewer
sequences than max_num_seqs at once when the cache holds fewer of them.

Retriever: the index at build-index's byte rules (bench/index_scale.py, where they were checked
against the files and the serving process's private memory): flat n x d x 4; IVF kinds codes
+ 8 bytes of id per vector + nlist x d x 4 centroids; HNSW kinds the graph's 4 x (2M +
M/(M-1)) + 12 bytes a vector; on a GPU flat and IVF-Flat vectors are cloned as fp16 and FAISS
keeps 1.5 GiB of scratch memory per GPU. The encoder: its weights (fp16 on CUDA) and a small
working set.

Every process on a GPU also holds its CUDA context (0.5 GiB is counted); a GPU "fits" when
the sum is at most 90% of its memory, "tight" up to 100% (within the estimate's error; the
measured peaks in bench/README.md, "GPU check", are met within the tolerance the tests state).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from services.common.plan_shapes import (
    KNOWN_ENCODERS,
    WIKI18_DIM,
    WIKI18_ROWS,
    lookup_encoder,
    lookup_model,
)

GIB = 1 << 30
# Per-process CUDA context (and the allocator's first segments) on each GPU a process uses.
CUDA_CONTEXT = GIB // 2
# Above this share of a GPU the plan says "tight": the estimate's own error could tip it.
TIGHT = 0.90
# vLLM: CUDA graphs + context + non-torch allocations (enforce_eager: context only).
VLLM_OVERHEAD = int(1.5 * GIB)
VLLM_OVERHEAD_EAGER = GIB // 2
VLLM_BATCHED_TOKENS = 8192  # max_num_batched_tokens when vllm_engine_args leaves it out
# FAISS StandardGpuResources' default scratch memory on a large GPU.
FAISS_GPU_TEMP = int(1.5 * GIB)
ENCODER_WORKING = GIB // 4
# DeepSpeed defaults: reduce_bucket_size (elements) and stage 3's prefetch bucket.
REDUCE_BUCKET = 500_000_000
PREFETCH_BUCKET = 50_000_000
# Log-prob tensors (K x V x 4 bytes) alive at the peak of a micro-batch's forward + backward,
# counted on the learner's own functions (module docstring): (bf16 logits, fp32 logits).
LOGIT_COPIES = {False: (4.5, 4.0), True: (6.5, 5.0)}  # key: entropy bonus
LOGIT_COPIES_NO_GRAD = 3.0
LORA_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Host memory of a process before it holds anything of the run (interpreter, torch and the
# libraries a service imports).
PROCESS_BASE = {"torch": int(0.5 * GIB), "plain": int(0.1 * GIB)}


class PlanError(ValueError):
    """The plan cannot be made (an unknown model, a layout it cannot read); one line."""


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


# --------------------------------------------------------------------------- model shapes

@dataclass(frozen=True)
class Shape:
    """The fields of a decoder's config.json that memory depends on."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    head_dim: int | None = None
    attention_bias: bool = False
    source: str = ""

    @classmethod
    def from_config(cls, data: Mapping[str, Any], name: str, source: str) -> Shape:
        text = data.get("text_config") if "hidden_size" not in data else None
        data = text if isinstance(text, Mapping) else data
        try:
            heads = int(data["num_attention_heads"])
            return cls(
                name=name, hidden_size=int(data["hidden_size"]),
                intermediate_size=int(data["intermediate_size"]),
                num_hidden_layers=int(data["num_hidden_layers"]), num_attention_heads=heads,
                num_key_value_heads=int(data.get("num_key_value_heads") or heads),
                vocab_size=int(data["vocab_size"]),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                max_position_embeddings=int(data.get("max_position_embeddings") or 4096),
                head_dim=int(data["head_dim"]) if data.get("head_dim") else None,
                # Qwen2 has q/k/v biases without saying so; Llama-style configs say it.
                attention_bias=bool(data.get("attention_bias",
                                             data.get("model_type") == "qwen2")),
                source=source,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{source}: not a decoder config.json ({exc!r} missing or bad)"
                            ) from None

    @property
    def head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer, by peft's module names."""
        h, f = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim),
                "v_proj": (h, self.kv_dim), "o_proj": (self.q_dim, h),
                "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}

    def layer_params(self) -> int:
        bias = (self.q_dim + 2 * self.kv_dim) if self.attention_bias else 0
        return sum(i * o for i, o in self.linears().values()) + bias + 2 * self.hidden_size

    def params(self) -> int:
        """Every parameter, a tied LM head counted once (as a state dict stores it)."""
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embedding
        return self.num_hidden_layers * self.layer_params() + self.hidden_size + embedding + head

    def critic_params(self) -> int:
        """AutoModelForTokenClassification of the same body: no LM head, a hidden x 1 score."""
        return self.num_hidden_layers * self.layer_params() + self.hidden_size \
            + self.vocab_size * self.hidden_size + self.hidden_size + 1

    def largest_tensor(self) -> int:
        return max(self.vocab_size * self.hidden_size,
                   max(i * o for i, o in self.linears().values()))

    def lora_params(self, rank: int, targets: str | list[str] = "all-linear") -> int:
        """Adapter parameters: rank x (in + out) per targeted linear layer, every layer."""
        names = LORA_ALL_LINEAR if targets == "all-linear" else \
            [targets] if isinstance(targets, str) else list(targets)
        linears = self.linears()
        unknown = [n for n in names if n not in linears]
        if unknown:
            raise PlanError(f"learner.lora.target_modules {unknown} are not linear layers of "
                            f"{self.name} (known: {', '.join(linears)})")
        per_layer = sum(rank * (linears[n][0] + linears[n][1]) for n in names)
        return per_layer * self.num_hidden_layers

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head * dtype_bytes

    def activation_bytes_per_token(self) -> int:
        """bf16 bytes autograd keeps per token in one decoder layer (module docstring)."""
        return 26 * self.hidden_size + 8 * self.intermediate_size

    def describe(self) -> str:
        return (f"{self.name}: {self.params() / 1e9:.2f} B parameters, hidden "
                f"{self.hidden_size}, {self.num_hidden_layers} layers, "
                f"{self.num_attention_heads}/{self.num_key_value_heads} heads, "
                f"vocabulary {self.vocab_size:,} ({self.source})")


def resolve_model(model_path: str | None, model_config: str | Path | None = None) -> Shape:
    """The policy's shape: --model-config, else model.path/config.json when it is here, else
    the table of known public models by the directory's name."""
    if model_config:
        path = Path(model_config)
        return Shape.from_config(_read_json(path), path.parent.name or path.name, str(path))
    if not model_path:
        raise PlanError("model.path is not set: give the config's model, or --model-config "
                        "config.json")
    local = Path(model_path) / "config.json"
    if local.is_file():
        return Shape.from_config(_read_json(local), Path(model_path).name, str(local))
    known = lookup_model(model_path)
    if known is None:
        raise PlanError(f"model.path {model_path}: no config.json there and not a model plan "
                        "knows by name; pass --model-config path/to/config.json")
    name, fields = known
    return Shape.from_config(fields, name, f"table: {name}'s public config.json")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: not a JSON object")
    return data


# --------------------------------------------------------------------------- learner

@dataclass(frozen=True)
class LearnerSetup:
    shape: Shape
    ranks: int = 1
    zero_stage: int = 0
    bf16: bool = True
    gradient_checkpointing: bool = False
    micro_tokens: int = 4096  # computed tokens of the largest micro-batch
    logit_tokens: int | None = None  # positions with logits (None: every one, = micro_tokens)
    entropy_bonus: bool = False
    reference: bool = False
    critic: bool = False
    lora_rank: int = 0
    lora_targets: str | list[str] = "all-linear"
    dense_mask: bool = False  # learner.attention sdpa: an (N, N) mask per layer

    @property
    def stage(self) -> int:
        """The stage DeepSpeed runs: bf16 needs ZeRO >= 1 (services/learner/engine.py)."""
        return max(self.zero_stage, 1) if self.bf16 else self.zero_stage


@dataclass
class Item:
    name: str
    bytes: int
    note: str = ""


@dataclass
class LearnerEstimate:
    setup: LearnerSetup
    items: list[Item]
    trained: int
    per_token_no_ckpt: int  # activation bytes per token, whole model, without checkpointing
    per_token_ckpt: int  # with checkpointing: the layer inputs (+ one layer, once)
    logit_tensor: int  # one K x V x 4 tensor
    step_peak: int  # the optimizer step: states + Adam's fp32 temporary

    @property
    def peak(self) -> int:
        return max(sum(i.bytes for i in self.items), self.step_peak)

    def states(self) -> int:
        return sum(i.bytes for i in self.items if i.name in STATE_ITEMS)


STATE_ITEMS = ("weights", "gradients", "optimizer", "ZeRO-3 working set", "reduce bucket",
               "frozen base", "critic")


def _model_states(trained: int, frozen: int, s: LearnerSetup, shape: Shape) -> list[Item]:
    n, stage = s.ranks, s.stage
    if not s.bf16:  # fp32 weights, gradients, Adam m and v
        weights = 4 * trained // (n if stage == 3 else 1)
        grads = 4 * trained // (n if stage >= 2 else 1)
        optim = 8 * trained // (n if stage >= 1 else 1)
        items = [Item("weights", weights, "fp32"), Item("gradients", grads, "fp32"),
                 Item("optimizer", optim, "Adam m, v (fp32)")]
    else:
        weights = 2 * trained // (n if stage == 3 else 1)
        grads = 4 * trained // (n if stage >= 2 else 1)
        optim = 12 * trained // n
        where = "every rank" if stage == 1 else f"/ {n} ranks"
        items = [Item("weights", weights, "bf16" + (f", / {n} ranks" if stage == 3 else "")),
                 Item("gradients", grads, f"fp32 accumulation, {where}"),
                 Item("optimizer", optim, f"fp32 master + Adam m, v, / {n} ranks"
                      if n > 1 else "fp32 master + Adam m, v")]
    if stage >= 2:
        items.append(Item("reduce bucket", 2 * min(trained, REDUCE_BUCKET), "bf16"))
    if stage == 3:
        working = 2 * 2 * shape.largest_tensor() + 2 * PREFETCH_BUCKET
        items.append(Item("ZeRO-3 working set", working,
                          "gathered parameters of the layer computed + prefetch"))
    if frozen:
        per_byte = 2 if s.bf16 else 4
        items.append(Item("frozen base", per_byte * frozen // (n if stage == 3 else 1),
                          "LoRA: the base model, not trained"))
    return items


def estimate_learner(s: LearnerSetup) -> LearnerEstimate:
    shape = s.shape
    total = shape.params()
    trained = shape.lora_params(s.lora_rank, s.lora_targets) if s.lora_rank else total
    frozen = total if s.lora_rank else 0
    items = _model_states(trained, frozen, s, shape)
    if s.critic:
        critic = _model_states(shape.critic_params(), 0, replace(s, lora_rank=0), shape)
        items.append(Item("critic", sum(i.bytes for i in critic), "its own model states"))
    if s.reference:
        items.append(Item("reference model", (2 if s.bf16 else 4) * total,
                          "a plain copy on every rank, not ZeRO-partitioned"))
    scale = 1 if s.bf16 else 2
    n_tok, layers, h = s.micro_tokens, shape.num_hidden_layers, shape.hidden_size
    per_layer = shape.activation_bytes_per_token() * scale
    mask_layer = 2 * scale * n_tok * n_tok if s.dense_mask else 0
    no_ckpt = layers * (n_tok * per_layer + mask_layer)
    ckpt = layers * n_tok * 2 * h * scale + n_tok * per_layer + mask_layer
    if s.gradient_checkpointing:
        items.append(Item("activations", ckpt,
                          f"checkpointing: {layers} layer inputs + 1 layer recomputed, "
                          f"{n_tok:,} tokens"))
    else:
        items.append(Item("activations", no_ckpt,
                          f"no checkpointing: {layers} layers x {n_tok:,} tokens"))
    k = s.logit_tokens or n_tok
    tensor = k * shape.vocab_size * 4
    copies = LOGIT_COPIES[s.entropy_bonus][0 if s.bf16 else 1]
    items.append(Item("log-probs", int(copies * tensor),
                      f"{copies:g} x ({k:,} x {shape.vocab_size:,} x 4 B = {gib(tensor)})"
                      + (", entropy bonus" if s.entropy_bonus else "")))
    states = sum(i.bytes for i in items if i.name in STATE_ITEMS)
    extra = sum(i.bytes for i in items if i.name == "reference model")
    step_peak = states + extra + 4 * trained // s.ranks  # Adam's foreach sqrt temporary
    return LearnerEstimate(s, items, trained, per_token_no_ckpt=layers * per_layer,
                           per_token_ckpt=layers * 2 * h * scale, logit_tensor=tensor,
                           step_peak=step_peak)


def longest_trajectory(rollout: Any) -> int:
    """Prompt + response bound of one trajectory: the response is bounded by
    max_response_length and by its turns (max_turns + 1 generations, max_turns observations)."""
    turns = rollout.max_turns
    by_turns = (turns + 1) * rollout.max_tokens_per_turn + turns * rollout.max_obs_length
    return rollout.max_prompt_length + min(rollout.max_response_length, by_turns)


def learner_setup(cfg: Any, shape: Shape, ranks: int, on_gpu: bool) -> LearnerSetup:
    learner, alg = cfg.learner, dict(cfg.learner.algorithm)
    bf16 = learner.bf16 == "on" or (learner.bf16 == "auto" and on_gpu)
    attention = learner.attention
    dense = attention == "sdpa" or (attention == "auto" and not on_gpu)
    return LearnerSetup(
        shape=shape, ranks=max(1, ranks), zero_stage=learner.zero_stage, bf16=bf16,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        micro_tokens=max(learner.micro_batch_tokens, longest_trajectory(cfg.rollout)),
        entropy_bonus=float(alg.get("entropy_coeff", 0.0) or 0.0) != 0.0,
        reference=bool(alg.get("use_kl_loss", False) or alg.get("use_kl_in_reward", False)),
        critic=learner.adv_estimator == "gae",
        lora_rank=learner.lora.rank, lora_targets=learner.lora.target_modules,
        dense_mask=dense and learner.shared_prompts,
    )


# --------------------------------------------------------------------------- vLLM

@dataclass(frozen=True)
class VllmSetup:
    shape: Shape
    gpu_bytes: int
    utilization: float = 0.9
    kv_cache_gib: float = 0.0
    tensor_parallel: int = 1
    max_num_seqs: int = 256
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    trajectory_tokens: int = 0  # prompt + response bound of one trajectory
    batched_tokens: int = VLLM_BATCHED_TOKENS
    kv_dtype_bytes: int = 2
    enforce_eager: bool = False
    dtype_bytes: int = 2  # rollout.dtype: float32 4, else 2 (auto: the checkpoint's bf16)


@dataclass
class VllmEstimate:
    setup: VllmSetup
    budget: int  # what vLLM takes of the GPU
    weights: int
    activation: int
    overhead: int
    kv: int
    kv_per_token: int
    max_model_len: int
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv) // self.kv_per_token

    def concurrent(self, tokens: int) -> float:
        return self.kv_tokens / max(1, tokens)


def estimate_vllm(s: VllmSetup) -> VllmEstimate:
    shape, tp = s.shape, max(1, s.tensor_parallel)
    weights = s.dtype_bytes * shape.params() // tp
    h, f = shape.hidden_size, shape.intermediate_size
    activation = s.batched_tokens * (6 * f + 8 * h) // tp \
        + 4 * s.max_num_seqs * shape.vocab_size * 4
    overhead = VLLM_OVERHEAD_EAGER if s.enforce_eager else VLLM_OVERHEAD
    per_token = shape.kv_bytes_per_token(s.kv_dtype_bytes) // tp
    max_len = s.max_model_len or shape.max_position_embeddings
    if s.kv_cache_gib:
        kv = int(s.kv_cache_gib * GIB)
        budget = weights + activation + overhead + kv
    else:
        budget = int(s.utilization * s.gpu_bytes)
        kv = budget - weights - activation - overhead
    est = VllmEstimate(s, budget, weights, activation, overhead, kv, per_token, max_len)
    if kv <= 0:
        est.problems.append(
            f"vLLM's {s.utilization:g} of the GPU ({gib(budget)}) leaves no KV cache after "
            f"weights, activations and overhead ({gib(weights + activation + overhead)}): "
            "vLLM refuses to start (no memory for the cache blocks)")
    elif est.kv_tokens < max_len:
        est.problems.append(
            f"the KV cache holds {est.kv_tokens:,} tokens, less than one max_model_len "
            f"sequence ({max_len:,}): vLLM refuses to start")
    else:
        traj = s.trajectory_tokens or max_len
        if est.concurrent(traj) < s.max_num_seqs:
            est.warnings.append(
                f"KV cache {gib(kv)} = {est.kv_tokens:,} tokens: {int(est.concurrent(traj)):,} "
                f"trajectories of {traj:,} tokens at once, not max_num_seqs {s.max_num_seqs:,}")
    return est


def vllm_setup(cfg: Any, shape: Shape, gpu_bytes: int) -> VllmSetup:
    rollout = cfg.rollout
    args = rollout.vllm_engine_args
    kv_dtype = str(args.get("kv_cache_dtype", "auto"))
    return VllmSetup(
        shape=shape, gpu_bytes=gpu_bytes, utilization=rollout.gpu_memory_utilization,
        kv_cache_gib=rollout.kv_cache_gib, tensor_parallel=rollout.tensor_parallel_size,
        max_num_seqs=rollout.max_batch_size, max_model_len=rollout.max_model_len,
        trajectory_tokens=longest_trajectory(rollout),
        batched_tokens=int(args.get("max_num_batched_tokens") or VLLM_BATCHED_TOKENS),
        kv_dtype_bytes=1 if kv_dtype.startswith("fp8") else 2,
        enforce_eager=rollout.enforce_eager,
        dtype_bytes=4 if rollout.dtype == "float32" else 2,
    )


def sequences_in_flight(cfg: Any) -> int:
    """The most sequences one replica decodes at once: max_batch_size, unless the run never
    offers that many (no evaluation, and train_batch_size x n_samples x (1 + max_staleness)
    trajectories in flight at most)."""
    learner = cfg.learner
    cap = cfg.rollout.max_batch_size
    if learner.eval_before or learner.eval_every or learner.eval_at_end:
        return cap
    return min(cap, learner.train_batch_size * cfg.data.n_samples
               * (1 + learner.max_staleness))


def transformers_engine_bytes(cfg: Any, shape: Shape, on_gpu: bool) -> list[Item]:
    """The transformers engine: its weights, a KV cache for the sequences in flight at their
    longest (it grows with them: a dynamic cache) and the logits of one decoding step."""
    rollout = cfg.rollout
    dtype = {"float32": 4, "bfloat16": 2, "float16": 2}.get(rollout.dtype, 2 if on_gpu else 4)
    traj = longest_trajectory(rollout)
    rows = sequences_in_flight(cfg)
    return [Item("weights", dtype * shape.params(), f"{dtype} B/param"),
            Item("KV cache", rows * traj * shape.kv_bytes_per_token(dtype),
                 f"{rows} x {traj:,} tokens"),
            Item("logits", rows * shape.vocab_size * 4 * 2, "one step")]


# --------------------------------------------------------------------------- retriever

@dataclass(frozen=True)
class IndexSpec:
    rows: int
    dim: int
    kind: str = "flat"  # a build-index kind or a FAISS factory string
    factory: str | None = None
    source: str = ""
    encoder: str = "e5-base-v2"
    encoder_params: int | None = None


def nlist_for(rows: int) -> int:
    """build-index's IVF list count (services/retriever/indexes.py `_nlist`)."""
    return max(1, min(int(4 * math.sqrt(max(rows, 1))), rows // 39))


def pq_m_for(dim: int) -> int:
    """build-index's PQ sub-quantizers: the largest divisor of dim up to 64."""
    return max(m for m in range(1, min(dim, 64) + 1) if dim % m == 0)


PRESET_FACTORIES = {"flat": "Flat", "hnsw": "HNSW32,Flat", "ivf": "IVF*,Flat",
                    "ivf-sq8": "IVF*,SQ8", "ivf-sqfp16": "IVF*,SQfp16", "ivf-pq": "IVF*,PQ*",
                    "hnsw-sq8": "HNSW32,SQ8"}


def index_bytes(spec: IndexSpec, on_gpu: bool = False) -> int:
    """Bytes the index holds in memory (bench/index_scale.py's rule); on a GPU, flat and
    IVF-Flat vectors as fp16 (services/retriever/indexes.py clones with useFloat16)."""
    n, d = spec.rows, spec.dim
    factory = spec.factory or PRESET_FACTORIES.get(spec.kind, spec.kind)
    factory = factory.replace("IVF*", f"IVF{nlist_for(n)}").replace("PQ*", f"PQ{pq_m_for(d)}")
    vector = 2 * d if on_gpu else 4 * d
    ivf = re.search(r"IVF(\d+)", factory)
    hnsw = re.search(r"HNSW(\d+)", factory)
    if "PQ" in factory:
        m = re.search(r"PQ(\d+)(?:x(\d+))?", factory)
        bits = int(m.group(2) or 8) if m else 8
        code = int(m.group(1)) * bits // 8 if m else pq_m_for(d)
        fixed = 256 * d * 4
    elif "SQ8" in factory:
        code, fixed = d, 2 * d * 4
    elif "SQfp16" in factory:
        code, fixed = 2 * d, 0
    elif "SQ4" in factory:
        code, fixed = d // 2, 2 * d * 4
    else:  # Flat storage
        code, fixed = vector, 0
    if ivf:
        return n * (code + 8) + int(ivf.group(1)) * d * 4 + fixed
    if hnsw:
        m = int(hnsw.group(1))
        graph = 4 * (2 * m + m / (m - 1)) + 12
        return int(n * (code + graph)) + fixed
    return n * code + fixed


def read_index_spec(index_dir: str | None, rows: int | None = None, dim: int | None = None,
                    kind: str | None = None) -> IndexSpec:
    """From the index's manifest.json when it is here, else wiki-18 (Search-R1's corpus, what
    configs/search_r1_* serve) unless rows/dim/kind say otherwise."""
    manifest = Path(index_dir) / "manifest.json" if index_dir else None
    if manifest is not None and manifest.is_file() and rows is None:
        data = _read_json(manifest)
        params = data.get("params") or {}
        encoder = str(data.get("encoder_name") or data.get("encoder") or "")
        return IndexSpec(rows=int(data["count"]), dim=int(data["dim"]),
                         kind=kind or str(data.get("index_type", "flat")),
                         factory=params.get("factory"), source=str(manifest),
                         encoder=encoder or "e5-base-v2",
                         encoder_params=_encoder_params_at(data.get("encoder")))
    return IndexSpec(rows=rows or WIKI18_ROWS, dim=dim or WIKI18_DIM, kind=kind or "flat",
                     source="given" if rows else "assumed: wiki-18 (21,015,324 x 768), "
                     "as configs/search_r1_* index it")


def _encoder_params_at(path: Any) -> int | None:
    config = Path(str(path)) / "config.json" if path else None
    if config is None or not config.is_file():
        return None
    try:
        return bert_params(_read_json(config))
    except (KeyError, TypeError, ValueError):
        return None


def bert_params(c: Mapping[str, Any]) -> int:
    """A BERT encoder's parameters (embeddings, layers, pooler)."""
    h, f, layers = int(c["hidden_size"]), int(c["intermediate_size"]), int(c["num_hidden_layers"])
    embeddings = (int(c["vocab_size"]) + int(c.get("max_position_embeddings", 512)) + 2) * h \
        + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * f + f) + (f * h + h) + 2 * h
    return embeddings + layers * layer + h * h + h


def encoder_params(spec: IndexSpec) -> tuple[int, str]:
    """(parameters, name) of the index's encoder: its own config.json when the manifest's
    encoder directory is here, else the known encoders by name, else e5-base-v2."""
    if spec.encoder_params:
        return spec.encoder_params, spec.encoder
    known = lookup_encoder(spec.encoder) or ("e5-base-v2", KNOWN_ENCODERS["e5-base-v2"])
    return bert_params(known[1]), known[0]


def encoder_hidden(name: str) -> int:
    known = lookup_encoder(name)
    return int(known[1]["hidden_size"]) if known else 768


# --------------------------------------------------------------------------- advice helpers

def micro_batch_that_fits(setup: LearnerSetup, budget: int, floor: int) -> int | None:
    """The largest learner.micro_batch_tokens (a multiple of 1024, at least `floor`, the
    longest trajectory) whose learner peak is within `budget`, or None."""
    best = None
    tokens = max(1024, -(-floor // 1024) * 1024)
    while tokens <= setup.micro_tokens:
        if estimate_learner(replace(setup, micro_tokens=tokens)).peak <= budget:
            best = tokens
        tokens += 1024
    if best is None and estimate_learner(replace(setup, micro_tokens=floor)).peak <= budget:
        best = floor
    return best


def ranks_that_fit(setup: LearnerSetup, budget: int, most: int = 64) -> int | None:
    for ranks in range(setup.ranks + 1, most + 1):
        if estimate_learner(replace(setup, ranks=ranks, zero_stage=3)).peak <= budget:
            return ranks
    return None
