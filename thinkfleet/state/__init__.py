"""The job state in Redis — job record, claims, parts, done, dead, deliveries, counters, alarm — in one room.

Every transition of a prompt's state machine is named here (``ledger.py``; its Lua scripts live in
``lua/``), and the job record has one decoder with one set of defaults (``job.py``).
"""
