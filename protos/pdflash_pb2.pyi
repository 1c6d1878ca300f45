from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "stop", "seed", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class BufferInfo(_message.Message):
    __slots__ = ("name", "kind", "base_addr", "length", "num_layers", "num_pages", "page_size", "num_heads", "head_start", "head_dim", "dtype", "layout", "bytes_per_page", "indices", "total_heads", "layer_start", "total_layers", "parts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_HEADS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    base_addr: int
    length: int
    num_layers: int
    num_pages: int
    page_size: int
    num_heads: int
    head_start: int
    head_dim: int
    dtype: str
    layout: str
    bytes_per_page: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    total_heads: int
    layer_start: int
    total_layers: int
    parts: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., base_addr: _Optional[int] = ..., length: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., num_heads: _Optional[int] = ..., head_start: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., layout: _Optional[str] = ..., bytes_per_page: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., total_heads: _Optional[int] = ..., layer_start: _Optional[int] = ..., total_layers: _Optional[int] = ..., parts: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("room", "input_ids", "sampling", "decode_addr", "deadline_s")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDR_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    room: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    decode_addr: str
    deadline_s: float
    def __init__(self, room: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_addr: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class SharedRegion(_message.Message):
    __slots__ = ("base_addr", "length", "pid", "fd", "name", "cuda", "host_id")
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    base_addr: int
    length: int
    pid: int
    fd: int
    name: str
    cuda: CudaIpcHandle
    host_id: str
    def __init__(self, base_addr: _Optional[int] = ..., length: _Optional[int] = ..., pid: _Optional[int] = ..., fd: _Optional[int] = ..., name: _Optional[str] = ..., cuda: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., host_id: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("handle", "storage_size", "storage_offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, handle: _Optional[bytes] = ..., storage_size: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class RankBuffers(_message.Message):
    __slots__ = ("tp_rank", "session_id", "buffers", "shared")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    session_id: str
    buffers: _containers.RepeatedCompositeFieldContainer[BufferInfo]
    shared: _containers.RepeatedCompositeFieldContainer[SharedRegion]
    def __init__(self, tp_rank: _Optional[int] = ..., session_id: _Optional[str] = ..., buffers: _Optional[_Iterable[_Union[BufferInfo, _Mapping]]] = ..., shared: _Optional[_Iterable[_Union[SharedRegion, _Mapping]]] = ...) -> None: ...

class BootstrapRequest(_message.Message):
    __slots__ = ("room", "session_id", "tp_rank", "tp_size", "buffers", "decode_addr", "ranks", "transfer_token")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDR_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    room: str
    session_id: str
    tp_rank: int
    tp_size: int
    buffers: _containers.RepeatedCompositeFieldContainer[BufferInfo]
    decode_addr: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankBuffers]
    transfer_token: str
    def __init__(self, room: _Optional[str] = ..., session_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., buffers: _Optional[_Iterable[_Union[BufferInfo, _Mapping]]] = ..., decode_addr: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankBuffers, _Mapping]]] = ..., transfer_token: _Optional[str] = ...) -> None: ...

class BootstrapReply(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("room", "reason")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    room: str
    reason: str
    def __init__(self, room: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("ok", "role", "free_pages", "total_pages", "running", "model", "mooncake_session", "free_draft_pages", "total_draft_pages", "free_state_slots", "total_state_slots", "awaiting_bootstrap", "writing")
    OK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MOONCAKE_SESSION_FIELD_NUMBER: _ClassVar[int]
    FREE_DRAFT_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_DRAFT_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    AWAITING_BOOTSTRAP_FIELD_NUMBER: _ClassVar[int]
    WRITING_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    role: str
    free_pages: int
    total_pages: int
    running: int
    model: str
    mooncake_session: str
    free_draft_pages: int
    total_draft_pages: int
    free_state_slots: int
    total_state_slots: int
    awaiting_bootstrap: int
    writing: int
    def __init__(self, ok: _Optional[bool] = ..., role: _Optional[str] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., running: _Optional[int] = ..., model: _Optional[str] = ..., mooncake_session: _Optional[str] = ..., free_draft_pages: _Optional[int] = ..., total_draft_pages: _Optional[int] = ..., free_state_slots: _Optional[int] = ..., total_state_slots: _Optional[int] = ..., awaiting_bootstrap: _Optional[int] = ..., writing: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("room", "input_ids", "sampling", "prefill_addr", "deadline_s")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDR_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    room: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    prefill_addr: str
    deadline_s: float
    def __init__(self, room: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prefill_addr: _Optional[str] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class MetaInfo(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency", "matched_stop", "spec_verify_ct", "spec_accept_histogram", "spec_accepted_drafts", "spec_proposed_drafts", "verified_pages", "transfer_bytes", "spec_block_histogram", "spec_plain_steps", "transfer_transport")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    E2E_LATENCY_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERIFY_CT_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPT_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_PROPOSED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_PAGES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPEC_BLOCK_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    SPEC_PLAIN_STEPS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    e2e_latency: float
    matched_stop: str
    spec_verify_ct: int
    spec_accept_histogram: _containers.RepeatedScalarFieldContainer[int]
    spec_accepted_drafts: int
    spec_proposed_drafts: int
    verified_pages: int
    transfer_bytes: int
    spec_block_histogram: _containers.RepeatedScalarFieldContainer[int]
    spec_plain_steps: int
    transfer_transport: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., e2e_latency: _Optional[float] = ..., matched_stop: _Optional[str] = ..., spec_verify_ct: _Optional[int] = ..., spec_accept_histogram: _Optional[_Iterable[int]] = ..., spec_accepted_drafts: _Optional[int] = ..., spec_proposed_drafts: _Optional[int] = ..., verified_pages: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., spec_block_histogram: _Optional[_Iterable[int]] = ..., spec_plain_steps: _Optional[int] = ..., transfer_transport: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("room", "token_ids", "text", "finished", "meta")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    room: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    meta: MetaInfo
    def __init__(self, room: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., meta: _Optional[_Union[MetaInfo, _Mapping]] = ...) -> None: ...

class TransferDoneRequest(_message.Message):
    __slots__ = ("room", "ok", "first_token", "prompt_tokens", "error", "bytes", "page_checksums", "transfer_token", "transport")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    room: str
    ok: bool
    first_token: int
    prompt_tokens: int
    error: str
    bytes: int
    page_checksums: _containers.RepeatedScalarFieldContainer[int]
    transfer_token: str
    transport: str
    def __init__(self, room: _Optional[str] = ..., ok: _Optional[bool] = ..., first_token: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ..., page_checksums: _Optional[_Iterable[int]] = ..., transfer_token: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class TransferDoneReply(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class RouterGenerateRequest(_message.Message):
    __slots__ = ("text", "input_ids", "sampling")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    text: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    def __init__(self, text: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...
