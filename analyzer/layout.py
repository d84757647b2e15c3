"""The parallel layout of a job: which TP/CP/EP/DP/PP coordinates and node each global rank has.

Follows Megatron-LM's rank generator: the order string (default ``tp-cp-ep-dp-pp``) lists the
dimensions fastest-varying first, and the world size is the product of all sizes. A size left out
is 1, except DP, which absorbs what remains of the world size. Sizes that do not multiply up to the
world size are a `LayoutError` that says which numbers disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatrace.config import ConfigError, load_config

DIMS = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
DIM_NAMES = {"tp": "TP", "cp": "CP", "ep": "EP", "dp": "DP", "pp": "PP"}


class LayoutError(ValueError):
    """A layout that cannot describe the job; the message says why."""


@dataclass
class LayoutConfig:
    """What a layout YAML file (or the command-line flags) may say."""

    world_size: int | None = None
    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int | None = None
    pp: int = 1
    order: str = DEFAULT_ORDER
    gpus_per_node: int = 8


@dataclass(frozen=True)
class Layout:
    """A resolved layout: every size known and consistent with the world size."""

    world_size: int
    sizes: dict[str, int]
    order: tuple[str, ...]
    gpus_per_node: int = 8

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's coordinate in every dimension, e.g. ``{"tp": 1, "dp": 3, "pp": 0, ...}``."""
        out = {}
        stride = 1
        for dim in self.order:
            out[dim] = (rank // stride) % self.sizes[dim]
            stride *= self.sizes[dim]
        return out

    def group(self, rank: int, dim: str) -> tuple[int, ...]:
        """The ranks sharing every coordinate with `rank` except `dim` (its TP group, DP group, ...)."""
        stride = 1
        for name in self.order:
            if name == dim:
                break
            stride *= self.sizes[name]
        base = rank - ((rank // stride) % self.sizes[dim]) * stride
        return tuple(base + i * stride for i in range(self.sizes[dim]))

    def groups(self, dim: str) -> list[tuple[int, ...]]:
        """All groups of dimension `dim`, each sorted, ordered by their first rank."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(self.group(rank, dim), None)
        return sorted(seen)

    def group_holding(self, seen: set[int], single: bool = False) -> tuple[int, ...]:
        """The smallest group of any dimension holding every rank seen using a communicator (ranks that
        never reached it, or left no log, are missing from what the logs show); the ranks seen when no
        group holds them, or when one rank alone was seen and `single` is false (a one-rank group, say a
        DP group of size 1, is not to be merged into another)."""
        rank = min(seen)
        holding = [
            self.group(rank, dim)
            for dim in DIMS
            if self.sizes[dim] > 1 and rank < self.world_size and seen <= set(self.group(rank, dim))
        ]
        if not holding or (len(seen) < 2 and not single):
            return tuple(sorted(seen))
        return min(holding, key=len)

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def describe(self, rank: int) -> str:
        """A short position string like ``node 1, TP 1/2, DP 3/4, PP 0/2`` (dimensions of size 1 left out)."""
        coords = self.coords(rank)
        parts = [f"node {self.node(rank)}"]
        parts += [
            f"{DIM_NAMES[dim]} {coords[dim]}/{self.sizes[dim]}"
            for dim in ("tp", "cp", "ep", "dp", "pp")
            if self.sizes[dim] > 1
        ]
        return ", ".join(parts)


def parse_order(order: str) -> tuple[str, ...]:
    parts = tuple(part.strip().lower() for part in order.split("-"))
    unknown = [part for part in parts if part not in DIMS]
    if unknown:
        raise LayoutError(f"order {order!r}: unknown dimension(s) {', '.join(unknown)}; use {'/'.join(DIMS)}")
    if len(set(parts)) != len(parts):
        raise LayoutError(f"order {order!r}: a dimension appears twice")
    missing = [dim for dim in DIMS if dim not in parts]
    if missing:
        raise LayoutError(f"order {order!r}: missing dimension(s) {', '.join(missing)}")
    return parts


def resolve(config: LayoutConfig, world_size: int | None = None) -> Layout:
    """Fill in DP (and the world size) and check that the sizes multiply up to the world size."""
    order = parse_order(config.order)
    world = config.world_size or world_size
    sizes = {"tp": config.tp, "cp": config.cp, "ep": config.ep, "pp": config.pp}
    for name, value in [*sizes.items(), ("dp", config.dp), ("gpus_per_node", config.gpus_per_node)]:
        if value is not None and value < 1:
            raise LayoutError(f"{name} must be at least 1, got {value}")
    if config.world_size and world_size and world_size > config.world_size:
        raise LayoutError(f"the logs show rank {world_size - 1}, outside world size {config.world_size}")
    fixed = sizes["tp"] * sizes["cp"] * sizes["ep"] * sizes["pp"]
    if config.dp is not None:
        sizes["dp"] = config.dp
        if world is None:
            world = fixed * config.dp
    if world is None:
        raise LayoutError("world size unknown: give --world-size or logs of every rank")
    if config.dp is None:
        if world % fixed:
            raise LayoutError(
                f"world size {world} is not divisible by tp*cp*ep*pp = "
                f"{sizes['tp']}*{sizes['cp']}*{sizes['ep']}*{sizes['pp']} = {fixed}"
            )
        sizes["dp"] = world // fixed
    product = fixed * sizes["dp"]
    if product != world:
        raise LayoutError(
            f"tp*cp*ep*dp*pp = {sizes['tp']}*{sizes['cp']}*{sizes['ep']}*{sizes['dp']}*{sizes['pp']} "
            f"= {product}, but the world size is {world}"
        )
    return Layout(world, sizes, order, config.gpus_per_node)


def load_layout_file(path: str | Path, overrides: dict | None = None) -> LayoutConfig:
    """Read a layout YAML file (keys of `LayoutConfig`); bad keys raise ConfigError naming them."""
    return load_config(LayoutConfig, path, env_prefix="MEGATRACE_ANALYZER_LAYOUT_", overrides=overrides)


def layout_config_from(values: dict) -> LayoutConfig:
    """A `LayoutConfig` from flag values (``None`` entries are left at their defaults)."""
    try:
        return load_config(LayoutConfig, None, overrides={k: v for k, v in values.items() if v is not None})
    except ConfigError as exc:
        raise LayoutError(str(exc)) from exc
