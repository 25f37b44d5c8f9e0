"""The model contract, in two layers: `ServingModel`, the operations the scheduler calls, and
`CircuitModel`, which adds the single steps of a verdict and the admin reads that the circuit
diff takes apart. Operations return values (`Prefilled`, `Verified`, `Proposal`, ...): nothing
is read back afterwards. `protos.operations` lists every operation with its RPC, from which the
gRPC client, the servicer and tensor parallelism's mirror follow.

Two implementations: `gpu_service.engine.facade.Engine` (in process) and
`control_plane.replicas.client.GrpcModel` (over `met.v1.ModelService`). Nothing here imports
torch or protobuf.

Lifecycle of one sequence (each step checked by the service, out-of-order calls are
`FailedPrecondition`):

    alloc_sequence -> prefill* -> [decode_verify_batched -> settle_verdict]* -> free_sequence

where the diff may take `settle_verdict` apart as stash? -> fold -> commit -> (propose -> trim)?.

Over gRPC, sequences belong to sessions (the in-process engine has none): a client opens a
session (`OpenSession`, a stream it keeps open) and names it in `SESSION_METADATA` on every
call but the read-only `Capabilities` and `TokenizerFiles`. A sequence belongs to the session
that allocated it: to any other session it is `NotFound`, with the sentence of an unknown
sequence. When the session's stream closes or breaks (the client closed it, or died, or its
connection went silent for the service's `--session-timeout`, 10 s by default), the service
frees the session's sequences. A call naming no live session is refused with UNAUTHENTICATED
(a lost connection to the caller: it reconnects, which opens a new session).

`set_forward`, `read_logits` and `measure_costs` act on the whole service, so over gRPC they
are admin calls: they need the service's admin key (`--admin-key`, or `ADMIN_KEY_ENV`) in
`ADMIN_KEY_METADATA`, and are `PermissionDenied` without it. A service started without a key
refuses every admin call. `met up` and `control_plane.cli.launch.start_gpu_service` put a random
key in `ADMIN_KEY_ENV` (unless one is set), which the service and every `GrpcModel` of the
process and its children read.

Who decides what. The control plane decides the policy of every step: which sequences are in
it, the draft width, the prefill chunks, every lever. The service applies only the greedy
verdict rule (`greedy_accepted`, `room_to_propose`), in `decode_step` and in a step plan
(`open_steps`, whose contract is `protos.steps`): there the service may also continue a
sequence from its own previous result, which the control plane has not read yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from protos.handles import (
    ImageInput,
    Prefilled,
    Proposal,
    ScoreAsk,
    SequenceHandle,
    StepResult,
    Verified,
)

if TYPE_CHECKING:  # the step stream's types name this module's
    from protos.steps import StepStream


# The drafters a sequence may propose with (`alloc_sequence`): the target's MTP head, or a
# DFlash block drafter loaded beside it (`Capabilities.dflash_block`).
MTP_HEAD, DFLASH = "mtp", "dflash"
DRAFTERS = (MTP_HEAD, DFLASH)


class ModelError(Exception):
    """A request the service refused; `code` names the gRPC status it travels as."""

    code = "INTERNAL"


class InvalidArgument(ModelError):
    code = "INVALID_ARGUMENT"


class NotFound(ModelError):
    code = "NOT_FOUND"


class ResourceExhausted(ModelError):
    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(ModelError):
    code = "FAILED_PRECONDITION"


class PermissionDenied(ModelError):
    """An admin call without the service's admin key."""

    code = "PERMISSION_DENIED"


ERRORS_BY_CODE: dict[str, type[ModelError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, ResourceExhausted, FailedPrecondition, PermissionDenied)
}

SESSION_METADATA = "met-session"  # the session a call belongs to
ADMIN_KEY_METADATA = "met-admin-key"  # the admin key, on admin calls
ADMIN_KEY_ENV = "MET_ADMIN_KEY"  # the admin key's default, for the service and its clients
# The checkpoint files the control plane needs to tokenize, render chats, read images and
# stop: the service hands them over (`Model.tokenizer_files`), so the control plane needs no
# copy of the model. config.json says whether the model has a vision tower and its placeholder
# token; preprocessor_config.json how an image becomes the tower's input.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
    "preprocessor_config.json",
)


