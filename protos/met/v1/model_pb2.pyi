from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "timeout_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    timeout_s: float
    def __init__(self, session_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class CapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CapabilitiesReply(_message.Message):
    __slots__ = ("model_name", "vocab_size", "num_slots", "free_slots", "slot_verify_drafts", "max_rows", "forwards", "current_forward", "device", "max_context", "dtype", "hidden_size", "eos_token_ids", "has_mtp", "max_batch", "max_prefill_tokens", "model_digest", "graphs", "quantization", "tensor_parallel_size", "kv_blocks", "kv_block_size", "kv_blocks_free", "prefix_snapshots", "dflash_block", "compiled", "compiles_pending", "vision_tower", "max_images_per_prompt", "max_image_pixels")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_VERIFY_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FORWARD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_MTP_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    DFLASH_BLOCK_FIELD_NUMBER: _ClassVar[int]
    COMPILED_FIELD_NUMBER: _ClassVar[int]
    COMPILES_PENDING_FIELD_NUMBER: _ClassVar[int]
    VISION_TOWER_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    num_slots: int
    free_slots: int
    slot_verify_drafts: _containers.RepeatedScalarFieldContainer[int]
    max_rows: int
    forwards: _containers.RepeatedScalarFieldContainer[str]
    current_forward: str
    device: str
    max_context: int
    dtype: str
    hidden_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_mtp: bool
    max_batch: int
    max_prefill_tokens: int
    model_digest: str
    graphs: bool
    quantization: str
    tensor_parallel_size: int
    kv_blocks: int
    kv_block_size: int
    kv_blocks_free: int
    prefix_snapshots: int
    dflash_block: int
    compiled: bool
    compiles_pending: int
    vision_tower: bool
    max_images_per_prompt: int
    max_image_pixels: int
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_slots: _Optional[int] = ..., free_slots: _Optional[int] = ..., slot_verify_drafts: _Optional[_Iterable[int]] = ..., max_rows: _Optional[int] = ..., forwards: _Optional[_Iterable[str]] = ..., current_forward: _Optional[str] = ..., device: _Optional[str] = ..., max_context: _Optional[int] = ..., dtype: _Optional[str] = ..., hidden_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_mtp: _Optional[bool] = ..., max_batch: _Optional[int] = ..., max_prefill_tokens: _Optional[int] = ..., model_digest: _Optional[str] = ..., graphs: _Optional[bool] = ..., quantization: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., prefix_snapshots: _Optional[int] = ..., dflash_block: _Optional[int] = ..., compiled: _Optional[bool] = ..., compiles_pending: _Optional[int] = ..., vision_tower: _Optional[bool] = ..., max_images_per_prompt: _Optional[int] = ..., max_image_pixels: _Optional[int] = ...) -> None: ...

class TokenizerFilesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFileChunk(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class AllocSequenceRequest(_message.Message):
    __slots__ = ("penalties", "drafter")
    PENALTIES_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    penalties: Penalties
    drafter: str
    def __init__(self, penalties: _Optional[_Union[Penalties, _Mapping]] = ..., drafter: _Optional[str] = ...) -> None: ...

class Penalties(_message.Message):
    __slots__ = ("presence", "frequency", "repetition", "prompt_tokens", "bias_ids", "bias_values", "allowed_ids")
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_IDS_FIELD_NUMBER: _ClassVar[int]
    presence: float
    frequency: float
    repetition: float
    prompt_tokens: int
    bias_ids: _containers.RepeatedScalarFieldContainer[int]
    bias_values: _containers.RepeatedScalarFieldContainer[float]
    allowed_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, presence: _Optional[float] = ..., frequency: _Optional[float] = ..., repetition: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., bias_ids: _Optional[_Iterable[int]] = ..., bias_values: _Optional[_Iterable[float]] = ..., allowed_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SequenceHandle(_message.Message):
    __slots__ = ("seq_id", "slot", "seq_len")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    slot: int
    seq_len: int
    def __init__(self, seq_id: _Optional[int] = ..., slot: _Optional[int] = ..., seq_len: _Optional[int] = ...) -> None: ...

class FreeSequenceRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    def __init__(self, seq_id: _Optional[int] = ...) -> None: ...

class FreeSequenceReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillItem(_message.Message):
    __slots__ = ("seq_id", "tokens", "mask", "sampling", "score", "top", "images")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    mask: bytes
    sampling: SamplingParams
    score: ScoreAsk
    top: int
    images: _containers.RepeatedCompositeFieldContainer[ImageInput]
    def __init__(self, seq_id: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., mask: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., score: _Optional[_Union[ScoreAsk, _Mapping]] = ..., top: _Optional[int] = ..., images: _Optional[_Iterable[_Union[ImageInput, _Mapping]]] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("pixels", "grid_thw", "digest")
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    pixels: bytes
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    digest: bytes
    def __init__(self, pixels: _Optional[bytes] = ..., grid_thw: _Optional[_Iterable[int]] = ..., digest: _Optional[bytes] = ...) -> None: ...

class ScoreAsk(_message.Message):
    __slots__ = ("top", "next_token")
    TOP_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    top: int
    next_token: int
    def __init__(self, top: _Optional[int] = ..., next_token: _Optional[int] = ...) -> None: ...

class Scores(_message.Message):
    __slots__ = ("asked", "logprobs", "top", "top_ids", "top_logprobs", "rows", "ranks")
    ASKED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    asked: bool
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rows: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, asked: _Optional[bool] = ..., logprobs: _Optional[_Iterable[float]] = ..., top: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., rows: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "uniforms", "min_p")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    UNIFORMS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    uniforms: _containers.RepeatedScalarFieldContainer[float]
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., uniforms: _Optional[_Iterable[float]] = ..., min_p: _Optional[float] = ...) -> None: ...

