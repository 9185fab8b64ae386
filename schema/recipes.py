"""Model state recipes: what state a model needs to resume at a token boundary.

They live with the schema because both sides use them: shims derive them from an engine's
KV-cache config and the analysis checks completeness against them.

A recipe lists a model's cache groups, each with the component it holds, its block size and
the rule that makes it complete at a boundary p. Recipes are data (msgspec Structs, loadable
from JSON or TOML); the engine shims derive them from the engine's own KV-cache config.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

import msgspec

from kvtrace.schema.kinds import ComponentKind


class GroupSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One cache group.

    `window` is the sliding window in tokens (SLIDING_WINDOW). `ratio` is, for an
    UNCOMPRESSED_TAIL group, the block size of the compressed group it completes: compressed
    blocks cover [0, floor(p/ratio)*ratio) and the tail covers the rest up to p. `indexes` is,
    for an INDEXER group, the group id of the KV it indexes.
    """

    group_id: int
    component: ComponentKind
    block_size: int
    window: int = 0
    ratio: int = 0
    indexes: int = -1

    def needed(self, p: int) -> range:
        """Indices of this group's blocks that must be usable to resume at token boundary p.

        This is the completeness rule of each component kind, in one place: the analysis
        checks it, and the reference simulator's engine uses it to decide what it can reuse.
        """
        if p <= 0:
            return range(0)
        b, c = self.block_size, self.component
        if c is ComponentKind.SLIDING_WINDOW:  # the blocks covering the last `window` tokens
            return range(max(0, p - self.window) // b, p // b)
        if c is ComponentKind.MAMBA:  # one checkpoint, exactly at p
            return range(p // b - 1, p // b)
        if c is ComponentKind.UNCOMPRESSED_TAIL:  # the tokens after the last compressed block
            return range((p // self.ratio) * self.ratio // b, p // b)
        return range(0, p // b)  # full attention, compressed, indexer, cross attention


class RecipeError(ValueError):
    """A recipe that cannot describe a real model; the message names the group and field."""


class Recipe(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    name: str
    groups: tuple[GroupSpec, ...]
    description: str = ""

    def __post_init__(self) -> None:
        if not self.groups:
            raise RecipeError(f"recipe {self.name!r}: no groups")
        for i, g in enumerate(self.groups):
            where = f"recipe {self.name!r} group {i}"
            if g.group_id != i:
                raise RecipeError(f"{where}: group_id {g.group_id} must equal its position {i}")
            if g.block_size <= 0:
                raise RecipeError(f"{where}: block_size must be > 0")
            if g.component is ComponentKind.SLIDING_WINDOW and g.window <= 0:
                raise RecipeError(f"{where}: a sliding_window group needs window > 0")
            if g.component is ComponentKind.UNCOMPRESSED_TAIL:
                if g.ratio <= 0 or g.ratio % g.block_size:
                    raise RecipeError(f"{where}: a tail group needs ratio > 0, a multiple of its block_size")
            if g.component is ComponentKind.INDEXER and not 0 <= g.indexes < len(self.groups):
                raise RecipeError(f"{where}: an indexer group needs `indexes` naming a KV group")
            if g.component in (ComponentKind.NONE, ComponentKind.OTHER):
                raise RecipeError(f"{where}: component {g.component.value!r} has no completeness rule")

    @cached_property
    def alignment(self) -> int:
        """Boundaries must be multiples of every group's block size.

        A compressed group completed by an uncompressed tail is the exception: the tail covers
        the tokens after its last block, so it does not constrain the boundary.
        """
        completed = {g.ratio for g in self.groups if g.component is ComponentKind.UNCOMPRESSED_TAIL}
        return math.lcm(
            *(
                g.block_size
                for g in self.groups
                if not (g.component is ComponentKind.COMPRESSED and g.block_size in completed)
            )
        )


def dense(block_size: int = 16) -> Recipe:
    return Recipe(
        name="dense",
        description="Full attention in every layer (Llama-style).",
        groups=(GroupSpec(group_id=0, component=ComponentKind.FULL_ATTENTION, block_size=block_size),),
    )


BUILTIN: dict[str, Recipe] = {
    r.name: r
    for r in (
        dense(),
        Recipe(
            name="sliding-window-hybrid",
            description="Gemma-style interleave of full-attention and sliding-window (W=512) layers.",
            groups=(
                GroupSpec(group_id=0, component=ComponentKind.FULL_ATTENTION, block_size=16),
                GroupSpec(group_id=1, component=ComponentKind.SLIDING_WINDOW, block_size=16, window=512),
            ),
        ),
        Recipe(
            name="mamba-hybrid",
            description="Jamba / Nemotron-H style: attention layers plus Mamba state checkpointed per 64 tokens.",
            groups=(
                GroupSpec(group_id=0, component=ComponentKind.FULL_ATTENTION, block_size=16),
                GroupSpec(group_id=1, component=ComponentKind.MAMBA, block_size=64),
            ),
        ),
        Recipe(
            name="sparse-indexer",
            description="DeepSeek-V3.2 style: MLA KV plus a lightning-indexer key cache in sync with it.",
            groups=(
                GroupSpec(group_id=0, component=ComponentKind.FULL_ATTENTION, block_size=64),
                GroupSpec(group_id=1, component=ComponentKind.INDEXER, block_size=64, indexes=0),
            ),
        ),
        Recipe(
            name="compressed-hybrid",
            description=(
                "DeepSeek-V4 style: compressed KV blocks of 64 tokens plus an uncompressed tail, "
                "a 128-token sliding window and an indexer."
            ),
            groups=(
                GroupSpec(group_id=0, component=ComponentKind.COMPRESSED, block_size=64),
                GroupSpec(group_id=1, component=ComponentKind.UNCOMPRESSED_TAIL, block_size=16, ratio=64),
                GroupSpec(group_id=2, component=ComponentKind.SLIDING_WINDOW, block_size=16, window=128),
                GroupSpec(group_id=3, component=ComponentKind.INDEXER, block_size=16, indexes=0),
            ),
        ),
    )
}


def load_recipe(source: str) -> Recipe:
    """A built-in recipe by name, or one read from a .json / .toml file."""
    if source in BUILTIN:
        return BUILTIN[source]
    path = Path(source)
    if not path.is_file():
        raise RecipeError(f"no built-in recipe or file named {source!r} (built-in: {', '.join(BUILTIN)})")
    try:
        if path.suffix == ".toml":
            return msgspec.convert(tomllib.loads(path.read_text()), Recipe)
        return msgspec.json.decode(path.read_bytes(), type=Recipe)
    except (msgspec.ValidationError, msgspec.DecodeError, tomllib.TOMLDecodeError) as exc:
        raise RecipeError(f"{path}: {exc}") from None


class UnknownModel(KeyError):
    """A lookup for a model no recipe was given for, and whose engine published none."""


class RecipeMismatch(RecipeError):
    """A recipe given for a model contradicts what its engine reported or what its events show."""


def recipe_from_json(text: str | bytes) -> Recipe:
    """A recipe as an attach event carries it (msgspec JSON of `Recipe`)."""
    try:
        return msgspec.json.decode(text, type=Recipe)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RecipeError(f"not a recipe: {exc}") from None


def recipe_json(recipe: Recipe) -> str:
    return msgspec.json.encode(recipe).decode()


_COMPARED = ("component", "block_size", "window", "ratio", "indexes")


def _shown(value: object) -> object:
    return value.value if isinstance(value, ComponentKind) else value


def contradiction(given: Recipe, engine: Recipe) -> str:
    """How `given` contradicts the engine's own recipe, in words; "" when they agree on every
    group (names and descriptions may differ)."""
    if len(given.groups) != len(engine.groups):
        return f"the recipe has {len(given.groups)} cache group(s), the engine {len(engine.groups)}"
    for g, e in zip(given.groups, engine.groups, strict=True):
        for name in _COMPARED:
            mine, theirs = getattr(g, name), getattr(e, name)
            if mine != theirs:
                return f"group {g.group_id}: the recipe's {name} is {_shown(mine)}, the engine's {_shown(theirs)}"
    return ""


def span_contradiction(given: Recipe, group_id: int, span: int, commits: int) -> str:
    """How commits of up to `span` tokens a block in `group_id` contradict `given`; "" when they
    fit (a group the recipe has, blocks no longer than its block size)."""
    if group_id >= len(given.groups):
        return (f"commits name cache group {group_id} ({commits} of them), the recipe has groups "
                f"0-{len(given.groups) - 1}")
    g = given.groups[group_id]
    if span > g.block_size:
        return (f"group {group_id} ({g.component.value}): the recipe's block_size is {g.block_size}, the engine's "
                f"commits span {span} tokens a block ({commits} commits)")
    return ""


SourceKey = tuple[int, str, str]  # source_id, engine, model: one engine process's model


class RecipeBook:
    """Which recipe judges each lookup: the one place the rule lives.

    A lookup of `model` reported by `engine` uses the recipe given for `ENGINE:MODEL`, else the
    one for `MODEL`, else the book's default, else the recipe its engine published when its shim
    attached (an `attach` event: the engine says what it is). So a given recipe is an override,
    and with none given every lookup is judged by its own engine's cache groups. An engine and
    the KV store behind it report the same model (vLLM and LMCache) but cache it in different
    units (16-token blocks, 256-token chunks), so each may need its own recipe. Every path
    (streaming, live, ClickHouse, DuckDB, capacity) asks the book, so they cannot disagree on
    which recipe a lookup got.

    A book is a value: `publish` returns a new book, so one given to several runs stays as given.
    """

    __slots__ = ("_scoped", "default", "_published", "_instances")

    def __init__(self, scoped: Mapping[str, Recipe] | None = None, default: Recipe | None = None) -> None:
        self._scoped: dict[str, Recipe] = dict(scoped or {})
        self.default = default
        self._published: dict[SourceKey, Recipe] = {}
        self._instances: dict[SourceKey, str] = {}

    @classmethod
    def of(cls, recipes: RecipeBook | Recipe | None) -> RecipeBook:
        """A book as given, one recipe for every model (the common case of one model), or, for
        None, an empty book: every lookup judged by the recipe its engine published."""
        if recipes is None:
            return cls()
        return recipes if isinstance(recipes, RecipeBook) else cls(default=recipes)

    @classmethod
    def parse(cls, specs: Iterable[str]) -> RecipeBook:
        """Command-line `--recipe` values: `RECIPE` (the default, for every model named by no
        other) or `[ENGINE:]MODEL=RECIPE`; a RECIPE is a built-in name or a .json/.toml file.
        No value at all is an empty book: the engines' own recipes."""
        scoped: dict[str, Recipe] = {}
        default: Recipe | None = None
        for spec in specs:
            key, sep, source = spec.partition("=")
            if not sep:
                if default is not None:
                    raise RecipeError(f"--recipe {spec!r}: a second unscoped recipe; scope it: --recipe MODEL={spec}")
                default = load_recipe(spec)
            elif not key or not source:
                raise RecipeError(f"--recipe {spec!r}: expected [ENGINE:]MODEL=RECIPE")
            elif key in scoped:
                raise RecipeError(f"--recipe {spec!r}: {key!r} is given twice")
            else:
                scoped[key] = load_recipe(source)
        return cls(scoped, default)

    @property
    def scoped(self) -> Mapping[str, Recipe]:
        """The recipes given for one `MODEL` or `ENGINE:MODEL` (a read-only view)."""
        return MappingProxyType(self._scoped)

    @property
    def published(self) -> Mapping[SourceKey, Recipe]:
        """The recipes engines published, by (source_id, engine, model) (a read-only view)."""
        return MappingProxyType(self._published)

    @property
    def instances(self) -> Mapping[SourceKey, str]:
        """The instance each published recipe came from (a read-only view)."""
        return MappingProxyType(self._instances)

    def given(self, model: str, engine: str = "") -> Recipe | None:
        """The recipe given for the model (scoped, else the default); None when none was given."""
        qualified = f"{engine}:{model}"
        if engine and qualified in self._scoped:
            return self._scoped[qualified]
        return self._scoped.get(model, self.default)

    def publish(self, source_id: int, engine: str, model: str, recipe: Recipe, instance: str = "") -> RecipeBook:
        """This book with an engine's own recipe added, as its attach event reported it.

        A recipe given for the same model that contradicts it is refused: `RecipeMismatch` names
        the model, the engine and instance, the group and both values. Judging that engine's
        lookups by the given recipe would report made-up gaps (or hide real ones)."""
        given = self.given(model, engine)
        if given is not None and (why := contradiction(given, recipe)):
            raise RecipeMismatch(
                f"recipe {given.name!r} given for model {model!r} contradicts what its engine reported "
                f"({engine} instance {instance or '?'}, source {source_id:016x}): {why}")
        key = (source_id, engine, model)
        if self._published.get(key) == recipe:
            return self
        out = RecipeBook(self._scoped, self.default)
        out._published = {**self._published, key: recipe}
        out._instances = {**self._instances, key: instance}
        return out

    def check_commits(self, engine: str, model: str, group_id: int, span: int, commits: int = 1) -> None:
        """Refuse a given recipe that a commit of `span` tokens a block in `group_id` contradicts
        (`RecipeMismatch`): a group the recipe lacks, or blocks longer than its block size (a
        shorter one can be a store's partial last chunk). The engines' own recipes are not
        checked against their events."""
        given = self.given(model, engine)
        if given is not None and (why := span_contradiction(given, group_id, span, commits)):
            raise RecipeMismatch(f"recipe {given.name!r} given for model {model!r} contradicts the events of "
                                 f"engine {engine or '?'}: {why}")

    def key(self, model: str, engine: str = "", source_id: int = 0) -> str:
        """The name the lookup's recipe goes by, what the SQL paths key their recipe rows on:
        `ENGINE:MODEL` when that was given, else `MODEL` (also when the default serves it), else
        `ENGINE:MODEL@SOURCE` for a recipe its engine published."""
        qualified = f"{engine}:{model}"
        if engine and qualified in self._scoped:
            return qualified
        if model in self._scoped or self.default is not None or (source_id, engine, model) not in self._published:
            return model
        return f"{qualified}@{source_id:016x}"

    def get(self, model: str, engine: str = "", source_id: int = 0) -> Recipe | None:
        given = self.given(model, engine)
        return given if given is not None else self._published.get((source_id, engine, model))

    def resolve(self, model: str, engine: str = "", source_id: int = 0) -> Recipe:
        """The lookup's recipe; `UnknownModel` names the model when the book has none for it."""
        recipe = self.get(model, engine, source_id)
        if recipe is None:
            have = [*self._scoped, *(f"{e}:{m}" for _, e, m in self._published)]
            raise UnknownModel(f"no recipe for model {model!r} from engine {engine or '?'} (have: "
                               f"{', '.join(dict.fromkeys(have)) or 'none given, none published'}); give one with "
                               "--recipe MODEL=RECIPE or run an engine whose shim publishes its own")
        return recipe

    def keyed(self, triples: Iterable[tuple[int, str, str]]) -> dict[SourceKey, tuple[str, Recipe]]:
        """Each (source_id, engine, model)'s recipe key and recipe, for paths that resolve once
        per source instead of once per lookup; `UnknownModel` on the first without one."""
        return {(src, engine, model): (self.key(model, engine, src), self.resolve(model, engine, src))
                for src, engine, model in triples}

    def __repr__(self) -> str:
        named = ", ".join(f"{k}={r.name}" for k, r in self._scoped.items())
        default = f"default={self.default.name}" if self.default is not None else ""
        published = f"published={len(self._published)}" if self._published else ""
        return f"RecipeBook({', '.join(x for x in (named, default, published) if x)})"