def read_tokenizer_files(directory: Path) -> dict[str, bytes]:
    """The files of `TOKENIZER_FILES` that exist in a checkpoint directory, by name."""
    return {
        name: (directory / name).read_bytes()
        for name in TOKENIZER_FILES
        if (directory / name).is_file()
    }


@dataclass(frozen=True)
class Capabilities:
    model_name: str
    vocab_size: int
    num_slots: int
    free_slots: int
    slot_verify_drafts: tuple[int, ...]  # per slot: drafts it can verify (rows = drafts + 1)
    max_rows: int  # row budget of one batched call
    forwards: tuple[str, ...]
    current_forward: str
    device: str  # "cpu", or a GPU by index and name: "cuda:0 (NVIDIA H200)"
    max_context: int
    dtype: str
    hidden_size: int
    eos_token_ids: tuple[int, ...]
    has_mtp: bool
    max_batch: int  # sequences in one batched verify or propose (the stash width)
    max_prefill_tokens: int  # prompt tokens in one prefill call, over all sequences
    # Names the checkpoint served (config.json and the weights, gpu_service/model/digest.py),
    # so a control plane over several replicas can refuse one that serves another model.
    model_digest: str
    # Whether the batched verify and the drafter's chain replay captured graphs (CUDA graphs;
    # `--no-cuda-graphs` or METRALE_NO_MTP_VERIFY_GRAPHS: eager).
    graphs: bool = False
    # The checkpoint's quantization as served (gpu_service/model/quantization.py names it, e.g.
    # "fp8-e4m3-block128"); "" when its weights are served as stored.
    quantization: str = ""
    # Ranks the model is split over (`--tensor-parallel-size`); 1: one device.
    tensor_parallel_size: int = 1
    # The paged attention KV pool: its blocks, the positions a block holds, and the blocks
    # free when the capabilities were read (0, 0, 0 from a service without one).
    kv_blocks: int = 0
    kv_block_size: int = 0
    kv_blocks_free: int = 0
    prefix_snapshots: int = 0  # prefix snapshots it can hold (0: no prefix cache)
    # The DFlash drafter's block (rows of one block forward; it gives one fewer drafts), 0
    # when the service has none (`--drafter`).
    dflash_block: int = 0
    compiled: bool = False  # the graphs are compiled on the CPU (`--compile`)
    compiles_pending: int = 0  # compiled keys still building in the background
    # Whether it embeds images (a vision tower loaded: `prefill`'s `images`), and then its
    # bounds: images one sequence's prompt may hold, pixels one image may cover (0 without).
    vision_tower: bool = False
    max_images_per_prompt: int = 0
    max_image_pixels: int = 0

    @property
    def drafters(self) -> frozenset[str]:
        """The drafters it proposes with (`DRAFTERS`)."""
        held = {MTP_HEAD: self.has_mtp, DFLASH: self.dflash_block > 0}
        return frozenset(name for name, has in held.items() if has)


def batch_fits(ks: Sequence[int], max_batch: int, max_rows: int) -> bool:
    """Whether one batched verify of these widths (rows per sequence) fits the stash width and
    the row budget: the rule the service checks and the scheduler plans its chunks by. Slot
    capacities are the caller's job (it clamps drafts to them)."""
    return 1 <= len(ks) <= max_batch and sum(ks) <= max_rows


def fits_batch(caps: Capabilities, ks: Sequence[int]) -> bool:
    """`batch_fits` by a service's capabilities, read once at connection."""
    return batch_fits(ks, caps.max_batch, caps.max_rows)


def greedy_accepted(rows: Sequence[int], argmax: Sequence[int]) -> int:
    """The greedy verdict, shared by `decode_step` and the control plane. rows = [last, d1 ..
    d_{k-1}]: draft j + 1 stands while it equals the argmax of row j. -> drafts that stood"""
    n = 0
    while n + 1 < len(rows) and rows[n + 1] == argmax[n]:
        n += 1
    return n


