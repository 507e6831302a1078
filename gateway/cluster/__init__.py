"""Several gateway replicas on one PostgreSQL database.

The database is the only arbiter: leases (`leases`) say which replica owns a named
thing until when, by the database's clock; `LeaderRole` holds one such lease for a
single-holder job (a platform's long-poll connection, housekeeping); `Heartbeat` keeps
every lease of this replica alive and tells it when it must stop acting on them;
`Listener` wakes a replica when another one commits something it waits for.

This package imports nothing of the gateway's: the runner wires it to the store.
"""

from gateway.cluster.heartbeat import Heartbeat
from gateway.cluster.leader import LeaderRole
from gateway.cluster.leases import make_owner_id
from gateway.cluster.notify import Listener, notify

__all__ = ["Heartbeat", "LeaderRole", "Listener", "make_owner_id", "notify"]
