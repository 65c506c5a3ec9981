"""The multi-turn search agent loop (Search-R1 semantics, docs/architecture.md), token-in/token-out.

Each trajectory alternates policy turns and observations. A turn is one engine request whose
prompt is the trajectory's prompt ids + every response id so far (never re-tokenized text).
The turn stops at `</search>` / `</answer>` or EOS; its action is the first
`<(search|answer)>…</…>` in the decoded turn. search → the query joins the next batched
/retrieve call and the observation `\\n\\n<information>…</information>\\n\\n` is appended;
answer → done; neither → Search-R1's corrective message. An empty `<search> </search>` sends
"" (Search-R1 retrieves for it); a query the retriever refuses gets a `Search failed: ...`
observation and only an outage errors the trajectories of that call (services.rollout.retrieval).
After `max_turns` such rounds a trajectory gets one final turn whose search is not executed.
Observation tokens get loss_mask 0 and log-prob 0.

Scheduling. `continuous` (default): a trajectory whose turn ended goes back to the engine as
soon as its observation is ready, and searches are sent while the engine keeps decoding the
others (one /retrieve in flight; searches that end meanwhile join the next call). `lockstep`:
Search-R1's schedule — every active trajectory runs turn t, then one /retrieve for all, then
turn t+1 — kept as a baseline for bench/rollout.py.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.evidence import rewrite_stops
from services.common.formats import (
    CORRECTIVE_MESSAGE,
    STOP_STRINGS,
    doc_refs,
    information_block,
    parse_action,
    passages_to_string,
)
from services.common.retrieval_health import golds_of, merge, turn_retrieval
from services.common.tool_calls import (
    HERMES,
    ToolCall,
    ToolCallError,
    detect_format,
    parse_turn,
)
from services.common.tools import ToolSpec
from services.common.trajectory import (
    EvidenceProbe,
    Probe,
    PromptGroup,
    Trajectory,
    Turn,
    TurnRetrieval,
)
from services.rollout import metrics
from services.rollout.engine import Engine, GenerationOutput, GenerationRequest, SamplingParams
from services.rollout.evidence import (
    DonorPool,
    evidence_prompts,
    has_evidence,
    tool_evidence_prompts,
)
from services.rollout.probe import (
    ProbeSettings,
    cut_suffixes,
    probe_prompts,
    probe_rule,
    probe_stops,
    reasoning_span,
)
from services.rollout.retrieval import (
    QueryFailed,
    QueryRejected,
    RetrieverClient,
    RetrieverError,
)
from services.rollout.tool_runner import Toolbox, ToolResult, ToolRunner
from services.rollout.tools import ChatTurns, ToolStats, timed_calculator

log = logging.getLogger("forage.rollout.agent")


@dataclass
class LoopSettings:
    max_turns: int = 4
    max_tokens_per_turn: int = 500
    max_obs_length: int = 500
    max_response_length: int = 2048
    max_prompt_length: int = 4096
    use_search: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: tuple[str, ...] = STOP_STRINGS
    scheduling: Literal["continuous", "lockstep"] = "continuous"
    protocol: Literal["tags", "tool_calls"] = "tags"
    # Built-in names and user tools (services.common.config.rollout.UserTool or its mapping).
    tools: tuple[Any, ...] = ("search",)
    mcp_servers: tuple[Any, ...] = ()  # McpServer entries (or mappings)

    @classmethod
    def from_config(cls, rollout: Any) -> LoopSettings:
        return cls(
            max_turns=rollout.max_turns,
            max_tokens_per_turn=rollout.max_tokens_per_turn,
            max_obs_length=rollout.max_obs_length,
            max_response_length=rollout.max_response_length,
            max_prompt_length=rollout.max_prompt_length,
            use_search=rollout.use_search,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            stop_strings=tuple(rollout.stop_strings),
            scheduling=rollout.scheduling,
            protocol=getattr(rollout, "protocol", "tags"),
            tools=tuple(getattr(rollout, "tools", ("search",))),
            mcp_servers=tuple(getattr(rollout, "mcp_servers", ())),
        )


@dataclass
class _State:
    group: PromptGroup
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    max_turns: int
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    rounds: int = 0
    searches: int = 0
    finish_reason: str | None = None
    error: str | None = None
    probe: Probe | None = None
    probe_pending: int = 0
    probe_waves: list[list[GenerationRequest]] = field(default_factory=list)
    # probe.evidence: the rewrites of the final turn, and how many are still being generated.
    evidence: EvidenceProbe | None = None
    evidence_pending: int = 0
    # tool_calls protocol: the prompt messages (the context inserted turns are rendered after),
    # the results of the turn's calls as they arrive (None: a search still out), whether the
    # turn ended on the end-of-turn token itself, and per-tool statistics.
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_results: list[tuple[str, str | None] | None] = field(default_factory=list)
    tool_ids: list[str] = field(default_factory=list)  # each call's id, as its result names it
    turn_end: str = ""
    search_started: dict[int, float] = field(default_factory=dict)
    tool_stats: ToolStats = field(default_factory=ToolStats)
    # The group's gold answers, normalised, for retrieval health (None: none to look for);
    # read once per trajectory, on its first search result.
    golds: list[str] | None = None
    golds_read: bool = False

    @property
    def generating_done(self) -> bool:
        return self.finish_reason is not None

    @property
    def done(self) -> bool:
        return (self.finish_reason is not None and self.probe_pending == 0
                and not self.probe_waves and self.evidence_pending == 0)


class AgentLoop:
    """Plays prompt groups to trajectories through an engine and a retriever."""

    def __init__(
        self,
        engine: Engine,
        settings: LoopSettings,
        retriever: RetrieverClient | None = None,
        probe: ProbeSettings | None = None,
        on_step: Callable[[], None] | None = None,
        seed: int = 0,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.settings = settings
        self.retriever = retriever
        self.probe = probe or ProbeSettings()
        self.on_step = on_step
        self._rng = random.Random(seed)
        # probe.evidence draws from its own generator: turning it on leaves the truncation
        # probe's draws as they were.
        self.evidence = self.probe.evidence
        self._evidence_rng = random.Random(f"forage-evidence:{seed}")
        self._donors = DonorPool()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieve")
        self.tool_mode = settings.protocol == "tool_calls"
        self.tool_specs: list[ToolSpec] = []
        self.chat: ChatTurns | None = None
        self.toolbox: Toolbox | None = None
        self.runner: ToolRunner | None = None
        self._end_id: int | None = None
        self._tool_stops: tuple[str, ...] = ()
        self._tool_stop_ids: tuple[int, ...] = ()
        self._turn_end_ids: frozenset[int] = frozenset()
        self._drop_ids: frozenset[int] = frozenset()
        self.tool_format = HERMES
        if self.tool_mode:
            # User functions are loaded and MCP servers listed here, at replica start: a bad
            # entry stops the replica with a one-line ToolLoadError naming it.
            self.toolbox = Toolbox.build(settings.tools, settings.mcp_servers)
            self.runner = self.toolbox.runner
            self.tool_specs = self.toolbox.specs
            self._tool_names = frozenset(self.toolbox.names)
            self.chat = ChatTurns(self.tokenizer, self.tool_specs)
            self.tool_format = detect_format(getattr(self.tokenizer, "chat_template", None))
            self._tool_stops, self._tool_stop_ids = self._turn_stops(engine)

    def _turn_stops(self, engine: Engine) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Where a tool_calls turn stops: at its end of turn (EOS, or the template's end of
        turn and the format's other end tokens, on their ids and text), and where the model
        starts writing a tool's result itself (`ToolCallFormat.stops`). Never at the end of
        one call: a turn may hold several, which all run."""
        assert self.chat is not None
        fmt, vocab = self.tool_format, self.tokenizer.get_vocab()
        eos_ids = getattr(engine, "eos_ids", frozenset())
        stops, stop_ids, ends = list(fmt.stops), [], []
        if self.chat.end_of_turn is not None:
            self._end_id = int(self.tokenizer.convert_tokens_to_ids(self.chat.end_of_turn))
            ends.append(self._end_id)
        ends += [vocab[token] for token in fmt.end_tokens if token in vocab]
        self._turn_end_ids = frozenset(ends)
        for token_id in [*ends, *(vocab[t] for t in fmt.stops if t in vocab)]:
            if token_id not in eos_ids and token_id not in stop_ids:
                # vLLM matches stop strings on text without special tokens: the id as well
                stop_ids.append(token_id)
                text = self.tokenizer.convert_ids_to_tokens(token_id)
                if text not in stops:
                    stops.append(text)
        keep = {vocab[token] for token in fmt.keep if token in vocab}
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        self._drop_ids = frozenset(special - keep)
        return tuple(stops), tuple(stop_ids)

    @property
    def tool_stops(self) -> tuple[str, ...]:
        """Stop strings of a tool_calls turn: `</tool_call>`, and the template's end of turn
        when it is not the model's EOS (empty in the tags protocol)."""
        return self._tool_stops if self.tool_mode else ()

    @property
    def tool_stop_ids(self) -> tuple[int, ...]:
        """Stop token ids of a tool_calls turn: the template's end-of-turn id when it is not
        the model's EOS (empty otherwise and in the tags protocol)."""
        return self._tool_stop_ids if self.tool_mode else ()

    # ------------------------------------------------------------------ prompts

    def prompt_ids(self, group: PromptGroup) -> list[int]:
        """Chat template when the tokenizer has one (and the prompt is messages), else text."""
        prompt = group.prompt
        if self.chat is not None:  # tool_calls: the template with the tools, always
            ids = self.chat.prompt_ids(self._messages(group))
            return ids[-self.settings.max_prompt_length :]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            text = "".join(message["content"] for message in prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids = list(ids)
        return ids[-self.settings.max_prompt_length :]

    @staticmethod
    def _messages(group: PromptGroup) -> list[dict[str, Any]]:
        """A group's prompt as chat messages (a raw-text prompt becomes one user message)."""
        if isinstance(group.prompt, str):
            return [{"role": "user", "content": group.prompt}]
        return [dict(message) for message in group.prompt]

    def _group_params(self, group: PromptGroup) -> tuple[SamplingParams, int]:
        s = self.settings
        overrides = dict(group.sampling)
        temperature = overrides.get("temperature", 0.0 if group.kind == "eval" else s.temperature)
        params = SamplingParams(
            temperature=float(temperature),
            top_p=float(overrides.get("top_p", s.top_p)),
            top_k=int(overrides.get("top_k", s.top_k)),
            max_tokens=s.max_tokens_per_turn,
            stop=self._tool_stops if self.tool_mode else s.stop_strings,
            stop_token_ids=self.tool_stop_ids,
        )
        return params, int(overrides.get("max_turns", s.max_turns))

    # ------------------------------------------------------------------ main loop

    def run(
        self,
        groups: Sequence[PromptGroup],
        on_group_done: Callable[[PromptGroup, list[Trajectory]], None] | None = None,
        feed: Callable[[int], Sequence[PromptGroup]] | None = None,
    ) -> list[Trajectory]:
        """Play every sample of every group; returns the trajectories of `groups`, grouped, in
        input order.

        `on_group_done` is called as soon as all `n` trajectories of a group are finished, so a
        service can publish and ack that group while others still run.

        `feed(free)` keeps the engine full (continuous scheduling; lockstep rounds take no
        newcomers): it is called between engine steps with the number of sequence slots free,
        `engine.max_batch_size` minus the trajectories still in flight, and the groups it
        returns start at once. Without it a replica would take a batch of groups and play it
        to the end, its engine emptying while the slowest trajectory of the batch finishes.
        Fed groups reach `on_group_done` only and are forgotten once reported (a run fed from
        a stream may last as long as the stream has work). The run ends when nothing is in
        flight and `feed` returns nothing.
        """
        lockstep = self.settings.scheduling == "lockstep"
        if lockstep:
            feed = None
        by_group: dict[int, list[_State]] = {}
        group_of: dict[int, int] = {}  # id(state) -> group index
        group_at: dict[int, PromptGroup] = {}
        reported: set[int] = set()
        results: dict[int, list[Trajectory]] = {}
        kept = len(groups)  # group indices below this are returned; fed ones are not kept
        next_index = 0

        def start(new: Sequence[PromptGroup]) -> None:
            nonlocal next_index
            members_all: list[_State] = []
            for group in new:
                gi, next_index = next_index, next_index + 1
                prompt_ids = self.prompt_ids(group)
                params, max_turns = self._group_params(group)
                members = [
                    _State(group, i, prompt_ids, params, max_turns) for i in range(max(1, group.n))
                ]
                if self.tool_mode:
                    for member in members:
                        member.messages = self._messages(group)
                by_group[gi], group_at[gi] = members, group
                for member in members:
                    group_of[id(member)] = gi
                members_all.extend(members)
            for state in members_all:
                self._submit_turn(state)

        def in_flight() -> int:
            return sum(not member.done for gi, members in by_group.items()
                       if gi not in reported for member in members)

        deferred: list[_State] = []  # lockstep: continue next round
        # (state, query, slot) waiting for a /retrieve call; slot: the tool call's index in its
        # turn (tool_calls protocol), None for a <search> tag.
        searches: list[tuple[_State, str, int | None]] = []
        inflight: tuple[Future, list[tuple[_State, str, int | None]]] | None = None
        start(groups)
        tokens_at_start, started = self._tokens(), time.perf_counter()
        rate_from, rate_tokens = started, tokens_at_start

        def finish_check(state: _State) -> None:
            gi = group_of.get(id(state))
            if gi is None or gi in reported or not all(member.done for member in by_group[gi]):
                return
            reported.add(gi)
            trajectories = [self._trajectory(member) for member in by_group[gi]]
            group = group_at[gi]
            if gi < kept:
                results[gi] = trajectories
            else:  # fed: forget it, so a long-fed run holds only what is in flight
                for member in by_group.pop(gi):
                    group_of.pop(id(member), None)
                group_at.pop(gi)
                reported.discard(gi)
            for trajectory in trajectories:
                metrics.FINISHED.labels(trajectory.finish_reason).inc()
            if on_group_done is not None:
                on_group_done(group, trajectories)

        while True:
            if self.engine.has_unfinished():
                for output in self.engine.step():
                    touched = self._handle_output(output, searches, deferred, lockstep)
                    if touched is not None:
                        finish_check(touched)
                metrics.BATCH_OCCUPANCY.set(
                    self.engine.num_running() / max(1, self.engine.max_batch_size)
                )
            if self.on_step is not None:
                self.on_step()
            if feed is not None:  # before waiting on /retrieve: newcomers decode meanwhile
                free = self.engine.max_batch_size - in_flight()
                if free > 0:
                    newcomers = list(feed(free))
                    if newcomers:
                        start(newcomers)
            idle = not self.engine.has_unfinished()
            runner = self.runner
            if runner is not None and runner.pending:  # user / MCP tools: poll, never block
                if idle and inflight is None and not searches:
                    runner.wait(0.05)  # nothing to decode: sleep until a result may be in
                for result in runner.poll():
                    state = self._tool_result(result, deferred, lockstep)
                    finish_check(state)
                idle = not self.engine.has_unfinished()
            tools_pending = runner is not None and runner.pending > 0
            if inflight is None and searches and (not lockstep or idle):
                batch, searches = searches, []
                inflight = (self._pool.submit(self._retrieve, [item[1] for item in batch]), batch)
            if inflight is not None and (inflight[0].done() or idle):
                future, batch = inflight
                inflight = None
                for state in self._apply_results(future, batch, deferred, lockstep):
                    finish_check(state)
                idle = not self.engine.has_unfinished()
            if lockstep and idle and inflight is None and not searches and deferred \
                    and not tools_pending:
                for state in deferred:
                    self._submit_turn(state)
                deferred.clear()
            now = time.perf_counter()
            if now - rate_from >= 10.0:  # a fed run may never end: report the rate as it goes
                metrics.TOKENS_PER_S.set((self._tokens() - rate_tokens) / (now - rate_from))
                rate_from, rate_tokens = now, self._tokens()
            if not self.engine.has_unfinished() and inflight is None and not searches \
                    and not (self.runner is not None and self.runner.pending):
                if not deferred:
                    break
        elapsed = max(time.perf_counter() - rate_from, 1e-9)
        metrics.TOKENS_PER_S.set((self._tokens() - rate_tokens) / elapsed)
        for gi in list(by_group):  # groups whose members all errored early, etc.
            if gi not in reported:
                finish_check(by_group[gi][0])
        return [traj for gi in range(kept) for traj in results[gi]]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.toolbox is not None:
            self.toolbox.close()

    # ------------------------------------------------------------------ turns

    def _tokens(self) -> int:
        return int(getattr(self.engine, "tokens_generated", 0))

    def _submit_turn(self, state: _State) -> None:
        budget = self.settings.max_response_length - len(state.response)
        if budget <= 0:
            state.finish_reason = "length"
            return
        params = SamplingParams(
            temperature=state.params.temperature,
            top_p=state.params.top_p,
            top_k=state.params.top_k,
            max_tokens=min(self.settings.max_tokens_per_turn, budget),
            stop=state.params.stop,
            stop_token_ids=state.params.stop_token_ids,
        )
        request = GenerationRequest(
            state.prompt_ids + state.response, params, tag=("turn", state), cache_key=id(state)
        )
        self.engine.add_request(request)

    def _is_final_turn(self, state: _State) -> bool:
        return not self.settings.use_search or state.rounds >= state.max_turns

    def _handle_output(
        self,
        output: GenerationOutput,
        searches: list[tuple[_State, str, int | None]],
        deferred: list[_State],
        lockstep: bool,
    ) -> _State | None:
        kind, state = output.tag[0], output.tag[1]
        if kind == "probe":
            return self._handle_probe(output)
        if kind == "evidence":
            return self._handle_evidence(output)
        if output.finish in ("error", "aborted"):  # the engine rejected or aborted the turn
            state.finish_reason = "error"
            state.error = str(output.extra.get("error") or f"engine finish cause {output.finish}")
            self.engine.release(id(state))
            return state
        if self.tool_mode:
            return self._handle_tool_turn(output, state, searches, deferred, lockstep)
        start, end, text = self._append_generated(state, output)
        parsed = parse_action(text)
        action, query = (parsed[0], parsed[1]) if parsed else ("invalid", None)
        version = output.version_start
        out_of_room = output.finish == "length" and end >= self.settings.max_response_length

        if self._is_final_turn(state):
            if not self.settings.use_search and action == "invalid":
                action = "none"  # single-turn tasks (math, countdown): no tags required
            state.turns.append(Turn(start, end, action, query, version))
            metrics.TURNS.labels(action).inc()
            if action == "invalid":
                metrics.INVALID.inc()
            if action == "answer":
                state.finish_reason = "answer"
            elif output.finish == "length":
                state.finish_reason = "length"
            elif not self.settings.use_search:
                state.finish_reason = "answer"  # ended by EOS / stop: the task's answer
            else:
                state.finish_reason = "max_turns"  # a final-turn search is not executed
            self._start_probe(state)
            return state

        state.turns.append(Turn(start, end, action, query, version))
        metrics.TURNS.labels(action).inc()
        if action == "answer":
            state.finish_reason = "answer"
            self._start_probe(state)
            return state
        if out_of_room:
            if action == "invalid":
                metrics.INVALID.inc()
            state.finish_reason = "length"
            self._start_probe(state)
            return state
        state.rounds += 1
        if action == "search":
            searches.append((state, query or "", None))
            return None
        metrics.INVALID.inc()
        if self._append_observation(state, CORRECTIVE_MESSAGE):
            self._continue(state, deferred, lockstep)
        else:
            self._start_probe(state)
        return state

    # ------------------------------------------------------------------ tool calls

    def _append_generated(self, state: _State, output: GenerationOutput) -> tuple[int, int, str]:
        """Append a turn's generated tokens (trained on: mask 1) and return its [start, end)
        in the response and its decoded text."""
        start = len(state.response)
        state.response.extend(output.token_ids)
        state.mask.extend([1] * len(output.token_ids))
        state.logprobs.extend(output.logprobs)
        metrics.TOKENS.inc(len(output.token_ids))
        text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        return start, len(state.response), text

    def _handle_tool_turn(
        self,
        output: GenerationOutput,
        state: _State,
        searches: list[tuple[_State, str, int | None]],
        deferred: list[_State],
        lockstep: bool,
    ) -> _State | None:
        """A turn of the tool_calls protocol: an answer ends the trajectory, tool calls run
        (calculator here, search batched like <search> tags), anything else gets a corrective
        user turn. Every bad call is answered as the tool's result (never a trajectory error)."""
        start, end, _ = self._append_generated(state, output)
        # decoded with the special tokens the format reads (Mistral's [TOOL_CALLS], ...)
        text = self.tokenizer.decode([i for i in output.token_ids if i not in self._drop_ids],
                                     skip_special_tokens=False)
        parsed = parse_turn(text, self.tool_specs, self.tool_format)
        action, query = parsed.action, parsed.answer
        first = parsed.calls[0] if parsed.calls else None
        if isinstance(first, ToolCall) and first.name == "search":
            action, query = "search", str(first.arguments.get("query", ""))
        elif first is not None:
            query = first.raw
        state.turns.append(Turn(start, end, action, query, output.version_start))
        metrics.TURNS.labels(action).inc()
        if action == "invalid":
            metrics.INVALID.inc()
        if action == "answer":
            state.finish_reason = "answer"
        elif self._is_final_turn(state):  # a final-turn call is not executed
            state.finish_reason = "length" if output.finish == "length" else "max_turns"
        elif output.finish == "length" and end >= self.settings.max_response_length:
            state.finish_reason = "length"
        if state.finish_reason is not None:
            self._start_probe(state)
            return state
        state.rounds += 1
        # The end-of-turn token the policy generated itself is not inserted again (EOS, a stop
        # token id, or the end of turn matched as a stop string); another end token of the
        # format (Llama's <|eom_id|>) stands for the template's.
        last_id = output.token_ids[-1] if output.token_ids else None
        ended = output.finish == "eos" or last_id == self._end_id
        state.turn_end = (self.tokenizer.decode([last_id], skip_special_tokens=False)
                          if ended and last_id is not None else "")
        if last_id in self._turn_end_ids and self.chat is not None and self.chat.end_of_turn:
            state.turn_end = self.chat.end_of_turn
        if action == "invalid":
            self._insert_turn(state, [{"role": "user", "content": self.tool_format.corrective}],
                              deferred, lockstep)
            return state
        state.tool_results = [None] * len(parsed.calls)
        # Each call's id as the policy wrote it (Mistral's), else one of nine digits: the
        # template names the call a result answers (Mistral's requires nine characters).
        state.tool_ids = [call.id if isinstance(call, ToolCall) and call.id
                          and len(call.id) == 9 and call.id.isalnum() else f"{slot:09d}"
                          for slot, call in enumerate(parsed.calls)]
        pending = False
        for slot, call in enumerate(parsed.calls):
            if isinstance(call, ToolCallError):
                # Names are sampled text: anything undeclared counts as "unknown" (bounded labels).
                name = call.name if call.name in self._tool_names else "unknown"
                metrics.TOOL_CALLS.labels(name, call.kind).inc()
                state.tool_stats.record(name, False, 0.0)
                state.tool_results[slot] = (name, call.message)
            elif call.name == "calculator":
                result, ok, seconds = timed_calculator(call.arguments)
                metrics.TOOL_CALLS.labels("calculator", "ok" if ok else "tool_error").inc()
                metrics.TOOL_LATENCY.labels("calculator").observe(seconds)
                state.tool_stats.record("calculator", ok, seconds)
                state.tool_results[slot] = ("calculator", result)
            elif call.name == "search":
                searches.append((state, str(call.arguments["query"]), slot))
                state.search_started[slot] = time.perf_counter()
                pending = True
            elif self.runner is not None and call.name in self.runner:
                self.runner.submit((state, slot), call)  # answered by _tool_result
                pending = True
            else:  # declared in the registry but no runner here: say so to the model
                state.tool_results[slot] = (call.name, f"Error: tool {call.name!r} is not available.")
        if pending:
            return None
        self._finish_tool_turn(state, deferred, lockstep)
        return state

    def _tool_result(self, result: ToolResult, deferred: list[_State], lockstep: bool) -> _State:
        """A user or MCP call finished (or timed out): fill its slot, and once every call of
        the turn has its result, insert the tool turn. A trajectory that ended meanwhile (a
        retriever outage) only counts it."""
        state, slot = result.key
        metrics.TOOL_CALLS.labels(result.name, result.outcome).inc()
        metrics.TOOL_LATENCY.labels(result.name).observe(result.seconds)
        if result.retries:
            metrics.TOOL_RETRIES.labels(result.name).inc(result.retries)
        state.tool_stats.record(result.name, result.ok, result.seconds,
                                timeout=result.outcome == "timeout", retries=result.retries)
        if state.finish_reason is not None or slot >= len(state.tool_results):
            return state
        state.tool_results[slot] = (result.name, result.text)
        if all(item is not None for item in state.tool_results):
            self._finish_tool_turn(state, deferred, lockstep)
        return state

    def _search_result(self, state: _State, slot: int, docs: Any, tag: str | None,
                       call_ms: float = 0.0, cached: bool = False) -> bool:
        """Fill a search call's slot; True once every call of the turn has its result."""
        seconds = time.perf_counter() - state.search_started.pop(slot, time.perf_counter())
        metrics.TOOL_LATENCY.labels("search").observe(seconds)
        if isinstance(docs, QueryRejected):
            content = f"Error: search failed: {docs.reason}"
            metrics.TOOL_CALLS.labels("search", "tool_error").inc()
            state.tool_stats.record("search", False, seconds)
        else:
            state.searches += 1
            metrics.SEARCHES.inc()
            metrics.TOOL_CALLS.labels("search", "ok").inc()
            state.tool_stats.record("search", True, seconds)
            content = passages_to_string(docs).strip()
            turn = state.turns[-1] if state.turns else None
            if turn is not None and turn.action == "search":
                # every search call of the turn: its documents and its retrieval health
                turn.docs = (turn.docs or []) + doc_refs(docs)
                turn.index = turn.index or tag
                turn.retrieval = merge(turn.retrieval,
                                       self._health(state, docs, call_ms, cached))
            if self.evidence.enable and state.group.kind == "train":
                # a donor for other questions' `swapped` variant: the search tool's result
                self._donors.add(state.group.uid, state.group.ground_truth, content)
        state.tool_results[slot] = ("search", content)
        return all(result is not None for result in state.tool_results)

    def _finish_tool_turn(self, state: _State, deferred: list[_State], lockstep: bool) -> None:
        """Every call of the turn has its result: insert them as the template's tool turn."""
        messages = []
        for result, call_id in zip(state.tool_results, state.tool_ids, strict=True):
            if result is None:
                continue
            name, content = result
            ids = self.tokenizer.encode(content or "", add_special_tokens=False)
            if len(ids) > self.settings.max_obs_length:  # observation text only: never trained on
                content = self.tokenizer.decode(ids[: self.settings.max_obs_length],
                                                skip_special_tokens=False)
            messages.append({"role": "tool", "name": name, "content": content or "",
                             "tool_call_id": call_id})
        state.tool_results, state.tool_ids = [], []
        self._insert_turn(state, messages, deferred, lockstep)

    def _insert_turn(self, state: _State, messages: list[dict[str, Any]],
                     deferred: list[_State], lockstep: bool) -> None:
        """Append the template's tokens for `messages` after the generated turn (masked) and
        give the trajectory its next turn, or end it when the response budget ran out."""
        assert self.chat is not None
        ids = self.chat.inserted_ids(state.messages, messages, state.turn_end)
        if self._append_ids(state, ids):
            self._continue(state, deferred, lockstep)
        else:
            self._start_probe(state)

    def _continue(self, state: _State, deferred: list[_State], lockstep: bool) -> None:
        if lockstep:
            deferred.append(state)
        else:
            self._submit_turn(state)
            if state.generating_done:  # no room left for another turn
                self._start_probe(state)

    def _append_observation(self, state: _State, text: str) -> bool:
        """Append masked observation tokens; False when the response budget ran out."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: self.settings.max_obs_length]
        return self._append_ids(state, ids)

    def _append_ids(self, state: _State, ids: list[int]) -> bool:
        """Append masked (loss_mask 0, log-prob 0) tokens the environment inserted; False when
        the response budget ran out (the trajectory then ends with finish_reason length)."""
        room = self.settings.max_response_length - len(state.response)
        truncated = len(ids) >= room
        ids = ids[: max(room, 0)]
        state.response.extend(ids)
        state.mask.extend([0] * len(ids))
        state.logprobs.extend([0.0] * len(ids))
        if truncated:
            state.finish_reason = "length"
            return False
        return True

    def _retrieve(self, queries: list[str]
                  ) -> tuple[list[list[dict[str, Any]] | QueryRejected], str | None, float,
                             list[bool]]:
        """The answers, the retrieval tag of who answered them (index identity, settings
        and top-k; services/common/retrieval_store.py), which each search turn records (None
        from a backend that cannot tell; asked after the answers, on this worker thread), the
        call's wall time in ms (each of its search turns' retrieval latency), and per query
        whether the retrieval cache answered it without the retriever."""
        if self.retriever is None:
            raise RetrieverError("no retriever configured (rollout.use_search is on)")
        started = time.perf_counter()
        results = self.retriever.retrieve(queries)
        ms = (time.perf_counter() - started) * 1000.0
        hits = getattr(self.retriever, "last_hits", None)
        if hits is None or len(hits) != len(results):
            hits = [bool(getattr(self.retriever, "answers_from_cache", False))] * len(results)
        return results, getattr(self.retriever, "retrieval_tag", None), ms, list(hits)

    def _health(self, state: _State, docs: Any, ms: float, cached: bool) -> TurnRetrieval:
        """A search result's retrieval health (services/common/retrieval_health.py): cheap
        (one normalisation per passage), so always on."""
        if not state.golds_read:
            state.golds, state.golds_read = golds_of(state.group.ground_truth), True
        return turn_retrieval(docs, state.golds, ms, cached)

    def _apply_results(
        self,
        future: Future,
        batch: list[tuple[_State, str, int | None]],
        deferred: list[_State],
        lockstep: bool,
    ) -> list[_State]:
        try:
            results, tag, call_ms, hits = future.result()
        except RetrieverError as exc:
            log.error("retrieval failed for %d trajectories: %s", len(batch), exc)
            for state, _, _ in batch:
                if state.finish_reason is None:
                    state.finish_reason = "error"
                    state.error = str(exc)
                    self.engine.release(id(state))
                if self.tool_mode:
                    metrics.TOOL_CALLS.labels("search", "error").inc()
            return list({id(state): state for state, _, _ in batch}.values())
        touched = []
        for (state, _, slot), docs, cached in zip(batch, results, hits, strict=True):
            if isinstance(docs, QueryFailed):  # this trajectory only (rollout.retrieval_cache)
                if state.finish_reason is None:
                    log.error("retrieval failed for one trajectory: %s", docs.reason)
                    state.finish_reason = "error"
                    state.error = docs.reason
                    self.engine.release(id(state))
                touched.append(state)
                continue
            if slot is not None:  # a search tool call: fill its slot, go on once all are in
                if state.finish_reason is None and self._search_result(state, slot, docs, tag,
                                                                       call_ms, cached):
                    self._finish_tool_turn(state, deferred, lockstep)
                touched.append(state)
                continue
            if isinstance(docs, QueryRejected):  # this query only: the others are answered
                observation = docs.observation()
            else:
                state.searches += 1
                metrics.SEARCHES.inc()
                observation = information_block(docs)
                if state.turns:  # the search turn that asked: keep what it got (samples)
                    state.turns[-1].docs = doc_refs(docs)
                    state.turns[-1].index = tag
                    state.turns[-1].retrieval = self._health(state, docs, call_ms, cached)
                if self.evidence.enable and state.group.kind == "train":
                    # a donor for other questions' `swapped` variant (rollout/evidence.py)
                    self._donors.add(state.group.uid, state.group.ground_truth, observation)
            if self._append_observation(state, observation):
                self._continue(state, deferred, lockstep)
            else:
                self._start_probe(state)
            touched.append(state)
        return touched

    # ------------------------------------------------------------------ probe

    def _start_probe(self, state: _State) -> None:
        """Called once a trajectory stops generating: free its KV, then maybe probe it."""
        self.engine.release(id(state))
        if self.evidence.enable:
            self._start_evidence(state)
        settings = self.probe
        if not settings.enable or state.finish_reason == "error" or state.probe_waves:
            return
        if state.probe is not None or state.group.kind == "eval":
            return
        version = min((turn.policy_version for turn in state.turns), default=0)
        if version % settings.every_k_versions != 0 or self._rng.random() >= settings.fraction:
            return
        rule = probe_rule(state.group.data_source, settings.suffix, self.settings.protocol)
        span = reasoning_span(self.tokenizer, state.response, state.mask, rule)
        cuts = span.cuts(settings.num_truncations)
        suffixes = cut_suffixes(self.tokenizer, state.response, cuts, rule)
        prompts = probe_prompts(state.prompt_ids, state.response, cuts, suffixes)
        params = SamplingParams(
            temperature=1.0, top_p=1.0, max_tokens=settings.mc_max_tokens,
            stop=probe_stops(rule.suffix), stop_token_ids=self.tool_stop_ids,
        )
        state.probe = Probe(
            fractions=settings.fractions, samples=[[] for _ in range(len(prompts))]
        )
        requests = [
            GenerationRequest(list(ids), params, tag=("probe", state, k))
            for k, ids in enumerate(prompts)
            for _ in range(settings.mc_samples)
        ]
        splits = max(1, settings.num_splits)
        size = -(-len(requests) // splits)
        state.probe_waves = [requests[i : i + size] for i in range(0, len(requests), size)]
        self._next_probe_wave(state)

    def _next_probe_wave(self, state: _State) -> None:
        wave = state.probe_waves.pop(0)
        state.probe_pending = len(wave)
        for request in wave:
            self.engine.add_request(request)

    def _handle_probe(self, output: GenerationOutput) -> _State | None:
        _, state, k = output.tag
        state.probe.samples[k].append(
            self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        )
        metrics.PROBE_COMPLETIONS.inc()
        state.probe_pending -= 1
        if state.probe_pending == 0 and state.probe_waves:
            self._next_probe_wave(state)
        return state

    def _start_evidence(self, state: _State) -> None:
        """probe.evidence: for a sampled finished train trajectory with evidence, generate its
        final turn again without its evidence (`none`) and with another question's
        (`swapped`); the rewrites travel on the trajectory, the scorer grades them."""
        settings = self.evidence
        if state.evidence is not None or state.finish_reason == "error" \
                or state.group.kind == "eval" or not has_evidence(state.turns):
            return
        version = min((turn.policy_version for turn in state.turns), default=0)
        if version % settings.every_k_versions != 0 \
                or self._evidence_rng.random() >= settings.fraction:
            return
        donor = self._donors.draw(state.group.uid, state.group.ground_truth, self._evidence_rng)
        swapped = donor[1] if donor else None
        if self.chat is not None:  # tool_calls: the replaced evidence is tool messages
            prompts = tool_evidence_prompts(
                self.chat, state.prompt_ids, state.response, state.mask, state.turns,
                state.group.data_source, state.messages, swapped, self.settings.max_obs_length)
        else:
            prompts = evidence_prompts(
                self.tokenizer, state.prompt_ids, state.response, state.mask, state.turns,
                state.group.data_source, swapped, self.settings.max_obs_length)
        if prompts is None:
            return
        params = SamplingParams(
            temperature=settings.temperature, top_p=1.0,
            max_tokens=settings.max_tokens or self.settings.max_tokens_per_turn,
            stop=rewrite_stops(self._tool_stops if self.chat is not None else None),
            stop_token_ids=self._tool_stop_ids,
        )
        # `real` is the trajectory's own answer (graded by the reward already): not rewritten
        built = {variant: ids for variant, ids in prompts.items()
                 if ids is not None and variant != "real"}
        state.evidence = EvidenceProbe(samples={variant: [] for variant in built},
                                       donor=donor[0] if donor and "swapped" in built else None)
        requests = [GenerationRequest(list(ids), params, tag=("evidence", state, variant))
                    for variant, ids in built.items() for _ in range(settings.samples)]
        state.evidence_pending = len(requests)
        for request in requests:
            self.engine.add_request(request)

    def _handle_evidence(self, output: GenerationOutput) -> _State:
        _, state, variant = output.tag
        assert state.evidence is not None
        state.evidence.samples[variant].append(
            self.tokenizer.decode(output.token_ids, skip_special_tokens=True))
        state.evidence_pending -= 1
        return state

    # ------------------------------------------------------------------ records

    def _extra(self, state: _State) -> dict[str, Any]:
        """The group's extra; with tool calls, per-tool calls/failures/seconds under "tools"."""
        extra = dict(state.group.extra)
        if self.tool_mode:
            extra["tools"] = state.tool_stats.as_dict()
        return extra

    def _trajectory(self, state: _State) -> Trajectory:
        group = state.group
        versions = [turn.policy_version for turn in state.turns]
        return Trajectory(
            uid=group.uid,
            sample_id=f"{group.uid}:{group.attempt}:{state.index}",
            data_source=group.data_source,
            # The oldest weights that produced any token: staleness is judged by it.
            policy_version=min(versions) if versions else self.engine.policy_version,
            prompt_ids=state.prompt_ids,
            response_ids=state.response,
            loss_mask=state.mask,
            rollout_logprobs=state.logprobs,
            turns=state.turns,
            finish_reason=state.finish_reason or "error",
            num_searches=state.searches,
            ground_truth=group.ground_truth,
            extra=self._extra(state),
            probe=state.probe,
            kind=group.kind,
            error=state.error,
            protocol=self.settings.protocol,
            evidence=state.evidence,
            namespace=group.namespace,  # the issuing run: the learner refuses another run's
        )
