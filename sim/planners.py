"""Broken planners for PLN-01 (a replica whose planner disagrees with the others)."""

from __future__ import annotations

from typing import Final

from sevendb.outbox.query import Plan, Planner, Query, QueryKind, plan_query


def broken_planner(query: Query) -> Plan:
    """Plans like production but hashes differently: caught at SUBSCRIBE (plan_hash)."""
    plan = plan_query(query)
    return Plan(plan.kind, plan.arg, plan.plan_hash ^ 0x5EED)


def sneaky_planner(query: Query) -> Plan:
    """Same plan_hash, different plan: a PREFIX query matches every key. Only the
    OUTBOX_WRITE digest can reveal it."""
    plan = plan_query(query)
    if plan.kind is QueryKind.PREFIX:
        return Plan(plan.kind, "", plan.plan_hash)
    return plan


PLANNERS: Final[dict[str, Planner]] = {"broken": broken_planner, "sneaky": sneaky_planner}


def planner_name(planner: Planner) -> str:
    for name, known in PLANNERS.items():
        if known is planner:
            return name
    return "<custom>"
