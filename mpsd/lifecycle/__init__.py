"""Who owns the daemon's life: the supervisor that starts, checks and restarts it (supervisor.py,
with v3.py for an MPS v3 daemon), a daemon that outlives mpsd (independent.py) and its holder
(holder.py), adopting a running one (adoption.py), the defaults kept as configured (keeper.py),
a second mpsd standing by during a rollout (standby.py), and what they publish: the health board
the faces read (health.py) and the supervisor's state (snapshot.py).

May import mpsd.sharing, mpsd.alloc, mpsd.daemon, mpsd.inventory, mpsd.config and the base
modules; never a face (mpsd.plugin, mpsd.dra, mpsd.mig) or the composition root."""
