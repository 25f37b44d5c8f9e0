from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpeculativeMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPECULATIVE_METHOD_UNSPECIFIED: _ClassVar[SpeculativeMethod]
    SPECULATIVE_METHOD_NONE: _ClassVar[SpeculativeMethod]
    SPECULATIVE_METHOD_MTP: _ClassVar[SpeculativeMethod]
    SPECULATIVE_METHOD_PROMPT_LOOKUP: _ClassVar[SpeculativeMethod]
    SPECULATIVE_METHOD_DFLASH: _ClassVar[SpeculativeMethod]
    SPECULATIVE_METHOD_AUTO: _ClassVar[SpeculativeMethod]
SPECULATIVE_METHOD_UNSPECIFIED: SpeculativeMethod
SPECULATIVE_METHOD_NONE: SpeculativeMethod
SPECULATIVE_METHOD_MTP: SpeculativeMethod
SPECULATIVE_METHOD_PROMPT_LOOKUP: SpeculativeMethod
SPECULATIVE_METHOD_DFLASH: SpeculativeMethod
SPECULATIVE_METHOD_AUTO: SpeculativeMethod

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "ignore_eos", "temperature", "top_p", "top_k", "seed", "logprobs", "request_id", "speculative_method", "num_drafts", "response_format", "messages", "add_generation_prompt", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "chat_template_kwargs", "allowed_token_ids", "tools", "tool_choice", "parallel_tool_calls", "truncate_prompt_tokens", "include_stop_str_in_output", "chat_template", "continue_final_message", "prompt_logprobs", "thinking_token_budget", "top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    min_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: bool
    request_id: str
    speculative_method: SpeculativeMethod
    num_drafts: int
    response_format: ResponseFormat
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    chat_template_kwargs: str
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tools: str
    tool_choice: str
    parallel_tool_calls: bool
    truncate_prompt_tokens: int
    include_stop_str_in_output: bool
    chat_template: str
    continue_final_message: bool
    prompt_logprobs: int
    thinking_token_budget: int
    top_logprobs: int
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., request_id: _Optional[str] = ..., speculative_method: _Optional[_Union[SpeculativeMethod, str]] = ..., num_drafts: _Optional[int] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., chat_template_kwargs: _Optional[str] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., tools: _Optional[str] = ..., tool_choice: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., chat_template: _Optional[str] = ..., continue_final_message: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., thinking_token_budget: _Optional[int] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: str
    tool_call_id: str
    name: str
    reasoning_content: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: ImagePart
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[ImagePart, _Mapping]] = ...) -> None: ...

class ImagePart(_message.Message):
    __slots__ = ("data", "mime_type", "url")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    url: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., url: _Optional[str] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_schema", "regex", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpeculativeStats(_message.Message):
    __slots__ = ("steps", "verifies", "drafted", "accepted", "mean_accepted_length", "acceptance_per_position", "grammar_truncations", "by_method")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    VERIFIES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_TRUNCATIONS_FIELD_NUMBER: _ClassVar[int]
    BY_METHOD_FIELD_NUMBER: _ClassVar[int]
    steps: int
    verifies: int
    drafted: int
    accepted: int
    mean_accepted_length: float
    acceptance_per_position: _containers.RepeatedScalarFieldContainer[float]
    grammar_truncations: int
    by_method: _containers.RepeatedCompositeFieldContainer[MethodStats]
    def __init__(self, steps: _Optional[int] = ..., verifies: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., mean_accepted_length: _Optional[float] = ..., acceptance_per_position: _Optional[_Iterable[float]] = ..., grammar_truncations: _Optional[int] = ..., by_method: _Optional[_Iterable[_Union[MethodStats, _Mapping]]] = ...) -> None: ...

class MethodStats(_message.Message):
    __slots__ = ("method", "verifies", "drafted", "accepted")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    VERIFIES_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    method: str
    verifies: int
    drafted: int
    accepted: int
    def __init__(self, method: _Optional[str] = ..., verifies: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("position", "queue_length")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    position: int
    queue_length: int
    def __init__(self, position: _Optional[int] = ..., queue_length: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "usage", "speculative_stats", "request_id", "queued", "prompt_logprobs", "top_ids", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_STATS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    usage: Usage
    speculative_stats: SpeculativeStats
    request_id: str
    queued: Queued
    prompt_logprobs: PromptLogprobs
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculative_stats: _Optional[_Union[SpeculativeStats, _Mapping]] = ..., request_id: _Optional[str] = ..., queued: _Optional[_Union[Queued, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("logprobs", "ranks", "top", "top_ids", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    top: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., top: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsReply(_message.Message):
    __slots__ = ("requests", "finished", "prompt_tokens", "completion_tokens", "steps", "speculative", "active", "queued", "free_slots", "prompt_lookup_copies", "dcut_steps", "last_step_width", "replicas", "kv_blocks", "kv_blocks_free", "prefix_cache_queries", "prefix_cache_hits", "preemptions")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOOKUP_COPIES_FIELD_NUMBER: _ClassVar[int]
    DCUT_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_WIDTH_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    finished: int
    prompt_tokens: int
    completion_tokens: int
    steps: int
    speculative: SpeculativeStats
    active: int
    queued: int
    free_slots: int
    prompt_lookup_copies: int
    dcut_steps: int
    last_step_width: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStats]
    kv_blocks: int
    kv_blocks_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    def __init__(self, requests: _Optional[int] = ..., finished: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., speculative: _Optional[_Union[SpeculativeStats, _Mapping]] = ..., active: _Optional[int] = ..., queued: _Optional[int] = ..., free_slots: _Optional[int] = ..., prompt_lookup_copies: _Optional[int] = ..., dcut_steps: _Optional[int] = ..., last_step_width: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStats, _Mapping]]] = ..., kv_blocks: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("replica", "up", "requests", "finished", "completion_tokens", "steps", "active", "queued", "free_slots", "kv_blocks", "kv_blocks_free", "prefix_cache_queries", "prefix_cache_hits", "preemptions")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    replica: str
    up: bool
    requests: int
    finished: int
    completion_tokens: int
    steps: int
    active: int
    queued: int
    free_slots: int
    kv_blocks: int
    kv_blocks_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    def __init__(self, replica: _Optional[str] = ..., up: _Optional[bool] = ..., requests: _Optional[int] = ..., finished: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., active: _Optional[int] = ..., queued: _Optional[int] = ..., free_slots: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., preemptions: _Optional[int] = ...) -> None: ...
