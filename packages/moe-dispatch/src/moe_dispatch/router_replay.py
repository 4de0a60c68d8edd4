"""Router replay (R3): reuse in training the experts that rollout chose.

Rollout and training pick top-k independently, and small numeric differences flip choices for a
large share of tokens, which breaks the importance ratio of GRPO/GSPO-style objectives. Replay
fixes only the discrete expert ids; the weights are gathered from the live router scores, so
the router keeps its gradient.

Routers are keyed by a global layer id (not by construction order), so pipeline-split model
parts and several models can share one ``RouterReplay``. Use the context around the whole step
(forward, loss and backward) so activation-checkpoint recomputation sees the same routes.

# T tokens, E experts, K top-k, L MoE layers
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from moe_dispatch.routing import NO_EXPERT

logger = logging.getLogger(__name__)

_Mode = Literal["off", "record", "replay"]


def validate_routes(routes: Tensor, *, num_tokens: int, num_experts: int, top_k: int) -> None:
    """Check one layer's recorded routes; raise a ValueError naming the first bad row.

    Args:
        routes: [T, K] integer; a row is either all -1 (route live) or K distinct ids in [0, E).
        num_tokens: T, the tokens this layer routes.
        num_experts: E, the global experts.
        top_k: K, the experts per token.
    """
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ValueError(f"recorded routes must be an integer tensor, got {routes.dtype}")
    if routes.dim() != 2 or routes.shape[0] != num_tokens or routes.shape[1] != top_k:
        raise ValueError(
            f"recorded routes have shape {tuple(routes.shape)}, expected [T={num_tokens}, "
            f"K={top_k}]; record with the same tokens (after the same packing and sharding)"
        )
    if routes.numel() == 0:
        return
    live = routes == NO_EXPERT
    row_live = live.all(dim=1)
    partial = live.any(dim=1) & ~row_live
    out_of_range = ((routes < 0) | (routes >= num_experts)) & ~live
    sorted_ids = routes.sort(dim=1).values
    duplicate = (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(dim=1) & ~row_live
    bad = partial | out_of_range.any(dim=1) | duplicate
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"recorded routes row {row} is {routes[row].tolist()}; each row must be all -1 "
            f"(route live) or {top_k} distinct expert ids in [0, {num_experts})"
        )


class RouterReplay:
    """Records routers' top-k expert ids in one forward and replays them in later ones.

    Example::

        replay = RouterReplay()
        replay.bind(model)                       # every router with a layer_id
        with replay.record():
            rollout_model(batch)                 # or the first training forward
        routes = replay.routes                   # {layer_id: [T, K] int64}
        with replay.replay(routes):              # forward, checkpoint recompute and backward
            loss = loss_fn(model(batch))
            loss.backward()

    In record mode a layer recomputed during backward (activation checkpointing) reuses its
    first recording; a layer seen twice in forward raises, so open one ``record()`` context
    per forward (micro-batch), around its forward and backward. Every record context appends
    its routes to :attr:`history`, so a window of micro-batches keeps one recording each
    (replay them in order with ``replay(history[i])``).
    """

    def __init__(self) -> None:
        self._mode: _Mode = "off"
        self._recorded: dict[int, Tensor] = {}
        self._replaying: dict[int, Tensor] = {}
        self._strict = True
        self._history: list[dict[int, Tensor]] = []
        # An invalid replay_stacked input: raised by the first router call, inside the MoE
        # layer's forward, where a distributed dispatcher makes every rank raise together.
        self._deferred: ValueError | None = None
        # layer id -> (E, K) of the bound routers, to validate replayed routes on entry.
        self._shapes: dict[int, tuple[int, int]] = {}

    @property
    def mode(self) -> str:
        """The mode: "off", "record" or "replay"."""
        return self._mode

    @property
    def routes(self) -> dict[int, Tensor]:
        """The last recording, {global layer id: [T, K] int64}."""
        return dict(self._recorded)

    @property
    def history(self) -> list[dict[int, Tensor]]:
        """One recording per ``record()`` context since the last :meth:`clear_history`."""
        return list(self._history)

    def clear_history(self) -> None:
        """Forget the recordings of earlier micro-batches (e.g. at a window boundary)."""
        self._history = []

    @property
    def layer_ids(self) -> list[int]:
        """The bound layer ids, sorted: the L axis of :meth:`replay_stacked` routes."""
        return sorted(self._shapes)

    def bind(self, *models: nn.Module) -> list[int]:
        """Attach this replay to every router found in ``models`` (model parts, several models).

        A router is a module with ``layer_id`` and ``router_replay`` attributes (like
        :class:`moe_dispatch.TopKRouter`). A model part without routers binds nothing.

        Returns:
            The bound layer ids, sorted.

        Raises:
            ValueError: a router has no layer id, or two routers share one.
        """
        bound: dict[int, str] = {}
        routers: list[Any] = []
        for model in models:
            for name, module in model.named_modules():
                if not (hasattr(module, "router_replay") and hasattr(module, "layer_id")):
                    continue
                layer_id = module.layer_id
                if layer_id is None:
                    raise ValueError(
                        f"router {name!r} has no layer_id; give every MoE layer its global "
                        "decoder-layer index (MoEConfig.layer_id or convert_hf_moe's numbering)"
                    )
                if layer_id in bound:
                    raise ValueError(
                        f"routers {bound[layer_id]!r} and {name!r} share layer_id {layer_id}; "
                        "layer ids must be unique across all bound model parts"
                    )
                bound[layer_id] = name
                routers.append(module)
        for module in routers:  # only after every check passed: binding is all or nothing
            module.router_replay = self
            weight = getattr(module, "weight", None)
            if isinstance(weight, Tensor) and hasattr(module, "top_k"):
                self._shapes[module.layer_id] = (int(weight.shape[0]), int(module.top_k))
        return sorted(bound)

    @contextlib.contextmanager
    def record(self) -> Iterator[RouterReplay]:
        """Record each bound router's top-k ids (clears the previous recording)."""
        self._enter("record")
        self._recorded = {}
        try:
            yield self
        finally:
            self._mode = "off"
            self._history.append(dict(self._recorded))

    @contextlib.contextmanager
    def replay(self, routes: Mapping[int, Tensor], *, strict: bool = True) -> Iterator[None]:
        """Replay ``routes`` ({layer id: [T, K]}); rows of -1 route live.

        Args:
            routes: as returned by :attr:`routes`, possibly sharded/packed along T.
            strict: a bound router whose layer id is missing from ``routes`` raises; with
                False it routes live.
        """
        self._enter("replay")
        self._replaying = dict(routes)
        self._strict = strict
        try:
            yield
        finally:
            self._mode = "off"
            self._replaying = {}
            self._deferred = None

    def replay_stacked(
        self, routes: Tensor, *, num_tokens: int | None = None, strict: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        """Replay external token-aligned routes [T, L, K] (e.g. an inference engine's).

        The L axis follows :attr:`layer_ids` (the bound layers, sorted). The shape, the
        token count and every id (in [0, E) or a whole -1 row) are checked on entry; an error
        is raised by the first MoE layer of the forward, so that with an expert-parallel
        dispatcher every rank raises together instead of waiting for this one.

        Args:
            routes: [T, L, K] integer.
            num_tokens: the T the model will see (after packing/sharding); None skips that
                check (each layer still checks it when it runs).
            strict: as in :meth:`replay`.
        """
        layer_ids = self.layer_ids
        if not layer_ids:
            raise RuntimeError("no router is bound; call bind(model) before replaying routes")
        error = self._check_stacked(routes, layer_ids, num_tokens)
        if error is not None:
            context = self.replay({}, strict=strict)
            self._deferred = error
            return context
        return self.replay(unstack_routes(routes, layer_ids), strict=strict)

    def _check_stacked(
        self, routes: Tensor, layer_ids: list[int], num_tokens: int | None
    ) -> ValueError | None:
        top_ks = sorted({k for _, k in self._shapes.values()})
        want_k = top_ks[0] if len(top_ks) == 1 else top_ks
        if routes.dim() != 3 or routes.shape[1] != len(layer_ids) or routes.shape[2] not in top_ks:
            return ValueError(
                f"external routes have shape {tuple(routes.shape)}, expected [T, L="
                f"{len(layer_ids)}, K={want_k}] for the bound layers {layer_ids}"
            )
        if num_tokens is not None and routes.shape[0] != num_tokens:
            return ValueError(
                f"external routes hold {routes.shape[0]} tokens, the batch has {num_tokens}; "
                "shard and pack the routes together with the tokens"
            )
        for i, layer_id in enumerate(layer_ids):
            num_experts, top_k = self._shapes[layer_id]
            try:
                validate_routes(
                    routes[:, i],
                    num_tokens=int(routes.shape[0]),
                    num_experts=num_experts,
                    top_k=top_k,
                )
            except ValueError as err:
                return ValueError(f"external routes of layer {layer_id}: {err}")
        return None

    def _enter(self, mode: _Mode) -> None:
        if self._mode != "off":
            raise RuntimeError(
                f"RouterReplay is already in {self._mode!r} mode; contexts do not nest, "
                f"leave the {self._mode!r} context before entering {mode!r}"
            )
        self._mode = mode

    def select(self, layer_id: int | None, scores: Tensor, top_k: int) -> Tensor:
        """The top-k expert ids for one router call.

        Args:
            layer_id: the router's global layer id (None: never recorded or replayed).
            scores: [T, E] router scores (any monotone transform of the logits).
            top_k: K.

        Returns:
            [T, K] int64 ids: live top-k, or the replayed ids where the recording has them.
        """
        if self._mode == "off" or layer_id is None:
            return _live_topk(scores, top_k)
        if self._mode == "replay" and self._deferred is not None:
            raise self._deferred
        num_tokens, num_experts = scores.shape
        if self._mode == "record":
            previous = self._recorded.get(layer_id)
            if previous is not None:
                if _in_backward() and previous.shape == (num_tokens, top_k):
                    # Checkpoint recomputation during backward: keep the first forward's ids.
                    return previous.to(scores.device)
                raise RuntimeError(
                    f"layer {layer_id} was already recorded in this record() context (a second "
                    "forward, or a layer called twice); open one record() context per forward "
                    "and keep each recording"
                )
            ids = _live_topk(scores, top_k)
            self._recorded[layer_id] = ids.detach().clone()
            return ids
        routes = self._replaying.get(layer_id)
        if routes is None:
            if self._strict:
                raise KeyError(
                    f"no recorded routes for layer {layer_id} (recorded layers: "
                    f"{sorted(self._replaying)}); record this layer, or replay with strict=False "
                    "to route it live"
                )
            return _live_topk(scores, top_k)
        validate_routes(routes, num_tokens=num_tokens, num_experts=num_experts, top_k=top_k)
        routes = routes.to(device=scores.device, dtype=torch.long)
        live_rows = (routes == NO_EXPERT).all(dim=1, keepdim=True)
        if not bool(live_rows.any()):
            return routes
        return torch.where(live_rows, _live_topk(scores, top_k), routes)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (where checkpoints recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)


def _live_topk(scores: Tensor, top_k: int) -> Tensor:
    return torch.topk(scores.detach(), top_k, dim=-1).indices


def stack_routes(routes: Mapping[int, Tensor], layer_ids: Sequence[int]) -> Tensor:
    """{layer id: [T, K]} -> one token-aligned [T, L, K] tensor (shard or pack it along T)."""
    missing = [i for i in layer_ids if i not in routes]
    if missing:
        raise KeyError(f"routes lack layers {missing}; recorded layers are {sorted(routes)}")
    return torch.stack([routes[i] for i in layer_ids], dim=1)


def unstack_routes(stacked: Tensor, layer_ids: Iterable[int]) -> dict[int, Tensor]:
    """[T, L, K] -> {layer id: [T, K]}, the inverse of :func:`stack_routes`."""
    ids = list(layer_ids)
    if stacked.dim() != 3 or stacked.shape[1] != len(ids):
        raise ValueError(
            f"stacked routes must be [T, L={len(ids)}, K], got shape {tuple(stacked.shape)}"
        )
    return {layer_id: stacked[:, i] for i, layer_id in enumerate(ids)}
