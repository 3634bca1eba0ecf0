"""The broker's room: everything thinkfleet knows about Celery and kombu's Redis transport.

Nothing outside this package imports kombu or spells a kombu key; producer/ and workers/ meet here.

- :mod:`~thinkfleet.broker.keys` — kombu's key names: the priority lists (``queue``, ``queue\\x06\\x16N``), the
  workers' host lists (``queue:host:{worker}``) and the ack-emulation keys (``unacked``, ``unacked_index``,
  ``unacked_mutex``) under our prefix.
- :mod:`~thinkfleet.broker.celery_app` — the one Celery configuration (:func:`make_app`), shared by the
  producer (publisher only) and the worker (``workers/app.py`` registers the task on it).
- :mod:`~thinkfleet.broker.envelope` — a Celery message captured once and filled in per prompt.
- :mod:`~thinkfleet.broker.queues` — what is on the broker: queue lists, task ids, the unacked hash.
- :mod:`~thinkfleet.broker.transit` — the transit pop (a popped message is never only in memory).
- :mod:`~thinkfleet.broker.affinity` — a conversation's next turn offered first to the host whose prefix cache
  holds it (host lists, their pop and the sweep that hands stale offers to the shared queue).
- :mod:`~thinkfleet.broker.visibility` — a live worker re-scores the messages it holds.
- :mod:`~thinkfleet.broker.guard` — compressed messages refused before kombu inflates them.

Importing this package imports nothing: each module is loaded when it is needed (the producer never
loads the transit transport, and nothing here loads the worker runtime).
"""
