"""The checkpointable state of a dataset: a position in an epoch's global order, and the settings it needs.

The position is ``sample_in_epoch``, the global samples consumed (over all data-parallel ranks, replicas
counted once): the epoch's order does not depend on the rank count, so a state saved on one data-parallel
size resumes on any other. The settings that decide the order travel with it: canonical nodes, seed,
shuffle algorithm, partition and the first run's node count (see :func:`resumed_orders`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smalti.streaming.epoch_orders import EpochOrders
from smalti.streaming.errors import StreamingError
from smalti.streaming.order import LEGACY_SHUFFLE, SHUFFLES

Resume = tuple[int, int]  # (epoch, global samples already consumed in it)


def resume_start(resume: Resume | None, epoch: int) -> int:
    """Global samples of epoch ``epoch`` consumed before the resume position (0 for an epoch not resumed)."""
    return resume[1] if resume and resume[0] == epoch else 0


def saved_state(orders: EpochOrders, epoch: int, sample_in_epoch: int) -> dict[str, Any]:
    """The state of a dataset with ``orders`` at ``sample_in_epoch`` global samples into ``epoch``."""
    return {"epoch": epoch, "sample_in_epoch": int(sample_in_epoch),
            "num_canonical_nodes": orders.num_canonical_nodes, "shuffle_seed": orders.shuffle_seed,
            "partition_algo": orders.partition_algo, "physical_nodes": orders.layout.physical_nodes,
            **({"initial_physical_nodes": orders.initial_nodes} if orders.initial_nodes else {}),
            "shuffle_algo": orders.shuffle_algo}


def resumed_orders(orders: EpochOrders, state: Mapping[str, Any]) -> EpochOrders:
    """``orders`` as a checkpoint's ``state`` needs them to give its order again.

    Settings not given explicitly are adopted from the checkpoint (canonical nodes, as mosaicml-streaming
    does, and the shuffle algorithm), so a run resumed on another node count keeps its order; a setting given
    that differs from the checkpoint's is refused, naming both. Under ``relaxed`` partitioning the first run's
    node count is kept for mosaicml-streaming's partition.
    """
    changes: dict[str, Any] = {}
    ncn = state.get("num_canonical_nodes")
    if ncn is not None and not orders.ncn_given and ncn != orders.num_canonical_nodes:
        changes["num_canonical_nodes"] = int(ncn)
    have_ncn = changes.get("num_canonical_nodes", orders.num_canonical_nodes)
    if state.get("num_canonical_nodes", have_ncn) != have_ncn or \
            state.get("shuffle_seed", orders.shuffle_seed) != orders.shuffle_seed:
        raise StreamingError(
            f"checkpoint was taken with num_canonical_nodes={state.get('num_canonical_nodes')} and "
            f"shuffle_seed={state.get('shuffle_seed')}; this dataset has {have_ncn} and "
            f"{orders.shuffle_seed}: the sample order would differ"
        )
    algo = _adopted_shuffle_algo(orders, state)
    if algo != orders.shuffle_algo:
        changes["shuffle_algo"] = algo
    first_nodes = state.get("initial_physical_nodes", state.get("physical_nodes"))
    if orders.partition_algo == "relaxed" and first_nodes not in (None, orders.layout.physical_nodes,
                                                                   orders.initial_nodes):
        changes["initial_nodes"] = int(first_nodes)
    return orders.replace(**changes) if changes else orders


def _adopted_shuffle_algo(orders: EpochOrders, state: Mapping[str, Any]) -> str:
    """The checkpoint's shuffle algorithm unless one was given; a given one that differs from the
    checkpoint's is refused. A smalti state that names none (it has ``partition_algo``) was taken with
    ``py1e``, the default until ``blocks``; a hand-made one without either keeps these orders' algorithm."""
    saved = state.get("shuffle_algo")
    if saved is None and "partition_algo" in state:
        saved = LEGACY_SHUFFLE
    if orders.algo_given:
        if saved is not None and saved != orders.shuffle_algo:
            raise StreamingError(f"checkpoint was taken with shuffle_algo={saved!r}; this dataset has "
                                 f"{orders.shuffle_algo!r}: the sample order would differ (drop shuffle_algo "
                                 "to keep the checkpoint's)")
        return orders.shuffle_algo
    if saved is None:
        return orders.shuffle_algo
    if saved not in SHUFFLES:
        raise StreamingError(f"checkpoint names shuffle_algo={saved!r}, not one of {', '.join(SHUFFLES)}")
    return saved
