"""Rollout settings: engine, sampling and the agent loop (docs/architecture.md)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from services.common.config.base import Section
from services.common.tools import TOOL_REGISTRY, check_parameters, check_tool_name

# `rollout.max_batch_size` when the config leaves it out, per engine. vLLM's own default for
# `max_num_seqs` (its LLM class on a GPU under 70 GiB; 1024 on H100/H200-class GPUs) sizes a
# GPU replica; 32 suits the transformers engine on CPU, where every running row costs
# compute each step.
DEFAULT_MAX_BATCH_SIZE: dict[str, int] = {"vllm": 256, "transformers": 32}


class ToolLimits(Section):
    """Limits of a user or MCP tool (docs/rollout.md, "Tool calls"). `timeout_s` bounds a call
    from its parse to its result, waiting for a concurrency slot and retries included;
    `max_concurrency` is the most calls of this tool in flight across the replica's batch;
    `retries` are further attempts after a transient failure (OSError, ToolRetry, a lost MCP
    connection), never after a timeout or the tool's own error."""

    timeout_s: float = Field(default=30.0, gt=0)  # time limit of a call, retries included
    max_concurrency: int = Field(default=8, ge=1)  # calls in flight at once per replica
    retries: int = Field(default=0, ge=0, le=10)  # further attempts after a transient failure


class UserTool(ToolLimits):
    """A Python function the policy may call: `function` is `path/to/tools.py:function` (or
    `module:function`), loaded like a reward plug-in when the replica starts; `parameters` is
    the JSON schema of its keyword arguments (checked when the config loads)."""

    function: str  # path/to/tools.py:function or module:function
    name: str = ""  # the name the model calls; default: the function's name
    description: str = ""  # default: the function's docstring, first paragraph
    parameters: dict[str, Any]  # JSON schema of its keyword arguments

    @model_validator(mode="after")
    def _check(self) -> UserTool:
        _, sep, attr = self.function.rpartition(":")
        if not sep or not attr or not _:
            raise ValueError(f"function {self.function!r} must look like "
                             "'path/to/tools.py:function' or 'module:function'")
        if not self.name:
            self.name = attr.split(".")[-1]
        problem = check_tool_name(self.name) or check_parameters(self.parameters)
        if problem:
            raise ValueError(problem)
        return self


# `${NAME}` in an MCP server's header value: the environment variable NAME, read when the
# replica connects (a token never has to be written into the config).
ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def header_problem(name: str, value: str) -> str | None:
    """What is wrong with one configured header (None: nothing). The value is never quoted:
    it may hold a credential."""
    if not _HEADER_NAME.match(name):
        return f"header name {name!r} is not a valid HTTP header name"
    if "${" in ENV_REFERENCE.sub("", value):
        return (f"header {name!r}: a '${{' in its value does not start a reference "
                "${NAME} (NAME: letters, digits, _)")
    if any(ch in value for ch in "\r\n\0"):
        return f"header {name!r}: the value holds a line break or NUL"
    return None


