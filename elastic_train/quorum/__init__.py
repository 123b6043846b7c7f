"""Quorum fault tolerance (``--ft quorum``, issue 11): healthy workers keep training through a
peer's failure; the membership is agreed every step (torchft's Lighthouse and Manager)."""
