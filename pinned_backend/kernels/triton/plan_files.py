"""Matmul plans as data: files of plans keyed by the GPU and Triton they were proven under, and the weight's shape.

A plan file holds, for one GPU (its name and compute capability) and one Triton version, the plan of each weight
shape (N, K) it was tuned for, and says which models' shapes those are. `stackpin-backend tune` writes them
(tuner.py), each plan's tiles proven bit-identical to one another at every M = 1..512 on that GPU under that Triton;
the package ships the files of the models the project measures (`plans/`). A file is checked when it is loaded:
its format, every plan's tiles against the plans' own rules (`MatmulPlan.check`), and its header against the GPU
and Triton that run it, since tiles proven to agree under one compiler and instruction set may not under another.

`MatmulPlans` is what one kernel set's matmuls take: one plan file's plan where it has the weight's shape, the rule
(`rule_plan`) elsewhere. Which file serves a model is chosen at start (`plan_file_for`), and the stack names it by
name and SHA-256 of its bytes, so that a replay can ask for the same. This module knows nothing of kernels.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .matmul_plans import LARGE_M, MatmulPlan, MatmulTile, rule_plan, unproven_plan

FORMAT = "stackpin-matmul-plans/1"
SHIPPED = Path(__file__).resolve().parent / "plans"
_TILE_FLAGS = {f.name: f.default for f in fields(MatmulTile) if f.default is not MISSING}
_TILE_TYPES = {**{f.name: 0 for f in fields(MatmulTile)}, **_TILE_FLAGS}


class PlanFileError(ValueError):
    """A plan file that cannot be used: malformed, or proven on another GPU or under another Triton."""


@dataclass(frozen=True)
class Proven:
    """Where a plan file's plans were proven: the GPU's name and compute capability, and the Triton version."""

    gpu: str
    capability: tuple[int, int]
    triton: str

    def __str__(self) -> str:
        return (
            f"{self.gpu} (compute capability {self.capability[0]}.{self.capability[1]}), Triton {self.triton}"
        )


@dataclass(frozen=True)
class PlanFile:
    name: str  # the file's name, which the stack reports
    sha256: str  # of the file's bytes
    proven: Proven
    models: tuple[str, ...]  # whose weight shapes the plans are for, as the tuner was told
    plans: dict[tuple[int, int], MatmulPlan] = field(hash=False)

    def covers(self, shapes: Iterable[tuple[int, int]]) -> int:
        return sum(shape in self.plans for shape in set(shapes))

    def described(self) -> dict[str, str]:
        """What the stack says of the file: its name and the SHA-256 of its bytes."""
        return {"name": self.name, "sha256": self.sha256}


class _Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    n: int = Field(ge=1)
    k: int = Field(ge=1)
    split_k: int = Field(ge=1)
    # Each a tile's fields (MatmulTile's, those left out at their defaults) and `up_to_m`: the largest M it serves,
    # null for every larger M.
    tiles: list[dict[str, int | bool | str | None]] = Field(min_length=1)


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["stackpin-matmul-plans/1"]
    gpu: str
    compute_capability: str = Field(pattern=r"^\d+\.\d+$")
    triton: str
    models: list[str]
    proven: str  # what was proven, in words
    plans: list[_Plan]


def parse(text: str, name: str) -> PlanFile:
    """The plan file `name` from its text; raises PlanFileError saying what is wrong."""
    try:
        raw = _File.model_validate_json(text)
    except ValidationError as exc:
        raise PlanFileError(f"{name}: not a plan file of format {FORMAT}: {exc.errors()[0]['msg']}") from exc
    plans: dict[tuple[int, int], MatmulPlan] = {}
    for entry in raw.plans:
        where = f"{name}: N = {entry.n}, K = {entry.k}"
        if (entry.n, entry.k) in plans:
            raise PlanFileError(f"{name}: two plans for N = {entry.n}, K = {entry.k}")
        try:
            tiles = tuple(_tile_of(dict(fields)) for fields in entry.tiles)
            bounds = [up_to for up_to, _ in tiles]
            if bounds[-1] != LARGE_M or bounds != sorted(set(bounds)):
                raise ValueError("tiles must serve ascending M, the last every larger M")
            plan = MatmulPlan(entry.split_k, tiles)
            plan.check(entry.k)
        except (TypeError, ValueError) as exc:
            raise PlanFileError(f"{where}: {exc}") from exc
        plans[(entry.n, entry.k)] = plan
    major, minor = (int(part) for part in raw.compute_capability.split("."))
    return PlanFile(
        name=name,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        proven=Proven(raw.gpu, (major, minor), raw.triton),
        models=tuple(raw.models),
        plans=plans,
    )


def _tile_of(fields: dict[str, Any]) -> tuple[int, MatmulTile]:
    up_to = fields.pop("up_to_m", 0)
    if up_to is not None and (not isinstance(up_to, int) or up_to < 1):
        raise ValueError(f"up_to_m must be a positive M or null, not {up_to!r}")
    tile = MatmulTile(**fields)
    if any(type(value) is not type(_TILE_TYPES[key]) for key, value in tile.__dict__.items()):
        raise ValueError(f"{fields}: a tile's sizes are integers, its switches true or false, gluon a name")
    return LARGE_M if up_to is None else up_to, tile


def load(path: Path) -> PlanFile:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanFileError(f"{path}: cannot read the plan file ({exc.strerror})") from exc
    return parse(text, path.name)


def dump(proven: Proven, models: Collection[str], plans: dict[tuple[int, int], MatmulPlan], what: str) -> str:
    """A plan file's text: the plans in (N, K) order, one tile a line, flags only where they are set."""
    lines = [
        "{",
        f'  "format": {json.dumps(FORMAT)},',
        f'  "gpu": {json.dumps(proven.gpu)},',
        f'  "compute_capability": "{proven.capability[0]}.{proven.capability[1]}",',
        f'  "triton": {json.dumps(proven.triton)},',
        f'  "models": {json.dumps(list(models))},',
        f'  "proven": {json.dumps(what)},',
        '  "plans": [',
    ]
    entries = []
    for (n, k), plan in sorted(plans.items()):
        tiles = ",\n".join(f"      {json.dumps(_tile_fields(up_to, tile))}" for up_to, tile in plan.tiles)
        entries.append(f'    {{"n": {n}, "k": {k}, "split_k": {plan.split_k}, "tiles": [\n{tiles}\n    ]}}')
    lines += [",\n".join(entries), "  ]", "}", ""]
    return "\n".join(lines)


