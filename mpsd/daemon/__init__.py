"""Talking to and judging one MPS control daemon: the control protocols (control.py: v2's
interactive front-end; control3.py: v3's verbs), the daemon process mpsd starts (process.py),
its pipe and log directories (dirs.py) and log files (logfiles.py), its defaults read and
compared (drift.py) and who changed them (contest.py), servers in FAULT (faults.py), clients
of several UIDs (multiuser.py), who is behind its sockets (peer.py) and whether a running one
is genuine (genuine.py), who fills a socket's accept queue (backlog.py), the GPUs' compute
mode (computemode.py) and static SM partitions (smpartition.py).

It decides nothing about the daemon's life (mpsd.lifecycle does). May import mpsd.config,
mpsd.units, mpsd.errors, mpsd.trees, mpsd.logs; nothing above."""
