"""What goes into a checkpoint and how it comes back: DCP for the model and optimizers, one file per rank for the rest.

Layout of a checkpoint folder::

    ep1-ba2000/
      .metadata, __<r>_<i>.distcp   DCP: model and optimizer shards (each writer rank writes its own)
      extra/rank<r>.pt              rank r's other state: timestamp, schedulers, RNG, data loader, plugins
                                    (tensors and plain values only: read with ``weights_only=True``)
      manifest.json                 written last by rank 0 (see :mod:`smalti.checkpoint.manifest`)

Changing the number of ranks between save and load: model and optimizer state are resharded by DCP.
The timestamp, schedulers and plugin states are the same on every rank and come from rank 0's file.
RNG states are per rank and are *not* restored (each rank keeps the generators the trainer seeded; a
warning says so). The data loader position of map-style loaders is re-derived from the timestamp by the
resumable sampler, so it follows; a saved stateful loader position (streaming datasets) cannot and raises
:class:`~smalti.checkpoint.errors.ReshardError` unless ``dataloader`` is in ``load_ignore_keys``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from smalti.checkpoint.errors import CheckpointError, ReshardError
from smalti.checkpoint.hashes import DEFAULT_ALGORITHM, new_hasher, tagged
from smalti.checkpoint.prefault import Prefaulter
from smalti.checkpoint.read_ahead import ReadAhead, ReadAheadFileSystemReader
from smalti.checkpoint.safe_load import (
    SafeLoadPlanner,
    check_safe,
    dump_safe,
    from_safe_tree,
    load_torch,
    open_inside,
    unwrap_unsafe,
)
from smalti.checkpoint.writer import HashingFileSystemWriter, ReusedHostStager
from smalti.core.rng import load_rng_state_dict, rng_state_dict
from smalti.core.state import State
from smalti.storage import atomic_write_bytes

log = logging.getLogger(__name__)

EXTRA_DIR = "extra"


def extra_relpath(rank: int) -> str:
    """Where rank ``rank``'s non-DCP state lives inside a checkpoint folder."""
    return f"{EXTRA_DIR}/rank{rank}.pt"


def trainable_only(state: State) -> bool:
    """Whether the model asks for its frozen parameters to stay out of checkpoints (a LoRA model's base: it is
    read from its own files at every start, and the model checks on load that it is the same base)."""
    return bool(getattr(state.raw_model, "checkpoint_trainable_only", False))


def model_options(state: State, **kwargs: Any) -> StateDictOptions:
    """The state-dict options for ``state``'s model (see :func:`trainable_only`)."""
    return StateDictOptions(ignore_frozen_params=trainable_only(state), **kwargs)