def room_to_propose(seq_len: int, num_drafts: int, max_context: int) -> bool:
    """Whether `num_drafts` drafts fit after `seq_len` committed tokens, shared by the
    scheduler (which asks for drafts) and the service (which refuses or skips them). The
    drafter's entries sit at positions `seq_len - 1 .. seq_len + num_drafts - 2` (the first
    at the last committed position, whose hidden it starts from), all inside the context.
    Plain arithmetic, so it also holds elementwise for arrays of lengths."""
    return seq_len - 1 + num_drafts <= max_context


def room_for_block(seq_len: int, block: int, max_context: int) -> bool:
    """Whether a DFlash block of `block` rows fits after `seq_len` committed tokens: its rows
    sit at positions `seq_len .. seq_len + block - 1`, all inside the context (the service
    refuses a propose past it, and the scheduler asks for none)."""
    return seq_len + block <= max_context


@dataclass(frozen=True)
class Logits:
    data: bytes  # row-major, little-endian, in `dtype`
    dtype: str  # torch dtype name without the prefix: "float32", "bfloat16", ...
    shape: tuple[int, ...]  # (rows, vocab)


@dataclass(frozen=True)
class Penalties:
    """vLLM's penalties and OpenAI's logit bias for one sequence, set at `alloc_sequence`: the
    service applies them to every row it judges, from the sequence's own tokens (its drafts
    included), so a verified draft meets the logits one token at a time would have seen."""

    presence: float = 0.0  # once per token the output holds
    frequency: float = 0.0  # once per time the output holds a token
    repetition: float = 1.0  # tokens of prompt or output: logit / r above 0, * r else; 1: none
    prompt_tokens: int = 0  # the sequence's first tokens that are its prompt, not its output
    bias_ids: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()  # added to the logits of bias_ids
    allowed_ids: tuple[int, ...] = ()  # when given, every other id's logit is -inf

    @property
    def active(self) -> bool:
        """Whether applying them changes any logit."""
        return bool(
            self.presence
            or self.frequency
            or self.bias_ids
            or self.allowed_ids
            or self.repetition != 1.0
        )


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_k: int = 0  # 0 (or -1, as vLLM's): no limit
    top_p: float = 1.0
    uniforms: tuple[float, ...] = ()  # one per verify row, or per draft for a propose
    min_p: float = 0.0  # 0: no cut; else below min_p times the top probability is cut


@dataclass(frozen=True)
class CostEntry:
    """One measured step cost (`measure_costs`)."""

    width: int
    depth: int
    verify_ms: float
    propose_ms: float


FORWARDS = ("eager", "eager-serial", "triton", "triton-serial")