def _tile_fields(up_to: int, tile: MatmulTile) -> dict[str, Any]:
    values: dict[str, Any] = {"up_to_m": None if up_to == LARGE_M else up_to}
    for key, value in tile.__dict__.items():
        if key not in _TILE_FLAGS or value != _TILE_FLAGS[key]:
            values[key] = value
    return values


def running_on(device: torch.device) -> Proven:
    """The GPU and Triton that run kernels on the CUDA `device`: what a plan file must have been proven on."""
    import triton

    index = device.index if device.index is not None else torch.cuda.current_device()
    return Proven(
        torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index), triton.__version__
    )


def shipped() -> list[PlanFile]:
    """The plan files this package ships, in name order."""
    return [load(path) for path in sorted(SHIPPED.glob("*.json"))]


def choose(files: Iterable[PlanFile], proven: Proven, shapes: Collection[tuple[int, int]]) -> PlanFile | None:
    """Of `files`, the one proven on `proven`'s GPU and Triton that holds the most of `shapes` (the first by name
    where several hold as many); None where none holds any."""
    usable = [f for f in files if f.proven == proven and f.covers(shapes)]
    return max(sorted(usable, key=lambda f: f.name), key=lambda f: f.covers(shapes), default=None)


def plan_file_for(
    proven: Proven, shapes: Collection[tuple[int, int]], explicit: Path | Literal["auto", "none"] = "auto"
) -> PlanFile | None:
    """The plan file a model of weight `shapes` takes on `proven`'s GPU and Triton: the shipped one that holds the
    most of its shapes ("auto"), none ("none": the rule for every shape), or the file at a path, which must have
    been proven on this GPU under this Triton."""
    if explicit == "none":
        return None
    if explicit == "auto":
        return choose(shipped(), proven, shapes)
    chosen = load(explicit)
    if chosen.proven != proven:
        raise PlanFileError(
            f"{explicit}: its plans were proven on {chosen.proven}; this is {proven}. Tune plans here with "
            "`stackpin-backend tune`"
        )
    return chosen


class MatmulPlans:
    """The plans one kernel set's matmuls take: `plan_file`'s for the shapes it holds, on the compute capability it
    was proven on (on another, its reduction order in one plain tile), and `rule_plan` for every other (N, K). Each
    is built once and kept."""

    def __init__(self, plan_file: PlanFile | None = None) -> None:
        self.plan_file = plan_file
        self._plans: dict[tuple[int, int, tuple[int, int]], MatmulPlan] = {}
        self._aliases: dict[tuple[int, int], tuple[int, int]] = {}

    def alias(self, shard: tuple[int, int], whole: tuple[int, int]) -> None:
        """(N, K) `shard` takes the plan of `whole`, of the same K: a tensor-parallel rank's slice of a weight."""
        if shard[1] != whole[1]:
            raise ValueError(f"a column slice {shard} keeps its whole weight's K, not {whole}")
        if self._aliases.get(shard, whole) != whole:
            raise ValueError(
                f"the slice shape {shard} stands for two weights, {self._aliases[shard]} and {whole}"
            )
        self._aliases[shard] = whole

    def plan(self, n: int, k: int, capability: tuple[int, int]) -> MatmulPlan:
        n, k = self._aliases.get((n, k), (n, k))
        key = (n, k, capability)
        plan = self._plans.get(key)
        if plan is None:
            source = self.plan_file
            if source is None or (n, k) not in source.plans:
                plan = rule_plan(n, k, capability)
            elif source.proven.capability == capability:
                plan = source.plans[(n, k)]
            else:
                # Its reduction order, in the one plain tile of a GPU whose tiles were not proven against another.
                plan = MatmulPlan(source.plans[(n, k)].split_k, unproven_plan(n, k).tiles)
            plan.check(k)
            self._plans[key] = plan
        return plan