def dcp_state_dict(state: State) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as DCP wants it: sharded (DTensor) entries under FSDP, plain tensors otherwise.
    Frozen parameters are left out when the model asks for it (:func:`trainable_only`)."""
    if state.optimizers:
        model_sd, optim_sd = get_state_dict(state.model, state.optimizers, options=model_options(state))
        return {"model": model_sd, "optim": optim_sd}
    return {"model": get_model_state_dict(state.model, options=model_options(state))}


def rank_local_state(state: State) -> dict[str, Any]:
    """Everything but model and optimizers, as this rank sees it."""
    return {
        "rank": state.rank,
        "world_size": state.world_size,
        "dp_rank": state.dp_rank,
        "dp_world_size": state.dp_world_size,
        "timestamp": state.timestamp.state_dict(),
        "schedulers": [sched.state_dict() for sched in state.schedulers],
        "rng": rng_state_dict(),
        "dataloader": state.dataloader_state_dict(),
        "grad_scaler": state.grad_scaler.state_dict() if state.grad_scaler is not None else None,
        "device_train_microbatch_size": state.device_train_microbatch_size,
        "run_name": state.run_name,
        "plugins": state.plugin_state_dict(),
    }


def dump_rank_local_state(
    folder: Path, state: State, algorithm: str = DEFAULT_ALGORITHM, check: bool = True
) -> tuple[str, bytes, dict[str, Any]]:
    """This rank's non-DCP state as the bytes of its file: its path relative to ``folder``, the bytes, and
    their ``{"size", "hash"}`` record. The file holds tensors and plain values only (NumPy arrays as tensors),
    so it loads with ``torch.load(weights_only=True)``: state that would need full unpickling fails here
    (or, with ``check=False``, in :func:`write_rank_local_file`)."""
    rel = extra_relpath(state.rank)
    data = dump_safe(rank_local_state(state), f"the rank-local state {folder / rel}", check)
    digest = new_hasher(algorithm)
    digest.update(data)
    return rel, data, {"size": len(data), "hash": tagged(algorithm, digest.hexdigest())}


def write_rank_local_file(folder: Path, rel: str, data: bytes, check: bool = False) -> None:
    """Write the bytes :func:`dump_rank_local_state` made to ``folder / rel`` (temp name, fsync, rename); with
    ``check``, first check that they load with ``weights_only=True`` (see :func:`dump_rank_local_state`)."""
    path = folder / rel
    if check:
        check_safe(data, f"the rank-local state {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)


def save_dcp(
    state_dict: dict[str, Any], folder: Path, group: Any, thread_count: int = 1, direct_io: bool = False,
    algorithm: str = DEFAULT_ALGORITHM,
) -> dict[str, dict[str, Any]]:
    """Synchronous DCP save of ``state_dict`` by the ranks of ``group`` (``None``: a single process).

    Returns ``{file name: {"size", "hash"}}`` of the files this rank wrote, hashed as they were written.
    """
    writer = HashingFileSystemWriter(folder, thread_count, direct_io, algorithm)
    if group is None:
        silence_single_process_warning()
    dcp.save(state_dict, storage_writer=writer, process_group=group, no_dist=group is None)
    return writer.fs.records


#: what DCP warns on every save and load made without a process group
SINGLE_PROCESS_WARNING = (
    r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to (save|load) in a "
    r"single process"
)


def silence_single_process_warning() -> None:
    """Ignore DCP's warning that a save or load without a process group is a single process's: our single-process
    calls mean it. A filter that stays (re-adding it is a no-op), not a ``catch_warnings`` around the call: an
    async save's warning comes from DCP's background thread after the call has returned, and ``catch_warnings``
    is not thread-safe. Only that message, from DCP's own modules, is matched."""
    warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING, category=UserWarning,
                            module=r"torch\.distributed\.checkpoint\.")


def async_save_dcp(
    state_dict: dict[str, Any],
    folder: Path,
    group: Any,
    stager: ReusedHostStager,
    thread_count: int = 1,
    direct_io: bool = False,
    algorithm: str = DEFAULT_ALGORITHM,
) -> tuple[Any, dict[str, dict[str, Any]]]:
    """Stage ``state_dict`` into ``stager``'s host buffers (blocking), then write it in a background thread.

    Returns the write's future and the dict that receives ``{file name: {"size", "hash"}}`` as files finish.
    """
    writer = HashingFileSystemWriter(folder, thread_count, direct_io, algorithm)
    if group is None:
        silence_single_process_warning()
    response = dcp.async_save(
        state_dict, storage_writer=writer, process_group=group, no_dist=group is None, async_stager=stager
    )
    # a stager that copies in the background makes DCP answer with (staging, upload) futures
    return getattr(response, "upload_completion", response), writer.fs.records


def matches(key: str, patterns: list[str]) -> bool:
    """Whether ``key`` (or one of its dotted parents) matches one of the glob ``patterns``."""
    parts = key.split(".")
    candidates = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(c, p) for p in patterns for c in candidates)


def _adam_state_names(group: dict[str, Any]) -> set[str]:
    return {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())