class ServingModel(Protocol):
    """The operations the scheduler calls, each one batched RPC of `met.v1.ModelService`."""

    def capabilities(self) -> Capabilities:
        """Model name, vocabulary, slots (count, free, per-slot verify capacity), row budget,
        forwards and the current one, device."""

    def tokenizer_files(self) -> dict[str, bytes]:
        """The served checkpoint's files of `TOKENIZER_FILES` that exist, by name, as read
        when it loaded: the control plane tokenizes, renders chats and stops with them, and
        tells a reconnect to another model by them. Over gRPC a server stream of chunks
        (`TokenizerFiles`), each file's in order, so files past the 4 MiB message bound pass;
        no session needed."""

    def alloc_sequence(
        self, penalties: Penalties | None = None, drafter: str = MTP_HEAD
    ) -> SequenceHandle:
        """A new sequence (id never reused) on the lowest free slot, with an empty cache.
        `ResourceExhausted` when every slot is taken. `penalties` (`checks.penalties_problem`:
        `InvalidArgument`) apply to every row of its prefills and verifies, before masks.
        `drafter` (one of `DRAFTERS`) proposes its drafts: `DFLASH` needs a service with a
        DFlash drafter (`FailedPrecondition` otherwise); its proposals are one block forward
        each, `num_drafts` at most the block's rows less one, and need the whole block inside
        the context (`InvalidArgument`). It is the sequence's drafter where a call names none:
        `settle_verdict`, `decode_step`, step plans and `run_mtp_propose_batched` may name
        another per call (their `drafters`), so a sequence may switch drafters from one step
        to the next. Every drafter is kept primed for every sequence, so a switch changes the
        drafts, never the verified tokens."""

    def free_sequence(self, seq: SequenceHandle) -> None:
        """Release the sequence and its slot. An unknown or freed id, or another session's,
        is `NotFound`."""

    def prefill(
        self,
        seqs: Sequence[SequenceHandle],
        prompts: Sequence[Sequence[int]],
        masks: Sequence[bytes] | None = None,
        sampling: Sequence[Sampling | None] | None = None,
        scores: Sequence[ScoreAsk | None] | None = None,
        top: Sequence[int] | None = None,
        images: Sequence[Sequence[ImageInput]] | None = None,
    ) -> Prefilled:
        """Append each prompt to its sequence's cache (a long prompt may come in chunks) and
        return each one's last-row argmax (a draw for a prompt with `sampling`) and that
        token's log-probability. The last rows' logits stay in the logits buffer;
        the drafter's cache is primed with the prompt's (token, hidden) pairs. `masks[i]`, when
        not empty, is an allowed-token bitmask (bit t of little-endian 32-bit words is token t)
        applied to prompt i's last row before its argmax. `scores[i]`, when given, asks for
        prompt i's rows scored (`Scores`: prompt log-probabilities, raw); a `top` past
        `MAX_TOP` or a `next_token` outside the vocabulary is `InvalidArgument`. `top[i]` (0 to
        `MAX_TOP`, else `InvalidArgument`) asks for that many alternatives of prompt i's last
        row, from its processed logits as its token's log-probability is (`Prefilled.top_ids`).
        `images[i]`: the images whose first image token is in prompt i, in that order
        (`ImageInput`); the tower embeds them and their embeddings take their tokens' places
        (in this prefill and the sequence's next ones, where an image's tokens run on), each
        row at Qwen's multimodal RoPE position. A sequence that never had an image reads the
        image token as text, as transformers does without pixels. An image the tower cannot
        take, too large or one too many for the service's bounds, image tokens no image
        accounts for or an image no token starts is `InvalidArgument` naming the image.
        Empty prompts, ids outside the vocabulary and prompts past the context are
        `InvalidArgument`; a sequence with a verify pending is `FailedPrecondition`."""

    def decode_verify_batched(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceHandle],
        write_on_accept: bool = True,
        masks: dict[int, bytes] | None = None,
        sampling: dict[int, Sampling] | None = None,
        top: Sequence[int] | None = None,
    ) -> Verified:
        """One batched forward over `R = sum(ks)` rows; sequence i contributes its rows
        `[last, d1 .. d_{k_i - 1}]` at positions `seq_len .. seq_len + k_i - 1`, attending to
        its own cache and causally within its rows. -> every row's argmax and its log-probability.

        Every row's GDN state and conv window is kept in the slot's verify buffer; the rows'
        KV are written into the cache and `seq_len` advances by `k_i` (the commit rewinds
        the rejected rows). `write_on_accept=True` leaves the live GDN state untouched and the
        fold writes the accepted row's state into it; `False` advances the live state through
        all rows and the fold puts the accepted row's state back. Both give identical bytes.
        A plain one-token decode is `k = 1`. Each `k` is in `1 ..= capacity(slot) + 1`.
        `masks` maps rows to allowed-token bitmasks (as `prefill`'s), applied before their
        argmax, so a grammar binds the bonus token too. `sampling` maps sequence indices to
        their sampling parameters with one uniform per row: the reply's `draws` then has, for
        each of their rows, what rejection sampling needs, and the draws' log-probabilities.
        `top[i]` (one per sequence, 0 to `MAX_TOP`, else `InvalidArgument`) asks for that many
        alternatives of each of sequence i's rows. The rows of a sequence that samples or asks
        alternatives also get `next_logprobs`. Every log-probability is a log-softmax (fp32) of
        the logits the verdict reads: after penalties, bias, allowed ids and masks."""

    def settle_verdict(
        self,
        seqs: Sequence[SequenceHandle],
        kept_rows: Sequence[int],
        ks: Sequence[int],
        proposers: Sequence[int],
        last: Sequence[int],
        num_drafts: int,
        sampling: Sequence[Sampling | None] | None = None,
        drafters: Sequence[str] = (),
    ) -> Proposal:
        """A whole verdict in one call, checked whole before any of it runs: stash the last
        kept row of each proposer (`proposers` index `seqs`; stash slot j is proposer j),
        fold and commit every sequence at `kept_rows`, then propose `num_drafts` drafts for
        the proposers from `last` and trim their drafters. Equal to the five calls in that
        order; returns the proposal (empty without proposers). `drafters[j]` (one per
        proposer, or none) names proposer j's drafter for this call (one of `DRAFTERS`; ""
        or none: its allocated one); a name the service has no drafter for is refused
        (`InvalidArgument` for an unknown name, `FailedPrecondition` for one it did not
        load), as a DFlash proposer is refused a count past its block or a block past the
        context (`room_for_block`)."""

    def decode_step(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceHandle],
        want_drafts: Sequence[bool],
        num_drafts: int,
        drafters: Sequence[str] = (),
        masks: dict[int, bytes] | None = None,
    ) -> StepResult:
        """A greedy step in one call: `decode_verify_batched` of the rows (their `masks`, no
        sampling), the greedy verdict (draft j + 1 stands while it equals row j's argmax; the
        token after the last standing draft is the argmax of its row), then `settle_verdict`
        with every sequence that wants drafts and has room for them as a proposer: room for
        `num_drafts` (`room_to_propose` of its committed length) with the MTP head, for a
        whole block (`room_for_block`) with a DFlash drafter. `drafters[i]` (one per
        sequence, or none) names sequence i's drafter, as `settle_verdict`'s do; a model
        without an MTP head gives its sequences no drafts. Equal to those calls; one round
        trip instead of two. The scheduler takes this path for greedy rows unless its
        `fused_step` lever is off."""

    def open_steps(self) -> StepStream:
        """A step stream: `StepPlan`s run in order, one `PlanResult` each. The unary calls
        stay; the control plane pipelines greedy `none`, `mtp` and `dflash` steps over this,
        sending a plan that continues from the service's own verdict before the previous
        result is back, and discarding what a sequence that finished meanwhile gains. Over
        gRPC, the bidirectional `StepStream` RPC of the session; in process, a worker
        thread."""

    def snapshot_prefixes(self, seqs: Sequence[SequenceHandle]) -> list[int]:
        """A snapshot of each sequence, idle right after a prefill to a whole number of KV
        blocks: the blocks its tokens fill, shared, and copies of its GDN state, conv window
        and drafter carry -> their ids (`gpu_service/memory/prefixes.py`). All or none."""

    def restore_prefixes(self, seqs: Sequence[SequenceHandle], snapshots: Sequence[int]) -> None:
        """Each fresh sequence goes on from its snapshot: it holds the snapshot's tokens
        (its handle's `seq_len` says how many) and prefills only the rest of its prompt,
        which then equals a prefill of the whole prompt. All or none."""

    def drop_prefixes(self, snapshots: Sequence[int]) -> None:
        """Let the snapshots go; their blocks go back to the pool once no sequence holds them.
        An unknown or dropped id (or another session's) is `NotFound`."""

    def measure_costs(
        self,
        widths: Sequence[int],
        max_depth: int,
        repeats: int = 5,
        refresh: bool = False,
        cached_only: bool = False,
    ) -> tuple[list[CostEntry], bool]:
        """Verify and verdict+propose times by batch width and depth (drafts), measured on
        scratch sequences (needs max(widths) free slots) and cached under `$XDG_CACHE_HOME`
        (a table shipped with the model is read, never written); the cache is used unless
        `refresh` or it lacks an asked width or depth. Widths within `max_batch`, depth within
        the widest verify slot, at most 100 repeats: anything else is refused before any work.
        Widths whose slots cannot verify a depth are left out. An admin call over gRPC, except
        `cached_only`: the cached table or no entries, never a measurement.
        -> (entries, whether they came from the cache)"""


