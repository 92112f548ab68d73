"""Accounting of compiled programs: FLOPs, memory and collectives, each computed in one place."""