class SeqSampling(_message.Message):
    __slots__ = ("index", "params")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    index: int
    params: SamplingParams
    def __init__(self, index: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PrefillItem]
    def __init__(self, items: _Optional[_Iterable[_Union[PrefillItem, _Mapping]]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("argmax", "seq_lens", "logprobs", "scores", "top_ids", "top_logprobs")
    ARGMAX_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    argmax: _containers.RepeatedScalarFieldContainer[int]
    seq_lens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    scores: _containers.RepeatedCompositeFieldContainer[Scores]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, argmax: _Optional[_Iterable[int]] = ..., seq_lens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., scores: _Optional[_Iterable[_Union[Scores, _Mapping]]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("seq_ids", "ks", "tokens", "write_on_accept", "masks", "sampling", "top")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    KS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITE_ON_ACCEPT_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    ks: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    write_on_accept: bool
    masks: _containers.RepeatedCompositeFieldContainer[RowMask]
    sampling: _containers.RepeatedCompositeFieldContainer[SeqSampling]
    top: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., ks: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., write_on_accept: _Optional[bool] = ..., masks: _Optional[_Iterable[_Union[RowMask, _Mapping]]] = ..., sampling: _Optional[_Iterable[_Union[SeqSampling, _Mapping]]] = ..., top: _Optional[_Iterable[int]] = ...) -> None: ...

class RowMask(_message.Message):
    __slots__ = ("row", "bits")
    ROW_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    row: int
    bits: bytes
    def __init__(self, row: _Optional[int] = ..., bits: _Optional[bytes] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("argmax", "seq_lens", "logprobs", "p_next", "resample", "sample", "resample_logprobs", "sample_logprobs", "next_logprobs", "top_ids", "top_logprobs")
    ARGMAX_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    P_NEXT_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    argmax: _containers.RepeatedScalarFieldContainer[int]
    seq_lens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    p_next: _containers.RepeatedScalarFieldContainer[float]
    resample: _containers.RepeatedScalarFieldContainer[int]
    sample: _containers.RepeatedScalarFieldContainer[int]
    resample_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sample_logprobs: _containers.RepeatedScalarFieldContainer[float]
    next_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, argmax: _Optional[_Iterable[int]] = ..., seq_lens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., p_next: _Optional[_Iterable[float]] = ..., resample: _Optional[_Iterable[int]] = ..., sample: _Optional[_Iterable[int]] = ..., resample_logprobs: _Optional[_Iterable[float]] = ..., sample_logprobs: _Optional[_Iterable[float]] = ..., next_logprobs: _Optional[_Iterable[float]] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class CanBatchVerifyRequest(_message.Message):
    __slots__ = ("ks",)
    KS_FIELD_NUMBER: _ClassVar[int]
    ks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ks: _Optional[_Iterable[int]] = ...) -> None: ...

class CanBatchVerifyReply(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...

class FoldRequest(_message.Message):
    __slots__ = ("seq_ids", "fold_rows")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FOLD_ROWS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    fold_rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., fold_rows: _Optional[_Iterable[int]] = ...) -> None: ...

class FoldReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("seq_ids", "kept_rows", "ks")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    KEPT_ROWS_FIELD_NUMBER: _ClassVar[int]
    KS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    kept_rows: _containers.RepeatedScalarFieldContainer[int]
    ks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., kept_rows: _Optional[_Iterable[int]] = ..., ks: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("seq_lens",)
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    seq_lens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_lens: _Optional[_Iterable[int]] = ...) -> None: ...

class StashRequest(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rows: _Optional[_Iterable[int]] = ...) -> None: ...

class StashReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("seq_ids", "last", "stash", "num_drafts", "positions", "sampling", "drafters")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    STASH_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    last: _containers.RepeatedScalarFieldContainer[int]
    stash: _containers.RepeatedScalarFieldContainer[int]
    num_drafts: int
    positions: _containers.RepeatedScalarFieldContainer[int]
    sampling: _containers.RepeatedCompositeFieldContainer[SeqSampling]
    drafters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., last: _Optional[_Iterable[int]] = ..., stash: _Optional[_Iterable[int]] = ..., num_drafts: _Optional[int] = ..., positions: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Iterable[_Union[SeqSampling, _Mapping]]] = ..., drafters: _Optional[_Iterable[str]] = ...) -> None: ...