def _prefill_adam_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, metadata: Any, created: list[torch.Tensor] | None = None
) -> bool:
    """Give an Adam/AdamW optimizer without state uninitialised state tensors for the checkpoint to fill.

    Without state, DCP creates it with a zero-lr optimizer step: zero gradients and a full Adam update over
    every parameter, which costs a large share of a load (and competes with the disk reads for the CPU).
    Here each parameter gets exactly the state Adam keeps (``step``, ``exp_avg``, ``exp_avg_sq``, and
    ``max_exp_avg_sq`` with ``amsgrad``), shaped and sharded like the parameter, with the dtypes the checkpoint
    holds, and only when the checkpoint holds exactly those entries for every parameter (so every byte is
    loaded over). Returns False, changing nothing, for other optimizers or any other checkpoint contents.
    The new tensors are appended to ``created`` (for :class:`~smalti.checkpoint.prefault.Prefaulter`).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from smalti.checkpoint._compat import get_fqns

    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return False
    saved: dict[str, dict[str, Any]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("optim.state."):
            fqn, _, name = key.removeprefix("optim.state.").rpartition(".")
            saved.setdefault(fqn, {})[name] = meta
    fqn_of: dict[torch.nn.Parameter, str] = {}
    for name, param in model.named_parameters():
        fqns = get_fqns(model, name)
        if len(fqns) == 1:
            fqn_of[param] = next(iter(fqns))
    fills: list[tuple[torch.nn.Parameter, dict[str, torch.Tensor]]] = []
    for group in optimizer.param_groups:
        names = _adam_state_names(group)
        for param in group["params"]:
            entries = saved.get(fqn_of.get(param, ""), {})
            if set(entries) != names or not all(isinstance(m, TensorStorageMetadata) for m in entries.values()):
                return False
            fill: dict[str, torch.Tensor] = {}
            for name, meta in entries.items():
                if name == "step" and meta.size == torch.Size([]):
                    fill[name] = torch.zeros((), dtype=meta.properties.dtype)
                elif name != "step" and meta.size == param.shape:
                    fill[name] = torch.empty_like(param, dtype=meta.properties.dtype)
                else:
                    return False
            fills.append((param, fill))
    for param, fill in fills:
        optimizer.state[param].update(fill)
        if created is not None:
            created.extend(fill.values())
    return True


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """How an HSDP load is shared: the first replica group (``readers``, over ``reader_group``) reads the
    checkpoint from storage; each of its ranks then broadcasts what it loaded to the ranks holding the same
    shards in the other replica groups (``replicate_group``, from global rank ``src``)."""

    reader_group: Any
    replicate_group: Any
    src: int
    readers: frozenset[int]
    is_reader: bool


def _broadcast_from_reader(value: Any, replicas: ReplicaLoad) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=replicas.src, group=replicas.replicate_group)
    return box[0]


def _broadcast_loaded(tree: Any, replicas: ReplicaLoad) -> None:
    """Give every replica the loaded values of ``tree`` (model and optimizer state dicts, loaded in place on the
    readers): tensors' local shards broadcast in place, other values (step counts, hyperparameters) as objects."""
    slots: list[tuple[Any, Any]] = []  # (container, key) of each non-tensor leaf

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                buffer = local if local.is_contiguous() else local.contiguous()
                dist.broadcast(buffer, src=replicas.src, group=replicas.replicate_group)
                if buffer is not local:
                    local.copy_(buffer)
            elif isinstance(value, (dict, list)):
                walk(value)
            else:
                slots.append((node, key))

    with torch.no_grad():
        walk(tree)
    values = _broadcast_from_reader([container[key] for container, key in slots], replicas)
    for (container, key), value in zip(slots, values):
        container[key] = value


