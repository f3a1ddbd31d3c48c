"""sevendb.proto: the wire contract (package ``sevendb.v1``) and its generated Python code.

``sevendb.proto`` (the file next to this one) is the single source of truth. The modules
generated from it are committed, not built at install time:

* ``sevendb_pb2`` / ``sevendb_pb2.pyi`` -- the messages and their type stubs
* ``sevendb_pb2_grpc`` -- ``SevenDBStub``, ``SevenDBServicer`` and
  ``add_SevenDBServicer_to_server``

Import them explicitly (``from sevendb.proto import sevendb_pb2``); this package
re-exports nothing so that importing it stays cheap. After editing the .proto, regenerate
with ``python deploy/gen_proto.py`` and commit the result; ``python deploy/gen_proto.py
--check`` (part of the test suite) fails while the committed code is stale. See
docs/wire.md for the contract itself.

Beside the generated code live what both ends of the wire share: `codec` (messages to
and from the core's types, and the trailers and statuses errors travel as), `mailbox`
(calls into an asyncio loop from other threads) and `threads` (OS thread names).

May import: `sevendb.outbox`.
"""

__all__: list[str] = []
