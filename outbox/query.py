"""Subscription queries and their plans.

A plan is what a replica derives from a query; its `plan_hash` travels in the
SUBSCRIBE entry so that every replica can check it derived the same plan (a
replica that does not must quarantine itself: docs/contract.md §12, PLN-01).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

import msgpack
import xxhash

PLANNER_VERSION: Final = 1
"""Bumped whenever the meaning of a plan changes; part of every plan hash."""


class QueryKind(IntEnum):
    KEY = 0
    PREFIX = 1
    ALL = 2


@dataclass(frozen=True, slots=True)
class Query:
    """`KEY k` (one key), `PREFIX p` (keys starting with p) or `ALL`."""

    kind: QueryKind
    arg: str = ""

    def __str__(self) -> str:
        return {QueryKind.KEY: "key:", QueryKind.PREFIX: "prefix:", QueryKind.ALL: "all"}[
            self.kind
        ] + self.arg

    @classmethod
    def parse(cls, text: str) -> Query:
        """Parse the CLI form: `key:K`, `prefix:P` or `all`."""
        if text == "all":
            return cls(QueryKind.ALL)
        kind, sep, arg = text.partition(":")
        if sep and kind == "key" and arg:
            return cls(QueryKind.KEY, arg)
        if sep and kind == "prefix":
            return cls(QueryKind.PREFIX, arg)
        raise ValueError(f"query must be key:K, prefix:P or all, not {text!r}")


@dataclass(frozen=True, slots=True)
class Plan:
    """How a replica evaluates a query against a change."""

    kind: QueryKind
    arg: str
    plan_hash: int

    def matches(self, key: str) -> bool:
        if self.kind is QueryKind.KEY:
            return key == self.arg
        if self.kind is QueryKind.PREFIX:
            return key.startswith(self.arg)
        return True


Planner = Callable[[Query], Plan]


def plan_query(query: Query) -> Plan:
    """The production planner: deterministic, versioned."""
    arg = "" if query.kind is QueryKind.ALL else query.arg
    canonical = msgpack.packb([PLANNER_VERSION, int(query.kind), arg], use_bin_type=True)
    return Plan(query.kind, arg, xxhash.xxh64_intdigest(canonical))


class QueryIndex:
    """Which subscriptions a key matches, by their plans: one lookup for `KEY`
    plans, a scan of the distinct prefixes for `PREFIX` ones, every `ALL` one."""

    def __init__(self) -> None:
        self._key: dict[str, set[str]] = {}
        self._prefix: dict[str, set[str]] = {}
        self._all: set[str] = set()

    def add(self, sub_id: str, plan: Plan) -> None:
        if plan.kind is QueryKind.KEY:
            self._key.setdefault(plan.arg, set()).add(sub_id)
        elif plan.kind is QueryKind.PREFIX:
            self._prefix.setdefault(plan.arg, set()).add(sub_id)
        else:
            self._all.add(sub_id)

    def remove(self, sub_id: str, plan: Plan) -> None:
        if plan.kind is QueryKind.ALL:
            self._all.discard(sub_id)
            return
        index = self._key if plan.kind is QueryKind.KEY else self._prefix
        sub_ids = index.get(plan.arg)
        if sub_ids is not None:
            sub_ids.discard(sub_id)
            if not sub_ids:
                del index[plan.arg]

    def matching(self, key: str) -> set[str]:
        """The sub_ids whose plan matches `key` (a new set, in no order)."""
        hits = set(self._all)
        hits.update(self._key.get(key, ()))
        for prefix, sub_ids in self._prefix.items():
            if key.startswith(prefix):
                hits.update(sub_ids)
        return hits