def load_checkpoint(
    state: State,
    folder: Path,
    manifest: dict[str, Any],
    group: Any,
    weights_only: bool = False,
    ignore_keys: list[str] | None = None,
    strict: bool = True,
    read_ahead: ReadAhead | None = None,
    trust_pickles: bool = False,
    replicas: ReplicaLoad | None = None,
) -> None:
    """Load the checkpoint in local folder ``folder`` into ``state`` (resharding model and optimizers as needed).

    ``replicas`` (HSDP): only the first replica group reads model and optimizer state from storage, the
    others receive it over the replicate dimension, so a load reads the checkpoint once, not once per replica.

    ``read_ahead``: the data files being read in the background; DCP takes their bytes from it.
    ``trust_pickles``: read pickles that want classes outside the allow-lists (see :mod:`smalti.checkpoint.safe_load`).
    """
    ignore = list(ignore_keys or [])
    reader = ReadAheadFileSystemReader(folder, read_ahead, trust_pickles)
    metadata = reader.read_metadata() if replicas is None or replicas.is_reader else None
    if replicas is not None:
        metadata = _broadcast_from_reader(metadata, replicas)
    stored = set(metadata.state_dict_metadata)
    model_sd = get_model_state_dict(state.model, options=model_options(state))
    wanted = {k: v for k, v in model_sd.items() if not matches(f"model.{k}", ignore)}
    stored_model = {k.removeprefix("model.") for k in stored if k.startswith("model.")}
    missing = sorted(set(wanted) - stored_model)
    unexpected = sorted(k for k in stored_model - set(model_sd) if not matches(f"model.{k}", ignore))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint {folder} does not match the model: missing {missing[:8]}{'…' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'…' if len(unexpected) > 8 else ''}; set load_strict=false to load the "
            "keys both have, or name keys to skip in load_ignore_keys (e.g. 'model.head.*')"
        )
    wanted = {k: v for k, v in wanted.items() if k in stored_model}
    load_optim = not weights_only and state.optimizers and not matches("optim", ignore) and any(
        k.startswith("optim.") for k in stored
    )
    if not weights_only and state.optimizers and not load_optim and not matches("optim", ignore):
        raise CheckpointError(
            f"checkpoint {folder} holds no optimizer state; load it with load_weights_only=true or add 'optim' to load_ignore_keys"
        )
    to_load: dict[str, Any] = {"model": wanted}
    created: list[torch.Tensor] = []
    if load_optim:
        for optimizer in state.optimizers:
            if not optimizer.state and not _prefill_adam_state(state.model, optimizer, metadata, created):
                # DCP creates an empty optimizer's state (a zero-lr step) only when no parameter holds a gradient;
                # with gradients left from earlier use of the model it would ask for, and load, no optimizer state
                optimizer.zero_grad(set_to_none=True)
        _, optim_sd = get_state_dict(state.model, state.optimizers, options=model_options(state))
        to_load["optim"] = optim_sd
    planner = SafeLoadPlanner(allow_partial_load=True, trust_pickles=trust_pickles)
    # the new optimizer state's pages are mapped while DCP plans and the disk reads the weights ahead of them
    prefaulter = Prefaulter(created)
    if group is None:
        silence_single_process_warning()
    try:
        if replicas is None:
            dcp.load(to_load, storage_reader=reader, planner=planner, process_group=group, no_dist=group is None)
        else:
            failure: BaseException | None = None
            if replicas.is_reader:
                try:
                    dcp.load(to_load, storage_reader=reader, planner=planner, process_group=replicas.reader_group)
                except BaseException as exc:
                    failure = exc
            verdict = _broadcast_from_reader(None if failure is None else repr(failure), replicas)
            if failure is not None:
                raise failure
            if verdict is not None:
                raise CheckpointError(f"the first replica group could not load {folder}: {verdict}")
            _broadcast_loaded(to_load, replicas)
    except BaseException as exc:
        unsafe = unwrap_unsafe(exc)
        if unsafe is None:
            raise
        raise unsafe from None
    finally:
        prefaulter.join()
    partial = len(wanted) != len(model_sd)
    options = model_options(state, strict=not partial and not trainable_only(state))
    if load_optim:
        set_state_dict(state.model, state.optimizers, model_state_dict=to_load["model"], optim_state_dict=to_load["optim"], options=options)
    else:
        set_model_state_dict(state.model, to_load["model"], options=options)
    if partial:
        log.info("loaded %d of the model's %d tensors from %s (others skipped by load_ignore_keys / load_strict)",
                 len(wanted), len(model_sd), folder)
    if weights_only:
        return
    _load_rank_local(state, folder, manifest, ignore, trust_pickles)


