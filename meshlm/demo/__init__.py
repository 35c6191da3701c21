"""`meshlm demo`: the local mesh as real processes on loopback (launcher.py, procs.py), tenants'
traffic through it (traffic.py), what a caller saw (sla.py) and the report (report.py,
identity.py); scenario.py lists the scenarios in scenarios/ and holds what they share; hosts.py
puts pieces on hosts of their own (network namespaces on a bridge) for runs across hosts."""
