"""Real processes for the tests and the benchmarks: launch them, reap them, fault them.

* ``processes``: run a command in a session of its own and reap it and everything it started
  (torchrun's workers included) on success, failure or timeout; the environment a child gets.
* ``agents``: torchrun agents (``jobs/elastic-agent.sh``), each standing for a node, with a
  standalone rendezvous store; kill, freeze or signal a whole node; check the checkpoint lineage
  a run left behind.
* ``netns``: hosts in network namespaces on a private bridge, for partition tests (root only).

Not part of the training API (nothing here is exported from ``elastic_train``): these modules
run the repository's own scripts (``jobs/``), so they need a source checkout, and they report a
broken expectation with ``AssertionError`` because pytest shows those best.
"""