def expand_headers(headers: Mapping[str, str],
                   environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """(headers with each `${NAME}` replaced by `environ[NAME]`, the names not set there)."""
    missing: list[str] = []

    def value_of(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            missing.append(name)
            return ""
        return environ[name]

    expanded = {name: ENV_REFERENCE.sub(value_of, value) for name, value in headers.items()}
    return expanded, sorted(set(missing))


class McpServer(ToolLimits):
    """A Model Context Protocol server whose tools the policy may call: `command` (+ `args`,
    `env`) starts one over stdio, `url` reaches one over streamable HTTP. Its tools keep their
    own names, with `prefix` before each when given; limits apply to each of its tools."""

    name: str  # the server's name in logs and errors
    command: str = ""  # stdio: the command that starts the server
    args: list[str] = Field(default_factory=list)  # stdio: its arguments
    env: dict[str, str] = Field(default_factory=dict)  # stdio: extra environment variables
    url: str = ""  # streamable HTTP: the server's URL
    prefix: str = ""  # put before each of its tool names
    # Only these tools of the server (empty: all it lists).
    include: list[str] = Field(default_factory=list)
    # Starting (or reaching) the server, the handshake and listing its tools.
    connect_timeout_s: float = Field(default=30.0, gt=0)
    retries: int = Field(default=1, ge=0, le=10)  # one reconnect after a lost connection
    # HTTP headers sent with every request to a `url` server, e.g. {Authorization: "Bearer
    # ${MCP_TOKEN}"}: each `${NAME}` is the environment variable NAME, read when the replica
    # starts (unset: the replica stops, naming the variable). Values are never logged.
    headers: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> McpServer:
        if bool(self.command) == bool(self.url):
            raise ValueError(f"MCP server {self.name!r} needs exactly one of command (stdio) "
                             "or url (streamable HTTP)")
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"MCP server {self.name!r}: url must start with http:// or https://")
        if self.headers and not self.url:
            raise ValueError(f"MCP server {self.name!r}: headers are sent to url servers only "
                             "(a stdio server gets env)")
        for name, value in self.headers.items():
            problem = header_problem(name, value)
            if problem:
                raise ValueError(f"MCP server {self.name!r}: {problem}")
        return self


class RetrievalCache(Section):
    """`rollout.retrieval_cache` (docs/rollout.md, "Recorded retrieval"): `record` writes every
    /retrieve result the replica gets to the SQLite store at `path` (replicas may share one
    file); `replay` answers every search from it, and a query it lacks fails its trajectory
    (finish_reason error); `cache` answers from it what it holds, asks the retriever the rest
    and keeps the file under `max_bytes` by evicting the least recently used rows. `index` is
    the index directory whose manifest names the index (default: retriever.index_dir);
    `wait_s` bounds the wait for the retriever's /healthz when recording or caching."""

    # off, record, replay, or cache (read-through, size-bounded)
    mode: Literal["off", "record", "replay", "cache"] = "off"
    path: str = ""  # the SQLite store of recorded results (cache: a path on a shared volume)
    index: str = ""  # index directory naming the index ("": retriever.index_dir)
    wait_s: float = Field(default=120.0, gt=0)  # record, cache: wait for the retriever's /healthz
    # Cache mode: bound on the stored rows' bytes, least recently used evicted past it; 0: none
    max_bytes: int = Field(default=2**30, ge=0)

    @field_validator("mode", mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        """YAML reads a bare `off` as false."""
        return "off" if value is False else value

    @model_validator(mode="after")
    def _check(self) -> RetrievalCache:
        if self.mode != "off" and not self.path:
            raise ValueError(f"mode {self.mode} needs path: the SQLite file of recorded "
                             "results (e.g. runs/NAME/retrieval.sqlite)")
        return self


class RolloutSection(Section):
    engine: Literal["transformers", "vllm"] = "transformers"  # the inference engine
    device: str = "cpu"  # transformers engine: cpu, cuda or cuda:N
    # Engine precision (auto: float32 on CPU, else the checkpoint's dtype).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Sequences one replica keeps in flight (vLLM: its max_num_seqs). The replica takes new
    # groups from the stream as its sequences finish, so the engine stays this full. Left
    # out (null): DEFAULT_MAX_BATCH_SIZE of the engine (vllm 256, transformers 32).
    max_batch_size: int = Field(default=None, ge=1, validate_default=True)  # type: ignore[assignment]
    temperature: float = Field(default=1.0, ge=0)  # sampling temperature of training rollouts
    top_p: float = Field(default=1.0, gt=0, le=1)  # nucleus sampling (1: off)
    top_k: int = Field(default=0, ge=0)  # top-k sampling (0: off)
    max_turns: int = Field(default=4, ge=0)  # search rounds before the final turn
    max_tokens_per_turn: int = Field(default=500, ge=1)  # tokens one generation turn may produce
    max_obs_length: int = Field(default=500, ge=1)  # tokens of one observation kept
    max_response_length: int = Field(default=2048, ge=1)  # policy + observation tokens
    max_prompt_length: int = Field(default=4096, ge=1)  # prompt tokens kept (the last ones)
    use_search: bool = True  # false: single-turn tasks
    weight_poll_s: float = Field(default=1.0, gt=0)  # how often to ask for new weights
    heartbeat_s: float = Field(default=5.0, gt=0)  # heartbeat period
    # Bind address of the replica's /metrics and /healthz server (0 port: any free port).
    # 127.0.0.1 serves this machine only; containers and pods need 0.0.0.0 (deploy configs).
    host: str = "127.0.0.1"
    metrics_port: int = Field(default=0, ge=0, le=65535)  # /metrics and /healthz port (0: any free)
    seed: int = 0  # sampling seed
    # Stop strings of a policy turn (Search-R1's); math tasks without tags can set [].
    stop_strings: list[str] = Field(default_factory=lambda: ["</search>", "</answer>"])
    # How the policy acts (docs/rollout.md, "Tool calls"): "tags" is Search-R1's free text
    # (<search>q</search>, <information> observations); "tool_calls" renders `tools` through the
    # model's chat template and parses Hermes <tool_call>{...}</tool_call> calls (the
    # stop_strings above are then replaced by </tool_call> and the template's end of turn).
    protocol: Literal["tags", "tool_calls"] = "tags"
    # Tools of the tool_calls protocol: built-ins by name (services.common.tools.TOOL_REGISTRY)
    # and user tools as {function: path/to/tools.py:fn, parameters: {...}, ...} (UserTool).
    tools: list[str | UserTool] = Field(default_factory=lambda: ["search"])
    # MCP servers whose tools join `tools` when the replica starts (McpServer; needs the `mcp`
    # extra: pip install -e .[mcp]).
    mcp_servers: list[McpServer] = Field(default_factory=list)
    # continuous: trajectories return to the engine as soon as their observation is ready;
    # lockstep: Search-R1's turn-synchronous schedule (a baseline, see bench/rollout.py).
    scheduling: Literal["continuous", "lockstep"] = "continuous"
    # Replica name (consumer name, heartbeat key); empty: hostname-pid.
    name: str = ""
    # Most prompt groups one replica holds at once (0: as many as max_batch_size sequences
    # hold, at least 1); the first read of an idle replica takes max_batch_size // n groups.
    groups_per_batch: int = Field(default=0, ge=0)
    # Pull weights from the learner's WeightSync (off for tests without a learner).
    weight_sync: bool = True
    # Serve the weights this replica receives to other replicas while they arrive, and fetch
    # from the one the learner names (docs/weight_sync.md "Relays"); "off": pull from the
    # learner and serve nothing. Bind host ("": rollout.host), port (0: any free one), the host
    # other replicas dial ("": this host's name, resolved: the pod's or container's IP), and how
    # long a held version stays served without readers (its host-memory copy is then freed).
    weight_relay: Literal["auto", "off"] = "auto"
    weight_relay_host: str = ""  # relay bind host ("": rollout.host)
    weight_relay_port: int = Field(default=0, ge=0, le=65535)  # relay port (0: any free)
    weight_relay_advertise: str = ""  # host other replicas dial ("": this host's name)
    weight_relay_hold_s: float = Field(default=300.0, gt=0)  # unread version served this long
    # The relay's TLS certificate and key (PEM), needed when learner.weight_sync_tls_ca_file is
    # set and relays are on; it must name the advertised host, or weight_relay_tls_name. Also
    # from FORAGE_WEIGHT_RELAY_TLS_CERT_FILE, _KEY_FILE and _NAME.
    weight_relay_tls_cert_file: str | None = None  # relay's TLS certificate (PEM)
    weight_relay_tls_key_file: str | None = None  # relay certificate's private key
    weight_relay_tls_name: str = ""  # name relay certificates carry ("": the advertised host)
    # How long a starting replica waits for the learner's first weights before giving up.
    weight_wait_s: float = Field(default=600.0, gt=0)
    heartbeat_ttl_s: float = Field(default=15.0, gt=0)  # heartbeat key lifetime
    # Backoff base between /retrieve retries (doubles each retry; count is retriever.retries).
    retrieve_backoff_s: float = Field(default=0.25, ge=0)
    # vLLM engine (rollout.engine: vllm; docs/rollout.md). max_batch_size is vLLM's max_num_seqs
    # and dtype its dtype.

    # Fraction of each GPU vLLM may take for weights + KV cache: vLLM's default, for a rollout
    # that has its GPU(s) to itself; lower it where a GPU is shared.
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # KV cache size in GiB (vLLM's kv_cache_memory_bytes). 0: on a GPU vLLM sizes it from
    # gpu_memory_utilization; on a machine without CUDA Forage takes 2 GiB, since vLLM's CPU
    # backend would otherwise reserve gpu_memory_utilization of the host's whole RAM.
    kv_cache_gib: float = Field(default=0.0, ge=0)
    tensor_parallel_size: int = Field(default=1, ge=1)  # vLLM: GPUs one replica spans
    # Eager mode skips CUDA-graph capture (faster start, less memory, slower decoding).
    enforce_eager: bool = False
    # Multi-turn: later turns reuse the earlier turns' KV blocks (reset after every update).
    enable_prefix_caching: bool = True
    # Longest prompt + response vLLM accepts (0: the model's own limit); longer requests end
    # with finish_reason=error instead of running.
    max_model_len: int = Field(default=0, ge=0)
    # Any other vLLM EngineArgs field, passed through as given (e.g. max_num_batched_tokens,
    # kv_cache_dtype); the keys above and the ones Forage sets itself cannot be overridden here.
    vllm_engine_args: dict[str, Any] = Field(default_factory=dict)
    # Record, replay or cache the replica's /retrieve results (RetrievalCache; off by default).
    retrieval_cache: RetrievalCache = Field(default_factory=RetrievalCache)

    @model_validator(mode="after")
    def _cache_needs_search(self) -> RolloutSection:
        if self.retrieval_cache.mode != "off" and not self.use_search:
            raise ValueError("retrieval_cache.mode is "
                             f"{self.retrieval_cache.mode} but use_search is off: nothing "
                             "would be searched (set retrieval_cache.mode: off)")
        if bool(self.weight_relay_tls_cert_file) != bool(self.weight_relay_tls_key_file):
            raise ValueError("rollout.weight_relay_tls_cert_file and "
                             "rollout.weight_relay_tls_key_file go together (the relay's "
                             "certificate and its key)")
        return self

    @field_validator("weight_relay", mode="before")
    @classmethod
    def _relay_switch(cls, value: Any) -> Any:
        """YAML reads a bare `off` as false (and `on` as true): take them as the words."""
        return ("auto" if value else "off") if isinstance(value, bool) else value

    @field_validator("tools", mode="before")
    @classmethod
    def _known_tools(cls, value: Any) -> Any:
        """Refuse unknown or repeated tool names and bad user-tool entries when the config
        loads, not mid-run, in one line that names the entry (pydantic's union errors would
        list every member's complaint)."""
        if not isinstance(value, list):
            return value
        entries: list[str | UserTool] = []
        for index, entry in enumerate(value):
            label = f"tools[{index}]"
            if isinstance(entry, str):
                if ":" in entry:
                    raise ValueError(f"{label} ({entry}): a user tool needs its JSON schema: "
                                     f"write {{function: {entry}, parameters: {{type: object, "
                                     "properties: {...}}}")
                if entry not in TOOL_REGISTRY:
                    raise ValueError(f"{label}: unknown tool {entry!r}; built-ins: "
                                     f"{sorted(TOOL_REGISTRY)} (or a user tool: {{function: "
                                     "path/to/tools.py:fn, parameters: ...})")
                entries.append(entry)
                continue
            if isinstance(entry, UserTool):
                entries.append(entry)
                continue
            if not isinstance(entry, dict):
                raise ValueError(f"{label}: a tool is a built-in name or a mapping with "
                                 "function and parameters")
            try:
                entries.append(UserTool.model_validate(entry))
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(part) for part in first["loc"])
                message = str(first["msg"]).removeprefix("Value error, ")
                shown = entry.get("function", "?")
                raise ValueError(f"{label} ({shown}): {where + ': ' if where else ''}"
                                 f"{message}") from None
        names = [entry if isinstance(entry, str) else entry.name for entry in entries]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"tools listed twice: {repeated}")
        return entries

    @field_validator("max_batch_size", mode="before")
    @classmethod
    def _engine_default(cls, value: Any, info: ValidationInfo) -> Any:
        """Fill a left-out max_batch_size from the engine: a GPU engine left at a CPU-sized
        batch runs a fraction of the sequences its GPU holds (vLLM's max_num_seqs)."""
        if value is None:
            return DEFAULT_MAX_BATCH_SIZE[info.data.get("engine", "transformers")]
        return value
