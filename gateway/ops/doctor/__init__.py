"""`hermes-gateway doctor [--repair] [--json]`: check the state directory, fix what is safe.

Each check yields one `Finding`. `--repair` (only while no gateway runs: it holds the
home's lock, `gateway.store.homelock`, so none starts meanwhile) fixes the repairable ones,
most fundamental first, then checks again. A damaged search.db or memory.db (indexes
derived from state.db) is a warning, set aside by --repair. A damaged `state.db` is never
deleted: it is set aside as `state.db.corrupt-<time>`, a fresh database is built next to
it from every row that can still be read, and the routing index is rebuilt from the
transcripts and the `sessions.json` mirror.

With `storage.backend: postgres` the state.db checks give way to the database's: it
answers, its schema version, its `leases` table (`check_postgres`).

Exit codes: 0 no errors, 1 errors (remaining after --repair), or --repair refused.

Modules: `findings` (Finding, Paths, read-only looks at the files), `checks`, `repairs`
(and the rebuild of a damaged state.db), `command` (the CLI's entry).
"""

from gateway.ops.doctor.checks import run_checks
from gateway.ops.doctor.command import add_doctor_parser, cmd_doctor
from gateway.ops.doctor.findings import ERROR, OK, WARN, Finding, Paths, gateway_running
from gateway.ops.doctor.repairs import rebuild_state_db, run_repairs

__all__ = [
    "ERROR",
    "OK",
    "WARN",
    "Finding",
    "Paths",
    "add_doctor_parser",
    "cmd_doctor",
    "gateway_running",
    "rebuild_state_db",
    "run_checks",
    "run_repairs",
]
