"""`emit_seq`: the total order of one bucket's emissions (docs/contract.md §3)."""

from __future__ import annotations

from typing import NamedTuple

# Named tuples, not frozen dataclasses: both compare field by field in order, but a
# tuple is built and compared in C (twice as fast to build, five times to compare).
# An SDK builds two per delivered event and its cursor compares them per event.
# Being tuples, they also compare with plain tuples: compare EmitSeqs with EmitSeqs.


class EpochId(NamedTuple):
    """A bucket's log lineage: bumped only by a committed EPOCH_CREATE."""

    bucket_uuid: str
    epoch_counter: int


class EmitSeq(NamedTuple):
    """`(bucket_uuid, epoch_counter, commit_index)`, ordered lexicographically.

    `commit_index` is the Raft index of the *source* entry; it keeps growing across
    epochs, so the order is total and gapless per bucket.
    """

    bucket_uuid: str
    epoch_counter: int
    commit_index: int

    @property
    def epoch_id(self) -> EpochId:
        return EpochId(self.bucket_uuid, self.epoch_counter)

    def pack(self) -> list[object]:
        """The canonical msgpack form."""
        return [self.bucket_uuid, self.epoch_counter, self.commit_index]

    def __str__(self) -> str:
        return f"({self.bucket_uuid}, {self.epoch_counter}, {self.commit_index})"
