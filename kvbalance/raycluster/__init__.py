"""Real cluster serving on Ray: one front end, one actor per instance with a real model, the simulator's policies.

``config`` (the ``cluster:`` section of ``kvbalance serve --cluster``), ``actor`` (an ``LLMEngine`` in a Ray
actor, stepped by the front end), ``connector`` (the KV connector's two halves over Ray's object store),
``store`` (the global KV store actor), ``migration`` (Llumnix's live request migration between actors),
``backend`` (the front end's ``server.backend.Backend``: routing, P/D hand-off, faults), ``metrics``
(per-instance and router series for ``/metrics``), ``launch`` (starting Ray and the actors, serving).
Ray is imported only where an actor or the front end runs (the ``ray`` extra).
"""