class ProposeReply(_message.Message):
    __slots__ = ("drafts", "confidences")
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedScalarFieldContainer[int]
    confidences: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, drafts: _Optional[_Iterable[int]] = ..., confidences: _Optional[_Iterable[float]] = ...) -> None: ...

class TrimRequest(_message.Message):
    __slots__ = ("seq_ids", "keep_own")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_OWN_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    keep_own: int
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., keep_own: _Optional[int] = ...) -> None: ...

class TrimReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SnapshotReply(_message.Message):
    __slots__ = ("snapshot_ids",)
    SNAPSHOT_IDS_FIELD_NUMBER: _ClassVar[int]
    snapshot_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, snapshot_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("seq_ids", "snapshot_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    snapshot_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., snapshot_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RestoreReply(_message.Message):
    __slots__ = ("seq_lens",)
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    seq_lens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_lens: _Optional[_Iterable[int]] = ...) -> None: ...

class DropPrefixesRequest(_message.Message):
    __slots__ = ("snapshot_ids",)
    SNAPSHOT_IDS_FIELD_NUMBER: _ClassVar[int]
    snapshot_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, snapshot_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DropPrefixesReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerdictRequest(_message.Message):
    __slots__ = ("seq_ids", "kept_rows", "ks", "proposers", "last", "num_drafts", "sampling", "drafters")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    KEPT_ROWS_FIELD_NUMBER: _ClassVar[int]
    KS_FIELD_NUMBER: _ClassVar[int]
    PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    kept_rows: _containers.RepeatedScalarFieldContainer[int]
    ks: _containers.RepeatedScalarFieldContainer[int]
    proposers: _containers.RepeatedScalarFieldContainer[int]
    last: _containers.RepeatedScalarFieldContainer[int]
    num_drafts: int
    sampling: _containers.RepeatedCompositeFieldContainer[SeqSampling]
    drafters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., kept_rows: _Optional[_Iterable[int]] = ..., ks: _Optional[_Iterable[int]] = ..., proposers: _Optional[_Iterable[int]] = ..., last: _Optional[_Iterable[int]] = ..., num_drafts: _Optional[int] = ..., sampling: _Optional[_Iterable[_Union[SeqSampling, _Mapping]]] = ..., drafters: _Optional[_Iterable[str]] = ...) -> None: ...

class VerdictReply(_message.Message):
    __slots__ = ("seq_lens", "drafts", "confidences")
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    seq_lens: _containers.RepeatedScalarFieldContainer[int]
    drafts: _containers.RepeatedScalarFieldContainer[int]
    confidences: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_lens: _Optional[_Iterable[int]] = ..., drafts: _Optional[_Iterable[int]] = ..., confidences: _Optional[_Iterable[float]] = ...) -> None: ...

class SetForwardRequest(_message.Message):
    __slots__ = ("forward",)
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    forward: str
    def __init__(self, forward: _Optional[str] = ...) -> None: ...

class SetForwardReply(_message.Message):
    __slots__ = ("current_forward",)
    CURRENT_FORWARD_FIELD_NUMBER: _ClassVar[int]
    current_forward: str
    def __init__(self, current_forward: _Optional[str] = ...) -> None: ...

class ReadLogitsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadLogitsReply(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class CostRequest(_message.Message):
    __slots__ = ("widths", "max_depth", "repeats", "refresh", "cached_only")
    WIDTHS_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    REFRESH_FIELD_NUMBER: _ClassVar[int]
    CACHED_ONLY_FIELD_NUMBER: _ClassVar[int]
    widths: _containers.RepeatedScalarFieldContainer[int]
    max_depth: int
    repeats: int
    refresh: bool
    cached_only: bool
    def __init__(self, widths: _Optional[_Iterable[int]] = ..., max_depth: _Optional[int] = ..., repeats: _Optional[int] = ..., refresh: _Optional[bool] = ..., cached_only: _Optional[bool] = ...) -> None: ...

class CostEntry(_message.Message):
    __slots__ = ("width", "depth", "verify_ms", "propose_ms")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_MS_FIELD_NUMBER: _ClassVar[int]
    width: int
    depth: int
    verify_ms: float
    propose_ms: float
    def __init__(self, width: _Optional[int] = ..., depth: _Optional[int] = ..., verify_ms: _Optional[float] = ..., propose_ms: _Optional[float] = ...) -> None: ...

class CostReply(_message.Message):
    __slots__ = ("entries", "cached")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[CostEntry]
    cached: bool
    def __init__(self, entries: _Optional[_Iterable[_Union[CostEntry, _Mapping]]] = ..., cached: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("seq_ids", "ks", "tokens", "want_drafts", "num_drafts", "drafters", "masks")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    KS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WANT_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    ks: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    want_drafts: _containers.RepeatedScalarFieldContainer[bool]
    num_drafts: int
    drafters: _containers.RepeatedScalarFieldContainer[str]
    masks: _containers.RepeatedCompositeFieldContainer[RowMask]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., ks: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., want_drafts: _Optional[_Iterable[bool]] = ..., num_drafts: _Optional[int] = ..., drafters: _Optional[_Iterable[str]] = ..., masks: _Optional[_Iterable[_Union[RowMask, _Mapping]]] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("argmax", "logprobs", "accepted", "seq_lens", "proposers", "drafts", "confidences")
    ARGMAX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SEQ_LENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSERS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCES_FIELD_NUMBER: _ClassVar[int]
    argmax: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    seq_lens: _containers.RepeatedScalarFieldContainer[int]
    proposers: _containers.RepeatedScalarFieldContainer[int]
    drafts: _containers.RepeatedScalarFieldContainer[int]
    confidences: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, argmax: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., accepted: _Optional[_Iterable[int]] = ..., seq_lens: _Optional[_Iterable[int]] = ..., proposers: _Optional[_Iterable[int]] = ..., drafts: _Optional[_Iterable[int]] = ..., confidences: _Optional[_Iterable[float]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("seq_ids", "continues", "tokens", "ks", "want_drafts", "num_drafts", "trace", "repeat", "then_trace", "drafters")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTINUES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KS_FIELD_NUMBER: _ClassVar[int]
    WANT_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    REPEAT_FIELD_NUMBER: _ClassVar[int]
    THEN_TRACE_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    continues: _containers.RepeatedScalarFieldContainer[bool]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    ks: _containers.RepeatedScalarFieldContainer[int]
    want_drafts: _containers.RepeatedScalarFieldContainer[bool]
    num_drafts: int
    trace: _containers.ScalarMap[str, str]
    repeat: int
    then_trace: _containers.RepeatedCompositeFieldContainer[TraceContext]
    drafters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., continues: _Optional[_Iterable[bool]] = ..., tokens: _Optional[_Iterable[int]] = ..., ks: _Optional[_Iterable[int]] = ..., want_drafts: _Optional[_Iterable[bool]] = ..., num_drafts: _Optional[int] = ..., trace: _Optional[_Mapping[str, str]] = ..., repeat: _Optional[int] = ..., then_trace: _Optional[_Iterable[_Union[TraceContext, _Mapping]]] = ..., drafters: _Optional[_Iterable[str]] = ...) -> None: ...

class TraceContext(_message.Message):
    __slots__ = ("fields",)
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    fields: _containers.ScalarMap[str, str]
    def __init__(self, fields: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PlanRefusal(_message.Message):
    __slots__ = ("index", "code", "message")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    code: str
    message: str
    def __init__(self, index: _Optional[int] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class PlanResult(_message.Message):
    __slots__ = ("step", "ran", "rows", "ks", "refused", "waited_s", "then")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RAN_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    KS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    THEN_FIELD_NUMBER: _ClassVar[int]
    step: StepReply
    ran: _containers.RepeatedScalarFieldContainer[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    ks: _containers.RepeatedScalarFieldContainer[int]
    refused: _containers.RepeatedCompositeFieldContainer[PlanRefusal]
    waited_s: float
    then: _containers.RepeatedCompositeFieldContainer[PlanResult]
    def __init__(self, step: _Optional[_Union[StepReply, _Mapping]] = ..., ran: _Optional[_Iterable[int]] = ..., rows: _Optional[_Iterable[int]] = ..., ks: _Optional[_Iterable[int]] = ..., refused: _Optional[_Iterable[_Union[PlanRefusal, _Mapping]]] = ..., waited_s: _Optional[float] = ..., then: _Optional[_Iterable[_Union[PlanResult, _Mapping]]] = ...) -> None: ...