class CircuitModel(ServingModel, Protocol):
    """`ServingModel` with what the circuit diff calls besides: the verdict's single steps
    (`settle_verdict` is them in one call), the forward's choice and the logits buffer."""

    def gdn_fold_accepted(self, seqs: Sequence[SequenceHandle], fold_rows: Sequence[int]) -> None:
        """For each sequence, the GDN state and conv window after row `fold_rows[i] - 1` of its
        last verify become its live state. A row outside that verify is `InvalidArgument`;
        no verify pending is `FailedPrecondition`."""

    def commit_accepted_prefix(
        self, seqs: Sequence[SequenceHandle], kept_rows: Sequence[int], ks: Sequence[int]
    ) -> list[int]:
        """Each sequence keeps rows `0 .. kept_rows[i] - 1` of its last verify: the service
        rewinds `seq_len` by `k - kept_rows` and returns the new lengths (the handles are
        updated). The fold must come first; `ks` must match the pending verify."""

    def stash_verify_hidden_rows(self, rows: Sequence[int]) -> None:
        """Stash slot i takes the final hidden of row `rows[i]` of the last verify (one row
        per sequence: its last accepted row). Call it before fold and commit."""

    def run_mtp_propose_batched(
        self,
        last: Sequence[int],
        stash: Sequence[int],
        num_drafts: int,
        seqs: Sequence[SequenceHandle],
        sampling: Sequence[Sampling | None] | None = None,
        drafters: Sequence[str] = (),
    ) -> Proposal:
        """For each sequence, `num_drafts` greedy drafts (or sampled, with one uniform per
        draft, for sequences with `sampling`; the service keeps the distributions they came
        from for the next verify's residuals) from its drafter (`drafters[i]`, as
        `settle_verdict`'s; "" or none: its allocated one). The MTP head starts from the
        sequence's stash slot's hidden and `last` (the token after its committed history):
        its first entry sits at position `seq_len - 1` (the hidden's position, as vLLM's MTP);
        draft j feeds back the drafter's own hidden. A DFlash drafter runs one block of
        `[last, MASK ...]` from position `seq_len` (the stash is not read). The last
        position's logits stay in the logits buffer, one row per sequence."""

    def trim_proposer_state(self, seqs: Sequence[SequenceHandle], keep_own: int = 0) -> None:
        """Drop the drafter entries the last propose built from its own hidden, keeping the
        first `keep_own` of them. With `keep_own = 0`, as after every propose, the drafter
        keeps only entries built from the target's hiddens, so its state is a function of the
        committed history and a replay reproduces it exactly."""

    def set_forward(self, name: str) -> None:
        """Select the forward: `eager` (plain torch), `triton` (the per-sequence parts as Triton
        kernels), or `eager-serial` / `triton-serial` (a batched call run one sequence at a
        time inside the service, same buffers and replies). Unknown names are
        `InvalidArgument`. An admin call over gRPC."""

    def read_logits(self) -> Logits:
        """The logits buffer of the last prefill, verify or propose, in the model's dtype.
        An admin call over gRPC."""


class OpenModel(Protocol):
    """What builds a `CircuitModel` in this process, for a tool that drives the contract with
    no service to call (`met circuit diff` without `--gpu-service`): `met` hands the GPU
    service's builder (`gpu_service.engine.facade.open_engine`) to the control plane, which
    reaches the service through this contract alone."""

    def __call__(
        self, model: Path, drafter: Path | None, prefix_snapshots: int, compile_step: bool
    ) -> CircuitModel:
        """The model at `model` (with the DFlash drafter at `drafter`, if any), holding
        `prefix_snapshots` snapshots, its step compiled per batch bucket when `compile_step`
        (every bucket's own graph, so a replay never runs a smaller bucket's while one
        compiles); the service's other settings at their defaults."""