def read_rank_local(folder: Path, rank: int, trust_pickles: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s non-DCP state in checkpoint ``folder``, read without running code from it (older
    checkpoints' files hold NumPy arrays as pickles: they need ``trust_pickles``)."""
    path = folder / extra_relpath(rank)
    try:
        with open_inside(folder, extra_relpath(rank), f"rank {rank}'s state") as f:  # no link out of the folder
            extra = from_safe_tree(load_torch(f, str(path), trust_pickles))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder} has no {extra_relpath(rank)} for rank {rank}") from None
    if not isinstance(extra, dict):
        raise CheckpointError(f"{path} holds a {type(extra).__name__}, not a rank's state")
    return extra


def _load_rank_local(state: State, folder: Path, manifest: dict[str, Any], ignore: list[str], trust: bool) -> None:
    saved_world = int(manifest.get("world_size", 1))
    same_world = saved_world == state.world_size
    extra = read_rank_local(folder, state.rank if same_world else 0, trust)
    if not matches("timestamp", ignore):
        state.timestamp.load_state_dict(extra["timestamp"])
    if not matches("schedulers", ignore):
        if len(extra["schedulers"]) != len(state.schedulers):
            raise CheckpointError(
                f"checkpoint {folder} has {len(extra['schedulers'])} schedulers but this run has {len(state.schedulers)}; "
                "add 'schedulers' to load_ignore_keys to start the schedule afresh"
            )
        for sched, sched_state in zip(state.schedulers, extra["schedulers"]):
            sched.load_state_dict(sched_state)
    if not matches("rng", ignore):
        if same_world:
            load_rng_state_dict(extra["rng"])
        else:
            log.warning(
                "checkpoint %s was saved by %d ranks and is loaded by %d: per-rank RNG states are not restored "
                "(each rank keeps the generators seeded at start)", folder, saved_world, state.world_size,
            )
    if not matches("dataloader", ignore) and extra.get("dataloader") is not None:
        state.load_dataloader_state_dict(_loader_position(state, folder, manifest, extra, trust))
    if not matches("grad_scaler", ignore) and state.grad_scaler is not None and extra.get("grad_scaler"):
        state.grad_scaler.load_state_dict(extra["grad_scaler"])
    if extra.get("device_train_microbatch_size") is not None and state.auto_microbatching:
        state.device_train_microbatch_size = extra["device_train_microbatch_size"]
    plugins = {name: value for name, value in (extra.get("plugins") or {}).items() if not matches(f"plugins.{name}", ignore)}
    state.load_plugin_state_dict(plugins)


def _loader_position(state: State, folder: Path, manifest: dict[str, Any], extra: dict[str, Any], trust: bool) -> Any:
    """The saved data loader position of this rank's data-parallel share (the share, not the rank, owns it);
    a global position (samples of the epoch's global order, marked ``global`` by smalti-core) is every
    rank's, on any data-parallel size."""
    if isinstance(extra["dataloader"], dict) and extra["dataloader"].get("global") is True:
        return extra["dataloader"]
    saved_world = int(manifest.get("world_size", 1))
    saved_dp = int(manifest.get("dp_world_size", saved_world))
    if saved_dp != state.dp_world_size:
        raise ReshardError(
            f"checkpoint {folder} holds a data loader position saved by each of {saved_dp} data-parallel ranks "
            f"({saved_world} ranks); it cannot be split over {state.dp_world_size} data-parallel ranks "
            f"({state.world_size} ranks). Add 'dataloader' to load_ignore_keys to restart the loader from its "
            "epoch start (samples of this epoch may repeat), or resume with the same data-parallel size"
        )
    if extra.get("dp_rank", extra.get("rank")) == state.dp_rank:
        return extra["dataloader"]
    for rank in range(saved_world):  # another layout of the same shares (e.g. sequence-parallel groups added)
        other = read_rank_local(folder, rank, trust)
        if other.get("dp_rank", rank) == state.dp_rank:
            return other["dataloader"]
    raise ReshardError(f"checkpoint {folder} has no data loader position for data-parallel rank {state.dp_rank}")


def gloo_group(ranks: list[int] | None = None, timeout_s: float = 600) -> Any:
    """A gloo process group for checkpoint traffic, kept apart from the training collectives (collective call)."""
    import datetime

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
